#include "data/target.h"

#include "core/rng.h"

#include <torch/torch.h>

#include <opencv2/core.hpp>

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace imgtrain::data {

coco::Rle rle_hflip(const coco::Rle& r) {
  // Column-major runs: mirroring reverses the order of the w columns of h pixels each.
  const auto m = coco::rle_decode(r);
  std::vector<uint8_t> out(m.size());
  const size_t h = r.h, w = r.w;
  for (size_t x = 0; x < w; ++x) std::memcpy(out.data() + x * h, m.data() + (w - 1 - x) * h, h);
  return coco::rle_encode(out.data(), r.h, r.w);
}

bool random_hflip(cv::Mat& img, BoxTarget& t, double p, std::mt19937_64& rng) {
  if (!(uniform01(rng) < p)) return false;
  cv::flip(img, img, 1);
  for (auto& m : t.masks) m = rle_hflip(m);
  if (t.boxes.defined() && t.boxes.numel()) {
    const double w = double(img.cols);
    auto x1 = t.boxes.select(1, 0).clone(), x2 = t.boxes.select(1, 2).clone();
    t.boxes.select(1, 0).copy_(w - x2);
    t.boxes.select(1, 2).copy_(w - x1);
  }
  return true;
}

void resize_boxes(BoxTarget& t, cv::Size from, cv::Size to) {
  if (!t.boxes.defined() || !t.boxes.numel()) return;
  // torchvision's resize_boxes: ratios in float32, x by the width ratio, y by the height ratio
  const auto rw = torch::tensor(float(to.width)) / torch::tensor(float(from.width));
  const auto rh = torch::tensor(float(to.height)) / torch::tensor(float(from.height));
  auto scale = torch::stack({rw, rh, rw, rh}).to(t.boxes.device());
  t.boxes = t.boxes * scale;
}

at::Tensor dense_masks(const BoxTarget& t, const at::TensorOptions& opt) {
  if (t.masks.empty()) return torch::empty({0, 0, 0}, opt.dtype(torch::kByte));
  const int64_t h = t.masks.front().h, w = t.masks.front().w;
  auto out = torch::empty({int64_t(t.masks.size()), h, w}, torch::kByte);
  for (size_t i = 0; i < t.masks.size(); ++i) {
    const auto& r = t.masks[i];
    if (r.h != uint32_t(h) || r.w != uint32_t(w)) throw std::invalid_argument("dense_masks: masks of different sizes");
    const auto m = coco::rle_decode(r);  // column-major
    out[int64_t(i)].copy_(torch::from_blob(const_cast<uint8_t*>(m.data()), {w, h}, torch::kByte).t());
  }
  return out.to(opt.device());
}

ResizedSample detection_resize(const at::Tensor& image, const BoxTarget& t, double min_size, double max_size,
                               bool with_masks) {
  TORCH_CHECK(image.dim() == 3, "detection_resize: expected a [C, H, W] image");
  const int64_t h = image.size(1), w = image.size(2);
  // torchvision (eager): the scale in double, each side floor(side * scale), then the kernel
  // recomputes its own scale from the integer sizes (recompute_scale_factor=True).
  const double scale = std::min(min_size / double(std::min(h, w)), max_size / double(std::max(h, w)));
  const int64_t oh = int64_t(std::floor(double(h) * scale)), ow = int64_t(std::floor(double(w) * scale));
  ResizedSample out;
  out.image = at::upsample_bilinear2d(image.unsqueeze(0), {oh, ow}, false, std::nullopt, std::nullopt).squeeze(0);
  if (t.boxes.defined()) {
    BoxTarget b{t.boxes.to(image.device()), {}};
    resize_boxes(b, {int(w), int(h)}, {int(ow), int(oh)});
    out.boxes = b.boxes;
  }
  if (with_masks && !t.masks.empty()) {
    auto m = dense_masks(t, image.options()).unsqueeze(1).to(at::kFloat);
    out.masks = at::upsample_nearest2d(m, {oh, ow}, std::nullopt, std::nullopt).select(1, 0).to(at::kByte);
  }
  return out;
}

at::Tensor batch_images(const std::vector<at::Tensor>& images, int64_t multiple) {
  TORCH_CHECK(!images.empty() && multiple > 0, "batch_images: expected images and a positive multiple");
  int64_t c = images.front().size(0), hmax = 0, wmax = 0;
  for (auto& im : images) {
    TORCH_CHECK(im.dim() == 3 && im.size(0) == c, "batch_images: images must be [C, H, W] with one C");
    hmax = std::max(hmax, im.size(1));
    wmax = std::max(wmax, im.size(2));
  }
  const auto up = [&](int64_t v) { return int64_t(std::ceil(double(v) / double(multiple)) * double(multiple)); };
  auto out = torch::zeros({int64_t(images.size()), c, up(hmax), up(wmax)}, images.front().options());
  for (size_t i = 0; i < images.size(); ++i)
    out[int64_t(i)].narrow(1, 0, images[i].size(1)).narrow(2, 0, images[i].size(2)).copy_(images[i]);
  return out;
}

PaddedBatch pad_collate(const std::vector<cv::Mat>& images, int64_t multiple) {
  if (multiple <= 0) throw std::invalid_argument("pad_collate: multiple must be positive");
  PaddedBatch out;
  const int64_t b = int64_t(images.size());
  out.sizes = torch::empty({b, 2}, torch::kLong);
  if (b == 0) {
    out.images = torch::empty({0, 0, 0, 0}, torch::kByte);
    return out;
  }
  const int ch = images.front().channels();
  int64_t hmax = 0, wmax = 0;
  for (auto& im : images) {
    if (im.depth() != CV_8U || im.channels() != ch)
      throw std::invalid_argument("pad_collate: images must be uint8 with one channel count");
    hmax = std::max<int64_t>(hmax, im.rows);
    wmax = std::max<int64_t>(wmax, im.cols);
  }
  const int64_t h = (hmax + multiple - 1) / multiple * multiple, w = (wmax + multiple - 1) / multiple * multiple;
  out.images = torch::zeros({b, h, w, ch}, torch::kByte);
  auto* sz = out.sizes.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    const cv::Mat& im = images[size_t(i)];
    sz[2 * i] = im.rows;
    sz[2 * i + 1] = im.cols;
    cv::Mat dst(int(h), int(w), CV_8UC(ch), out.images[i].data_ptr<uint8_t>());
    im.copyTo(dst(cv::Rect(0, 0, im.cols, im.rows)));
  }
  return out;
}

}  // namespace imgtrain::data
