#include "data/target.h"

#include "core/rng.h"

#include <torch/torch.h>

#include <opencv2/core.hpp>

#include <cstring>
#include <stdexcept>

namespace imgtrain::data {

bool random_hflip(cv::Mat& img, BoxTarget& t, double p, std::mt19937_64& rng) {
  if (!(uniform01(rng) < p)) return false;
  cv::flip(img, img, 1);
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
  auto scale = torch::stack({rw, rh, rw, rh});
  t.boxes = t.boxes * scale;
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
