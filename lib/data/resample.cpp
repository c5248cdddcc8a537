// Pillow's resampling (src/libImaging/Resample.c and the nearest-neighbour affine scale of
// Geometry.c) re-derived from its arithmetic: the same double-precision filter weights, the same
// float box edges, the same 22-bit fixed-point rounding, so the uint8 results are identical.
// This file is compiled with -ffp-contract=off: a fused multiply-add would round the weights
// differently from Pillow's build.
#include "data/resample.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace imgtrain::data {

Resample parse_resample(const std::string& name) {
  if (name == "nearest") return Resample::nearest;
  if (name == "box") return Resample::box;
  if (name == "bilinear") return Resample::bilinear;
  if (name == "hamming") return Resample::hamming;
  if (name == "bicubic") return Resample::bicubic;
  if (name == "lanczos") return Resample::lanczos;
  throw std::invalid_argument("unknown interpolation '" + name +
                              "' (expected nearest, bilinear, bicubic, box, hamming or lanczos)");
}

namespace {

constexpr double kPi = 3.14159265358979323846;

double box_filter(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }

double bilinear_filter(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double hamming_filter(double x) {
  x = std::fabs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x *= kPi;
  // Pillow writes these constants as floats: their float values are part of the weights.
  return std::sin(x) / x * (double(0.54f) + double(0.46f) * std::cos(x));
}

double bicubic_filter(double x) {  // Keys' cubic convolution with a = -0.5
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= kPi;
  return std::sin(x) / x;
}

double lanczos_filter(double x) { return -3.0 <= x && x < 3.0 ? sinc(x) * sinc(x / 3) : 0.0; }

struct Filter {
  double (*fn)(double);
  double support;
};

Filter filter_of(Resample r) {
  switch (r) {
    case Resample::box: return {box_filter, 0.5};
    case Resample::bilinear: return {bilinear_filter, 1.0};
    case Resample::hamming: return {hamming_filter, 1.0};
    case Resample::bicubic: return {bicubic_filter, 2.0};
    case Resample::lanczos: return {lanczos_filter, 3.0};
    case Resample::nearest: break;
  }
  throw std::logic_error("nearest has no resampling filter");
}

constexpr int kPrecisionBits = 32 - 8 - 2;

inline uint8_t clip8(int v) {
  v >>= kPrecisionBits;
  return uint8_t(v < 0 ? 0 : v > 255 ? 255 : v);
}

// The weights of output positions [o0, o1) along an axis of `in_size` source pixels resized to
// `out_size`: for each, the first source pixel, the tap count, and `ksize` fixed-point weights.
struct Coeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> k;
};

Coeffs precompute(int in_size, int out_size, int o0, int o1, const Filter& f) {
  // Pillow passes the box edges as floats (here 0 and in_size) and divides in double.
  const float in0 = 0.0f, in1 = float(in_size);
  const double scale = double(in1 - in0) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = f.support * filterscale;
  Coeffs c;
  c.ksize = int(std::ceil(support)) * 2 + 1;
  c.first.resize(size_t(o1 - o0));
  c.count.resize(size_t(o1 - o0));
  c.k.assign(size_t(o1 - o0) * size_t(c.ksize), 0);
  std::vector<double> w(size_t(c.ksize));
  const double ss = 1.0 / filterscale;
  for (int xx = o0; xx < o1; ++xx) {
    const double center = in0 + (xx + 0.5) * scale;
    int xmin = int(center - support + 0.5), xmax = int(center + support + 0.5);
    xmin = std::max(xmin, 0);
    xmax = std::min(xmax, in_size) - xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      w[size_t(x)] = f.fn((x + xmin - center + 0.5) * ss);
      ww += w[size_t(x)];
    }
    int32_t* k = &c.k[size_t(xx - o0) * size_t(c.ksize)];
    for (int x = 0; x < xmax; ++x) {
      const double v = ww != 0.0 ? w[size_t(x)] / ww : w[size_t(x)];
      k[x] = v < 0 ? int32_t(-0.5 + v * (1 << kPrecisionBits)) : int32_t(0.5 + v * (1 << kPrecisionBits));
    }
    c.first[size_t(xx - o0)] = xmin;
    c.count[size_t(xx - o0)] = xmax;
  }
  return c;
}

