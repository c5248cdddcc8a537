// Per-sample transforms on 8-bit HWC images, as timm's create_transform builds them:
// train = RandomResizedCrop(scale, ratio, interpolation) + horizontal flip,
// eval = resize the shorter side to floor(size / crop_pct) + center crop. The output always has
// `channels` channels (grayscale expanded to RGB, or RGB reduced to luma for in_chans 1).
#pragma once
#include <opencv2/core.hpp>

#include <random>
#include <string>
#include <vector>

namespace imgtrain::data {

struct TransformConfig {
  bool train = false;
  bool no_aug = false;
  int size = 224;
  int channels = 3;
  std::vector<double> scale{0.08, 1.0};
  std::vector<double> ratio{3.0 / 4.0, 4.0 / 3.0};
  double hflip = 0.5;
  std::string interpolation = "bilinear";  // train: random | bilinear | bicubic
  double crop_pct = 0.875;
};

struct CropBox {
  int top, left, height, width;
};

// timm's RandomResizedCropAndInterpolation.get_params: 10 tries, then a center crop with the
// aspect ratio clamped into `ratio`.
CropBox random_resized_crop_box(int height, int width, const std::vector<double>& scale,
                                const std::vector<double>& ratio, std::mt19937_64& rng);

cv::Mat apply_transform(const cv::Mat& img, const TransformConfig& tc, std::mt19937_64& rng);

}  // namespace imgtrain::data
