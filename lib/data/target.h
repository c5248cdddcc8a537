// Targets that move with the image (detection: boxes and their labels) and the collate for
// images of different sizes. Geometric transforms draw their parameters once and apply them to
// the image and its target alike; the pad collate lays a list of images into one zero-padded
// batch whose sides are multiples of 32, keeping each image's size (torchvision's
// GeneralizedRCNNTransform.batch_images, size_divisible 32). Classification keeps its
// fixed-size stacked batches (the loader's fast path) and carries class indices only.
#pragma once
#include "data/coco_mask.h"

#include <ATen/core/Tensor.h>
#include <opencv2/core.hpp>

#include <random>
#include <vector>

namespace imgtrain::data {

struct BoxTarget {
  at::Tensor boxes;   // float32 [N, 4], (x1, y1, x2, y2) in pixels of the image it belongs to
  at::Tensor labels;  // int64 [N], contiguous class labels
  // Instance masks at the image's size, one per box, as RLE (COCO has images with > 100
  // instances: dense masks are made on the device, at the model's input size; see dense_masks).
  std::vector<coco::Rle> masks;
  int64_t image_id = -1;  // the dataset's id (COCO image id), for writing results
  int64_t min_size = 0;   // the shorter side the model resizes this image to (drawn per sample); 0 = its default
};

// One image and its target through a horizontal flip drawn with probability `p` from `rng`
// (one draw for image, boxes and masks). Returns whether it flipped.
bool random_hflip(cv::Mat& img, BoxTarget& t, double p, std::mt19937_64& rng);
// torchvision's large-scale jitter (references/detection: ScaleJitter(target_size=(size, size))
// then FixedSizeCrop(size, fill)) with its random draws given: `scale` from the scale range and
// `crop` in [0, 1) (float32, as torch.rand). The image is resized by PIL's bilinear filter to
// floor(side * r), r = min(size / h, size / w) * scale in float32; boxes by the float32 ratio of
// the new to the old side; masks by torch's nearest interpolation. A side longer than `size` is
// cropped at offset int((side - size) * crop) (one draw for both sides); boxes are shifted,
// clamped into the crop, and those left empty dropped with their labels and masks. A side shorter
// than `size` is padded at the bottom / right with `fill` (masks with 0). Result: size x size.
void scale_jitter_crop(cv::Mat& img, BoxTarget& t, int64_t size, float scale, float crop, const cv::Scalar& fill);
// The boxes of an image resized from `from` to `to` (each axis scaled by its own ratio).
void resize_boxes(BoxTarget& t, cv::Size from, cv::Size to);
// A mask mirrored left to right, in RLE form (the column order reversed).
coco::Rle rle_hflip(const coco::Rle& r);

// torchvision's GeneralizedRCNNTransform on one image and its target, with the same float
// arithmetic: the scale min(min_size / shorter side, max_size / longer side) in float32, the image
// (float CHW, already normalised) resized by F.interpolate(scale_factor, bilinear,
// recompute_scale_factor) so each side is floor(side * scale), boxes by resize_boxes' float32
// ratios, and masks decoded and resized by nearest interpolation at that scale.
struct ResizedSample {
  at::Tensor image;  // float [C, H', W']
  at::Tensor boxes;  // float32 [N, 4]
  at::Tensor masks;  // uint8 [N, H', W'] (undefined when the target has no masks)
};
ResizedSample detection_resize(const at::Tensor& image, const BoxTarget& t, double min_size, double max_size,
                               bool with_masks = true);
// The masks of `t` as uint8 [N, H, W] at their own size (torchvision's dense target["masks"]).
at::Tensor dense_masks(const BoxTarget& t, const at::TensorOptions& opt = {});
// GeneralizedRCNNTransform.batch_images: float CHW images zero-padded (bottom and right) into one
// [B, C, H, W] batch whose H and W are the largest sides rounded up to `multiple`.
at::Tensor batch_images(const std::vector<at::Tensor>& images, int64_t multiple = 32);

struct PaddedBatch {
  at::Tensor images;  // uint8 [B, H, W, C], H and W the largest sides rounded up to `multiple`
  at::Tensor sizes;   // int64 [B, 2]: each image's (height, width) before padding
};
// Images of one channel count (uint8 HWC, any sizes) into a zero-padded batch, top-left aligned.
PaddedBatch pad_collate(const std::vector<cv::Mat>& images, int64_t multiple = 32);

}  // namespace imgtrain::data