// Horizontal pass over source rows [r0, r1) into dst (r1 - r0 rows, one column per coefficient).
template <int C>
void horizontal(const cv::Mat& src, int r0, int r1, const Coeffs& c, cv::Mat& dst) {
  const size_t n = c.first.size();
  for (int y = r0; y < r1; ++y) {
    const uint8_t* in = src.ptr<uint8_t>(y);
    uint8_t* out = dst.ptr<uint8_t>(y - r0);
    for (size_t i = 0; i < n; ++i) {
      const int32_t* k = &c.k[i * size_t(c.ksize)];
      const uint8_t* p = in + size_t(c.first[i]) * C;
      int ss[C];
      for (int ch = 0; ch < C; ++ch) ss[ch] = 1 << (kPrecisionBits - 1);
      for (int x = 0; x < c.count[i]; ++x)
        for (int ch = 0; ch < C; ++ch) ss[ch] += int(p[x * C + ch]) * k[x];
      for (int ch = 0; ch < C; ++ch) out[i * C + ch] = clip8(ss[ch]);
    }
  }
}

// Vertical pass: output row i takes src rows first[i] - row0 onwards. Integer sums are exact in
// any order, so the rows are accumulated one after another (cache friendly) with Pillow's result.
void vertical(const cv::Mat& src, int row0, const Coeffs& c, cv::Mat& dst) {
  const size_t width = size_t(src.cols) * size_t(src.channels());
  std::vector<int> acc(width);
  for (size_t i = 0; i < c.first.size(); ++i) {
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    const int32_t* k = &c.k[i * size_t(c.ksize)];
    for (int y = 0; y < c.count[i]; ++y) {
      const uint8_t* in = src.ptr<uint8_t>(c.first[i] - row0 + y);
      const int kw = k[y];
      for (size_t x = 0; x < width; ++x) acc[x] += int(in[x]) * kw;
    }
    uint8_t* out = dst.ptr<uint8_t>(int(i));
    for (size_t x = 0; x < width; ++x) out[x] = clip8(acc[x]);
  }
}

void horizontal_any(const cv::Mat& src, int r0, int r1, const Coeffs& c, cv::Mat& dst) {
  switch (src.channels()) {
    case 1: return horizontal<1>(src, r0, r1, c, dst);
    case 2: return horizontal<2>(src, r0, r1, c, dst);
    case 3: return horizontal<3>(src, r0, r1, c, dst);
    case 4: return horizontal<4>(src, r0, r1, c, dst);
  }
}

// Pillow's nearest: an affine scale whose source coordinate starts at half a step and is advanced
// by repeated addition (so its rounding is Pillow's), then truncated; outside the source is 0.
std::vector<int> nearest_table(int in_size, int out_size) {
  const double step = double(float(in_size) - 0.0f) / out_size;
  std::vector<int> t(static_cast<size_t>(out_size));
  double v = 0.0 + step * 0.5;
  for (int i = 0; i < out_size; ++i, v += step) {
    const int s = v < 0.0 ? -1 : int(v);
    t[size_t(i)] = s >= 0 && s < in_size ? s : -1;
  }
  return t;
}

cv::Mat nearest(const cv::Mat& src, cv::Size to, cv::Rect roi) {
  const auto xs = nearest_table(src.cols, to.width), ys = nearest_table(src.rows, to.height);
  const size_t px = src.elemSize();
  cv::Mat out(roi.size(), src.type(), cv::Scalar::all(0));
  for (int y = 0; y < roi.height; ++y) {
    const int sy = ys[size_t(roi.y + y)];
    if (sy < 0) continue;
    const uint8_t* in = src.ptr<uint8_t>(sy);
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < roi.width; ++x) {
      const int sx = xs[size_t(roi.x + x)];
      if (sx >= 0) std::copy_n(in + size_t(sx) * px, px, o + size_t(x) * px);
    }
  }
  return out;
}

}  // namespace

