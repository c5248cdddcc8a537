// Per-sample transforms on 8-bit HWC images, as timm's create_transform builds them:
// train = RandomResizedCrop(scale, ratio, interpolation) + horizontal / vertical flip + --aa policy
// or colour jitter (random erasing follows normalisation, in the trainer),
// eval = resize the shorter side to floor(size / crop_pct) + center crop. The output always has
// `channels` channels (grayscale expanded to RGB, or RGB reduced to luma for in_chans 1).
#pragma once
#include "data/augment.h"

#include <opencv2/core.hpp>

#include <memory>

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
  double vflip = 0.0;
  // timm's secondary transforms: an --aa policy (RandAugment / AutoAugment / AugMix), else
  // --color-jitter (brightness, contrast, saturation factor; 0 = off). The policy is parsed once.
  std::shared_ptr<const AugmentPolicy> auto_augment;
  double color_jitter = 0.0;
  std::string interpolation = "bilinear";  // train: random | bilinear | bicubic
  double crop_pct = 0.875;
  // Detection (datasets with targets): the shorter sides the model's resize takes, one drawn per
  // training sample (torchvision's min_size tuple, Detectron2's ResizeShortestEdge choices); the
  // last one for evaluation. Empty: the model's own default.
  std::vector<int64_t> min_sizes;
};

struct CropBox {
  int top, left, height, width;
};

// timm's RandomResizedCropAndInterpolation.get_params: 10 tries, then a center crop with the
// aspect ratio clamped into `ratio`.
CropBox random_resized_crop_box(int height, int width, const std::vector<double>& scale,
                                const std::vector<double>& ratio, std::mt19937_64& rng);

cv::Mat apply_transform(const cv::Mat& img, const TransformConfig& tc, std::mt19937_64& rng);

// The same from encoded bytes. A JPEG is decoded with libjpeg-turbo's DCT-domain scaling (1/2,
// 1/4, 1/8) whenever the region that is resized (the random crop, or the eval resize's source) is
// at least twice the output: the crop box is drawn on the full size first, so the random draws
// are those of apply_transform; the pixels differ from a full decode + resize by the scaled IDCT's
// filtering (tests state the tolerance). Other formats decode fully.
cv::Mat apply_transform_encoded(const std::string& bytes, const TransformConfig& tc, std::mt19937_64& rng,
                                const std::string& what);

}  // namespace imgtrain::data
