#include "data/transforms.h"

#include "core/rng.h"
#include "data/dataset.h"
#include "data/resample.h"

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>

#include <cmath>

namespace imgtrain::data {

CropBox random_resized_crop_box(int height, int width, const std::vector<double>& scale,
                                const std::vector<double>& ratio, std::mt19937_64& rng) {
  const double area = double(height) * width;
  const double log_r0 = std::log(ratio[0]), log_r1 = std::log(ratio[1]);
  for (int attempt = 0; attempt < 10; ++attempt) {
    double target_area = uniform(rng, scale[0], scale[1]) * area;
    double aspect = std::exp(uniform(rng, log_r0, log_r1));
    int w = int(std::nearbyint(std::sqrt(target_area * aspect)));
    int h = int(std::nearbyint(std::sqrt(target_area / aspect)));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      int top = int(randint(rng, 0, height - h));
      int left = int(randint(rng, 0, width - w));
      return {top, left, h, w};
    }
  }
  double in_ratio = double(width) / height;
  int w, h;
  if (in_ratio < std::min(ratio[0], ratio[1])) {
    w = width;
    h = int(std::nearbyint(w / std::min(ratio[0], ratio[1])));
  } else if (in_ratio > std::max(ratio[0], ratio[1])) {
    h = height;
    w = int(std::nearbyint(h * std::max(ratio[0], ratio[1])));
  } else {
    w = width;
    h = height;
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

namespace {

cv::Mat resize_to(const cv::Mat& src, cv::Size to, const std::string& interp) {
  if (src.size() == to) return src;
  return pil_resize(src, to, parse_resample(interp));
}

// timm loads images with PIL's convert('RGB') / convert('L').
cv::Mat to_channels(const cv::Mat& img, int channels) {
  if (img.channels() == channels) return img;
  if (channels == 1 && img.channels() == 3) return pil_rgb_to_l(img);
  if (channels != 3 || img.channels() != 1)
    throw std::invalid_argument("cannot convert an image to the requested channel count");
  cv::Mat out;
  cv::cvtColor(img, out, cv::COLOR_GRAY2RGB);
  return out;
}

void check_resized_size(int64_t w, int64_t h, int64_t nw, int64_t nh) {
  // a 1 x 1,000,000 image would become 256 x 256,000,000 here
  if (const int64_t limit = max_image_pixels(); limit > 0 && nw * nh > limit)
    throw DecodeError(fmt::format("an image of {}x{} resized to {}x{} is above the limit of {} pixels; skipped", w, h,
                                  nw, nh, limit));
}

// timm's eval geometry (transforms_imagenet_eval) for a square crop: the size of the resize, then
// torchvision's CenterCrop (pad with 0 when the crop is larger) or timm's CenterCropOrPad (pad
// with the mean colour). Only the cropped part of the resize is computed.
cv::Mat resize_center_crop(const cv::Mat& img, int scale, int crop, const TransformConfig& tc, const std::string& interp) {
  const int64_t h = img.rows, w = img.cols;
  int64_t nh, nw;
  cv::Scalar fill = cv::Scalar::all(0);
  if (tc.crop_mode == "squash") {
    nh = nw = scale;
  } else if (tc.crop_mode == "border") {  // ResizeKeepRatio(longest=1): the longer side to `scale`
    const double ratio = std::max(double(h) / scale, double(w) / scale);
    nh = std::max<int64_t>(1, int64_t(std::nearbyint(double(h) / ratio)));
    nw = std::max<int64_t>(1, int64_t(std::nearbyint(double(w) / ratio)));
    for (int c = 0; c < 3 && c < int(tc.mean.size()); ++c) fill[c] = std::nearbyint(255 * tc.mean[size_t(c)]);
  } else {  // torchvision Resize(int): the shorter side to `scale`, the longer truncated
    nh = w <= h ? int64_t(scale) * h / w : scale;
    nw = w <= h ? scale : int64_t(scale) * w / h;
  }
  check_resized_size(w, h, nw, nh);
  const cv::Size to{int(nw), int(nh)};
  if (crop <= nh && crop <= nw) {  // torchvision: top = round((h - crop) / 2), halves to even
    const int top = int(std::nearbyint((nh - crop) / 2.0)), left = int(std::nearbyint((nw - crop) / 2.0));
    const cv::Rect roi(left, top, crop, crop);
    return to == img.size() ? img(roi) : pil_resize(img, to, parse_resample(interp), roi);
  }
  cv::Mat r = resize_to(img, to, interp), padded;
  const int ph = std::max(0, crop - int(nh)), pw = std::max(0, crop - int(nw));
  cv::copyMakeBorder(r, padded, ph / 2, (ph + 1) / 2, pw / 2, (pw + 1) / 2, cv::BORDER_CONSTANT, fill);
  const int top = int(std::nearbyint((padded.rows - crop) / 2.0)), left = int(std::nearbyint((padded.cols - crop) / 2.0));
  return padded(cv::Rect(left, top, crop, crop));
}

}  // namespace

namespace {

// The training transform once the crop is cut: the interpolation draw, the resize to the output
// size, the flips, then the --aa policy or colour jitter (the draws in timm's order).
cv::Mat train_from_crop(const cv::Mat& crop, const TransformConfig& tc, std::mt19937_64& rng) {
  std::string interp = tc.interpolation;
  if (interp == "random") interp = uniform(rng, 0, 1) < 0.5 ? "bilinear" : "bicubic";
  cv::Mat out = resize_to(crop, {tc.size, tc.size}, interp);
  if (tc.hflip > 0 && uniform(rng, 0, 1) < tc.hflip) {
    cv::Mat flipped;
    cv::flip(out, flipped, 1);
    out = flipped;
  }
  if (tc.vflip > 0 && uniform(rng, 0, 1) < tc.vflip) {
    cv::Mat flipped;
    cv::flip(out, flipped, 0);
    out = flipped;
  }
  if (tc.auto_augment)
    out = apply_augment(out, *tc.auto_augment, rng);
  else if (tc.color_jitter > 0)
    out = color_jitter(out, {tc.color_jitter, tc.color_jitter, tc.color_jitter}, rng);
  return out;
}

cv::Mat contiguous(cv::Mat m) { return m.isContinuous() ? m : m.clone(); }

// The largest DCT scaling denominator (8, 4, 2, else 1) that keeps both sides of a `w` x `h`
// region at least `min_w` x `min_h` after scaling.
int dct_denominator(int w, int h, int min_w, int min_h) {
  for (int d : {8, 4, 2})
    if (w / d >= min_w && h / d >= min_h) return d;
  return 1;
}

// The deterministic resize + center crop of evaluation (shorter side to floor(size / crop_pct))
// and of --no-aug training (shorter side to size; "random" interpolation means bilinear).
struct CenterCrop {
  int scale_size;
  std::string interp;
};
CenterCrop center_crop_params(const TransformConfig& tc) {
  if (!tc.train) return {std::max(1, int(std::floor(tc.size / tc.crop_pct))), tc.interpolation};
  return {tc.size, tc.interpolation == "random" ? "bilinear" : tc.interpolation};
}

}  // namespace

cv::Mat apply_transform(const cv::Mat& in, const TransformConfig& tc, std::mt19937_64& rng) {
  cv::Mat img = to_channels(in, tc.channels);
  if (!tc.train || tc.no_aug) {
    const auto cc = center_crop_params(tc);
    return contiguous(resize_center_crop(img, cc.scale_size, tc.size, tc, cc.interp));
  }
  CropBox box = random_resized_crop_box(img.rows, img.cols, tc.scale, tc.ratio, rng);
  return contiguous(train_from_crop(img(cv::Rect(box.left, box.top, box.width, box.height)), tc, rng));
}

namespace {
cv::Mat transform_encoded(const std::string& bytes, const TransformConfig& tc, std::mt19937_64& rng,
                          const std::string& what) {
  if (!is_jpeg(bytes)) return apply_transform(decode_image(bytes, what), tc, rng);
  const cv::Size full = jpeg_size(bytes, what);
  check_image_pixels(full.width, full.height, what);  // before anything is allocated, as decode_image does
  if (!tc.train || tc.no_aug) {
    const auto cc = center_crop_params(tc);
    const int shorter = std::min(full.width, full.height);
    const int d = tc.fast_decode ? dct_denominator(shorter, shorter, cc.scale_size, cc.scale_size) : 1;
    cv::Mat img = to_channels(decode_jpeg(bytes, d, what), tc.channels);
    return contiguous(resize_center_crop(img, cc.scale_size, tc.size, tc, cc.interp));
  }
  // The crop is drawn on the full-size geometry (the same draws as a full decode), then only its
  // rows and columns are decoded, at the smallest DCT scale that keeps it at least the output size.
  CropBox box = random_resized_crop_box(full.height, full.width, tc.scale, tc.ratio, rng);
  const int d = dct_denominator(box.width, box.height, tc.size, tc.size);
  cv::Rect r(box.left, box.top, box.width, box.height);
  if (d > 1) {
    const int sw = (full.width + d - 1) / d, sh = (full.height + d - 1) / d;
    const int x0 = int(std::lround(double(box.left) / d)), y0 = int(std::lround(double(box.top) / d));
    const int x1 = std::min(sw, int(std::lround(double(box.left + box.width) / d)));
    const int y1 = std::min(sh, int(std::lround(double(box.top + box.height) / d)));
    r = cv::Rect(std::min(x0, sw - 1), std::min(y0, sh - 1), std::max(1, x1 - x0), std::max(1, y1 - y0));
  }
  cv::Mat crop = decode_jpeg_region(bytes, d, r, what);
  return contiguous(train_from_crop(to_channels(crop, tc.channels), tc, rng));
}
}  // namespace

cv::Mat apply_transform_encoded(const std::string& bytes, const TransformConfig& tc, std::mt19937_64& rng,
                                const std::string& what) {
  try {
    return transform_encoded(bytes, tc, rng, what);
  } catch (const DecodeError& e) {  // the transforms' own refusals (a resize above the limit) name the file too
    if (std::string(e.what()).find(what) != std::string::npos) throw;
    throw DecodeError(fmt::format("'{}': {}", what, e.what()));
  }
}

}  // namespace imgtrain::data