cv::Mat pil_resize(const cv::Mat& src, cv::Size to, Resample filter, cv::Rect roi) {
  if (src.depth() != CV_8U || src.channels() < 1 || src.channels() > 4 || src.dims != 2)
    throw std::invalid_argument("pil_resize takes an 8-bit image with 1 to 4 channels");
  if (to.width <= 0 || to.height <= 0 || src.empty())
    throw std::invalid_argument("pil_resize: empty source or output size");
  if (roi.empty()) roi = cv::Rect({0, 0}, to);
  if ((roi & cv::Rect({0, 0}, to)) != roi) throw std::invalid_argument("pil_resize: roi outside the output");
  if (src.size() == to) return src(roi).clone();  // Image.resize returns a copy
  if (filter == Resample::nearest) return nearest(src, to, roi);

  const Filter f = filter_of(filter);
  // Pillow's tests for each pass: a pass runs only when its size changes (box = the whole image).
  const bool need_h = to.width != src.cols, need_v = to.height != src.rows;
  // Pillow 13's pass order: vertical first when the height shrinks by more than twice as many
  // pixels as the width does (the rounding to uint8 between the passes makes the order visible).
  const int dh = src.rows - to.height, dw = src.cols - to.width;
  const bool horizontal_first = !(dh > 0 && dh > dw * 2);
  const int x0 = roi.x, x1 = roi.x + roi.width, y0 = roi.y, y1 = roi.y + roi.height;
  if (horizontal_first) {
    cv::Mat cur = src;
    int row0 = 0;  // the source row that cur's row 0 is
    Coeffs cv;
    if (need_v) cv = precompute(src.rows, to.height, y0, y1, f);
    if (need_h) {
      const Coeffs ch = precompute(src.cols, to.width, x0, x1, f);
      int r0 = y0, r1 = y1;  // only the rows the vertical pass reads (roi's rows without one)
      if (need_v) r0 = cv.first.front(), r1 = cv.first.back() + cv.count.back();
      cv::Mat tmp(r1 - r0, roi.width, src.type());
      horizontal_any(src, r0, r1, ch, tmp);
      cur = tmp;
      row0 = r0;
    } else {
      cur = src.colRange(x0, x1);
    }
    if (!need_v) return need_h ? cur : cur.rowRange(y0, y1).clone();
    cv::Mat out(roi.height, roi.width, src.type());
    vertical(cur, row0, cv, out);
    return out;
  }
  // Vertical first (need_v holds here): roi's rows over the source columns the horizontal pass
  // reads, then the horizontal pass.
  const Coeffs cv = precompute(src.rows, to.height, y0, y1, f);
  Coeffs ch;
  int c0 = x0, c1 = x1;
  if (need_h) {
    ch = precompute(src.cols, to.width, x0, x1, f);
    c0 = ch.first.front(), c1 = ch.first.back() + ch.count.back();
    for (int& v : ch.first) v -= c0;
  }
  cv::Mat tmp(roi.height, c1 - c0, src.type());
  vertical(src.colRange(c0, c1), 0, cv, tmp);
  if (!need_h) return tmp;
  cv::Mat out(roi.height, roi.width, src.type());
  horizontal_any(tmp, 0, tmp.rows, ch, out);
  return out;
}

cv::Mat pil_rgb_to_l(const cv::Mat& rgb) {
  if (rgb.type() != CV_8UC3) throw std::invalid_argument("pil_rgb_to_l takes an 8-bit RGB image");
  cv::Mat out(rgb.size(), CV_8UC1);
  for (int y = 0; y < rgb.rows; ++y) {
    const uint8_t* in = rgb.ptr<uint8_t>(y);
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < rgb.cols; ++x, in += 3)
      o[x] = uint8_t((in[0] * 19595 + in[1] * 38470 + in[2] * 7471 + 0x8000) >> 16);
  }
  return out;
}

}  // namespace imgtrain::data
