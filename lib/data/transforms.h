// Per-sample transforms on 8-bit HWC images, as timm's create_transform builds them:
// train = RandomResizedCrop(scale, ratio, interpolation) + horizontal / vertical flip + --aa policy
// or colour jitter (random erasing follows normalisation, in the trainer),
// eval = timm's transforms_imagenet_eval: by --crop-mode, center (the shorter side to
// floor(size / crop_pct), then a center crop), squash (both sides to floor(size / crop_pct), then
// a center crop) or border (the longer side to floor(size / crop_pct), then pad with the mean
// colour and center crop). Every resize is PIL's (data/resample.h), so eval tensors equal timm's
// bit for bit. The output always has
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
  std::string interpolation = "bilinear";  // nearest | bilinear | bicubic | box | hamming | lanczos (train: | random)
  double crop_pct = 0.875;
  std::string crop_mode = "center";               // eval: center | squash | border
  std::vector<double> mean{0.485, 0.456, 0.406};  // border mode's fill: round(255 * mean)
  // Eval JPEG decoding: false = the full-size IDCT then PIL's resize (timm's pixels exactly);
  // true = libjpeg-turbo's DCT-domain downscale first when the image is >= 2x the resize (faster,
  // not equal). Training's random crops always take the fast path.
  bool fast_decode = false;
  // Detection (datasets with targets): the shorter sides the model's resize takes, one drawn per
  // training sample (torchvision's min_size tuple, Detectron2's ResizeShortestEdge choices); the
  // last one for evaluation. Empty: the model's own default.
  std::vector<int64_t> min_sizes;
  // Detection, large-scale jitter (torchvision's --data-augmentation lsj) before the flip:
  // lsj_size > 0 turns it on (data/target.h scale_jitter_crop), the scale drawn from lsj_scale.
  int64_t lsj_size = 0;
  std::vector<double> lsj_scale{0.1, 2.0};
};

struct CropBox {
  int top, left, height, width;
};

// timm's RandomResizedCropAndInterpolation.get_params: 10 tries, then a center crop with the
// aspect ratio clamped into `ratio`.
CropBox random_resized_crop_box(int height, int width, const std::vector<double>& scale,
                                const std::vector<double>& ratio, std::mt19937_64& rng);

cv::Mat apply_transform(const cv::Mat& img, const TransformConfig& tc, std::mt19937_64& rng);

// The same from encoded bytes. In training, a JPEG is decoded with libjpeg-turbo's DCT-domain
// scaling (1/2, 1/4, 1/8) whenever the random crop is at least twice the output: the crop box is
// drawn on the full size first, so the random draws are those of apply_transform; the pixels
// differ from a full decode + resize by the scaled IDCT's filtering (tests state the tolerance).
// Eval transforms decode fully unless fast_decode is set. Other formats decode fully.
cv::Mat apply_transform_encoded(const std::string& bytes, const TransformConfig& tc, std::mt19937_64& rng,
                                const std::string& what);

}  // namespace imgtrain::data
