// PIL's Image.resize, bit for bit, on 8-bit images (timm resizes PIL images, so this is what makes
// imgtrain's eval tensors equal timm's). The filters are Pillow's: a separable two-pass resample
// whose support widens with the downscale factor (antialiasing), coefficients normalised in double
// and rounded to 22-bit fixed point, one rounding to uint8 after each pass, in Pillow 13's pass
// order (horizontal first unless the height shrinks by more than twice as many pixels as the
// width; Pillow 12 and older always go horizontal first, which differs by a level in a few pixels
// of such images); nearest is Pillow's affine nearest-neighbour scale. The reference is the
// Pillow pinned in requirements-test.txt.
// Pillow's reduce() pre-shrink only runs when a caller passes reducing_gap, which torchvision's
// resize (timm's path) never does, so it has no counterpart here.
#pragma once
#include <opencv2/core.hpp>

#include <string>

namespace imgtrain::data {

enum class Resample { nearest, box, bilinear, hamming, bicubic, lanczos };

// timm's interpolation names (str_to_pil_interp): nearest, bilinear, bicubic, box, hamming, lanczos.
// Throws std::invalid_argument for anything else.
Resample parse_resample(const std::string& name);

// `src` (CV_8U, 1 to 4 channels, any row stride) resized to `to` with Pillow's filter, and only
// the part `roi` of that result computed (the center crop that follows the resize, at no cost for
// the pixels it drops; each output pixel depends only on its own position, so a cut is exact).
// An empty roi means the whole output.
cv::Mat pil_resize(const cv::Mat& src, cv::Size to, Resample filter, cv::Rect roi = {});

// PIL's convert('L') of an RGB image: L = (19595 R + 38470 G + 7471 B + 0x8000) >> 16.
cv::Mat pil_rgb_to_l(const cv::Mat& rgb);

}  // namespace imgtrain::data
