#include "data/target.h"

#include "core/rng.h"
#include "data/resample.h"

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

namespace {

// torch's nearest source index (upsample nearest, size given): floor(dst * (in / out)) in float32,
// at most in - 1.
std::vector<uint32_t> nearest_sources(int64_t in, int64_t out) {
  std::vector<uint32_t> src(static_cast<size_t>(out));
  const float s = float(in) / float(out);
  for (int64_t d = 0; d < out; ++d)
    src[size_t(d)] = uint32_t(std::min<int64_t>(int64_t(std::floor(float(d) * s)), in - 1));
  return src;
}

}  // namespace

void scale_jitter_crop(cv::Mat& img, BoxTarget& t, int64_t size, float scale, float crop, const cv::Scalar& fill) {
  if (size < 1) throw std::invalid_argument("scale_jitter_crop: size < 1");
  const int64_t oh = img.rows, ow = img.cols;
  // ScaleJitter: r = min(size / h, size / w) * scale, the Python float taken to float32 by the
  // multiplication with the float32 draw; the new sides truncate float32 products. A side that
  // would be 0 (torchvision fails there) is kept at 1.
  const float r = float(std::min(double(size) / double(oh), double(size) / double(ow))) * scale;
  const int64_t nh = std::max<int64_t>(1, int64_t(float(oh) * r));
  const int64_t nw = std::max<int64_t>(1, int64_t(float(ow) * r));
  img = pil_resize(img, cv::Size(int(nw), int(nh)), Resample::bilinear);
  const bool has_boxes = t.boxes.defined() && t.boxes.numel() > 0;
  if (has_boxes) {
    const float rx = float(double(nw) / double(ow)), ry = float(double(nh) / double(oh));
    t.boxes = t.boxes * torch::tensor({rx, ry, rx, ry}, t.boxes.options());
  }
  // FixedSizeCrop: one draw places the crop on both sides; then pad to size x size.
  const int64_t ch = std::min(nh, size), cw = std::min(nw, size);
  int64_t top = 0, left = 0;
  std::vector<int64_t> keep;  // the instances that survive the crop (all when nothing is cut)
  const int64_t n = has_boxes ? t.boxes.size(0) : int64_t(t.masks.size());
  if (ch != nh || cw != nw) {
    top = int64_t(float(std::max<int64_t>(nh - size, 0)) * crop);
    left = int64_t(float(std::max<int64_t>(nw - size, 0)) * crop);
    img = img(cv::Rect(int(left), int(top), int(cw), int(ch))).clone();
    if (has_boxes) {
      auto b = t.boxes.clone();
      auto x = b.slice(1, 0, 4, 2), y = b.slice(1, 1, 4, 2);
      x.sub_(float(left)).clamp_(0.0f, float(cw));
      y.sub_(float(top)).clamp_(0.0f, float(ch));
      const auto valid = (b.select(1, 0) < b.select(1, 2)).logical_and(b.select(1, 1) < b.select(1, 3));
      const auto idx = valid.nonzero().view({-1});
      t.boxes = b.index_select(0, idx);
      if (t.labels.defined() && t.labels.numel() == n) t.labels = t.labels.index_select(0, idx);
      const auto acc = idx.accessor<int64_t, 1>();
      for (int64_t i = 0; i < idx.size(0); ++i) keep.push_back(acc[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) keep.push_back(i);
  }
  if (ch < size || cw < size)
    cv::copyMakeBorder(img, img, 0, int(size - ch), 0, int(size - cw), cv::BORDER_CONSTANT, fill);
  if (!t.masks.empty()) {
    // nearest resize, crop and zero pad in one pass over the column-major output
    const auto sy = nearest_sources(oh, nh), sx = nearest_sources(ow, nw);
    std::vector<coco::Rle> out;
    out.reserve(keep.size());
    std::vector<uint8_t> dst(size_t(size * size));
    for (int64_t k : keep) {
      if (k >= int64_t(t.masks.size())) throw std::invalid_argument("scale_jitter_crop: fewer masks than boxes");
      const auto& m = t.masks[size_t(k)];
      if (int64_t(m.h) != oh || int64_t(m.w) != ow) throw std::invalid_argument("scale_jitter_crop: mask size");
      const auto src = coco::rle_decode(m);
      std::fill(dst.begin(), dst.end(), uint8_t(0));
      for (int64_t x = 0; x < cw; ++x) {
        const uint8_t* col = src.data() + size_t(sx[size_t(x + left)]) * size_t(oh);
        uint8_t* o = dst.data() + size_t(x) * size_t(size);
        for (int64_t y = 0; y < ch; ++y) o[y] = col[sy[size_t(y + top)]];
      }
      out.push_back(coco::rle_encode(dst.data(), uint32_t(size), uint32_t(size)));
    }
    t.masks = std::move(out);
  }
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
