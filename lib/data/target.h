// Targets that move with the image (detection: boxes and their labels) and the collate for
// images of different sizes. Geometric transforms draw their parameters once and apply them to
// the image and its target alike; the pad collate lays a list of images into one zero-padded
// batch whose sides are multiples of 32, keeping each image's size (torchvision's
// GeneralizedRCNNTransform.batch_images, size_divisible 32). Classification keeps its
// fixed-size stacked batches (the loader's fast path) and carries class indices only.
#pragma once
#include <ATen/core/Tensor.h>
#include <opencv2/core.hpp>

#include <random>
#include <vector>

namespace imgtrain::data {

struct BoxTarget {
  at::Tensor boxes;   // float32 [N, 4], (x1, y1, x2, y2) in pixels of the image it belongs to
  at::Tensor labels;  // int64 [N], contiguous class labels
};

// One image and its target through a horizontal flip drawn with probability `p` from `rng`
// (one draw for both). Returns whether it flipped.
bool random_hflip(cv::Mat& img, BoxTarget& t, double p, std::mt19937_64& rng);
// The boxes of an image resized from `from` to `to` (each axis scaled by its own ratio).
void resize_boxes(BoxTarget& t, cv::Size from, cv::Size to);

struct PaddedBatch {
  at::Tensor images;  // uint8 [B, H, W, C], H and W the largest sides rounded up to `multiple`
  at::Tensor sizes;   // int64 [B, 2]: each image's (height, width) before padding
};
// Images of one channel count (uint8 HWC, any sizes) into a zero-padded batch, top-left aligned.
PaddedBatch pad_collate(const std::vector<cv::Mat>& images, int64_t multiple = 32);

}  // namespace imgtrain::data
