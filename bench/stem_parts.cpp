// A direct convolution of few-channel images for the stems, tried for inference and left out
// (docs/performance.md, 2026-12-07, seventh session): each output pixel's k * k * C products are one
// row of a GEMM read straight from a zero-padded channels-last copy of the image (its k * C values per
// kernel row are contiguous), against the weight packed into panels of 16 output channels, 6 pixels x
// 16 channels accumulated in registers (AVX2 + FMA). Against oneDNN's fused
// convolution + bias + ReLU with its weight in oneDNN's own layout (mkldnn::_convolution_pointwise
// after mkldnn::_reorder_convolution_weight, what imgtrain's inference runs otherwise), on the
// stems of ResNet (7x7 stride 2, RGB, and the README job's 1-channel 28 px images), EfficientNet and
// MobileNetV3 (3x3 stride 2), channels-last float32. Medians of 9 alternating rounds (best of 3
// passes each), milliseconds, at the thread count OMP_NUM_THREADS gives; and each one's largest
// error against a float64 convolution, relative to the output's largest magnitude.
//   g++ -O3 -std=gnu++20 -Ilib -isystem $T/include -isystem $T/include/torch/csrc/api/include \
//       bench/stem_parts.cpp -o /tmp/stem_parts -L$T/lib -ltorch -ltorch_cpu -lc10 \
//       -Wl,-rpath,$T/lib -Wno-psabi -fopenmp
//       (T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))'))
//   OMP_NUM_THREADS=2 /tmp/stem_parts
#include "best_ms.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cstdint>

// AVX2 + FMA intrinsics in functions compiled for that target (the rest of the build is baseline
// x86-64); the CPU is asked once whether it has them. Other compilers and CPUs keep oneDNN's stem.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_DIRECT_CONV_X86 1
#include <immintrin.h>
#endif

namespace imgtrain::ops {
namespace {
constexpr int64_t kNR = 16;  // output channels of a panel: two 8-float registers
constexpr int64_t kMR = 6;   // output pixels of a tile: 12 accumulators, 2 weight registers, 1 broadcast

#ifdef IMGTRAIN_DIRECT_CONV_X86
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// Where one tile's inputs and outputs are: MR pixels of one output row, side by side
struct Tile {
  const float* x;        // the first pixel's first input: its kernel window's top-left value
  int64_t pixel_stride;  // floats from one pixel's window to the next's (stride * C)
  int64_t row_stride;    // floats from one kernel row to the next (the padded image's row)
  int64_t k, kc;         // kernel rows; values per kernel row (k * C)
  const float* panel;    // [k * kc, 16]
  const float* bias;     // 16 or null
  bool relu;
  float* y;              // the first pixel's 16 outputs
  int64_t ldy;           // floats from one pixel's outputs to the next's (K)
};

// y[MR pixels, 16 channels] = act(sum over the window of x * w + bias): each output's k * kc products
// summed in order, one fused multiply-add each
template <int MR>
void tile(const Tile& t) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t kh = 0; kh < t.k; ++kh) {
    const float* a = t.x + kh * t.row_stride;
    const float* b = t.panel + kh * t.kc * kNR;
#pragma GCC unroll 3
    for (int64_t j = 0; j < t.kc; ++j) {
      const __m256 b0 = _mm256_loadu_ps(b + j * kNR), b1 = _mm256_loadu_ps(b + j * kNR + 8);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m256 v = _mm256_broadcast_ss(a + r * t.pixel_stride + j);
        lo[r] = _mm256_fmadd_ps(v, b0, lo[r]);
        hi[r] = _mm256_fmadd_ps(v, b1, hi[r]);
      }
    }
  }
  const __m256 b0 = t.bias ? _mm256_loadu_ps(t.bias) : _mm256_setzero_ps();
  const __m256 b1 = t.bias ? _mm256_loadu_ps(t.bias + 8) : _mm256_setzero_ps();
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    __m256 y0 = _mm256_add_ps(lo[r], b0), y1 = _mm256_add_ps(hi[r], b1);
    if (t.relu) y0 = _mm256_max_ps(y0, zero), y1 = _mm256_max_ps(y1, zero);
    _mm256_storeu_ps(t.y + r * t.ldy, y0);
    _mm256_storeu_ps(t.y + r * t.ldy + 8, y1);
  }
}

using TileFn = void (*)(const Tile&);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

#pragma GCC pop_options
}  // namespace avx2
#endif  // IMGTRAIN_DIRECT_CONV_X86

bool cpu_ok() {
#ifdef IMGTRAIN_DIRECT_CONV_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

int64_t out_size(int64_t in, int64_t k, int64_t stride, int64_t padding) {
  return in + 2 * padding < k ? 0 : (in + 2 * padding - k) / stride + 1;
}
}  // namespace

at::Tensor direct_conv_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == weight.size(3) && weight.size(0) % kNR == 0 &&
                  weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "direct_conv_pack: a float32 CPU weight [K, C, k, k] with K a multiple of 16, got ", weight.sizes());
  const int64_t K = weight.size(0), rows = weight.size(1) * weight.size(2) * weight.size(3);
  // [K, C, kh, kw] -> [K, kh, kw, C] -> [K / 16, 16, rows] -> [K / 16, rows, 16]
  return weight.permute({0, 2, 3, 1}).reshape({K / kNR, kNR, rows}).transpose(1, 2).contiguous();
}

bool direct_conv_supported(const at::Tensor& x, const at::Tensor& packed, int64_t k, int64_t stride, int64_t padding) {
  if (!cpu_ok() || !x.defined() || !packed.defined() || k < 1 || stride < 1 || padding < 0) return false;
  if (x.dim() != 4 || x.scalar_type() != at::kFloat || !x.device().is_cpu() ||
      !x.is_contiguous(at::MemoryFormat::ChannelsLast) || x.size(1) < 1 || x.size(1) > 4)
    return false;
  if (packed.dim() != 3 || packed.scalar_type() != at::kFloat || !packed.device().is_cpu() || !packed.is_contiguous() ||
      packed.size(1) != k * k * x.size(1) || packed.size(2) != kNR)
    return false;
  return x.size(0) > 0 && out_size(x.size(2), k, stride, padding) > 0 && out_size(x.size(3), k, stride, padding) > 0;
}

at::Tensor direct_conv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t k,
                       int64_t stride, int64_t padding, bool relu) {
  TORCH_CHECK(direct_conv_supported(x, packed, k, stride, padding),
              "direct_conv: an AVX2 CPU, x float32 channels-last [N, C <= 4, H, W], the weight packed for a ", k, "x",
              k, " kernel; got x ", x.sizes(), ", packed ", packed.sizes());
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), K = packed.size(0) * kNR;
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.numel() == K && bias.is_contiguous()),
              "direct_conv: bias float32 [", K, "]");
  RECORD_FUNCTION("imgtrain::direct_conv", std::vector<c10::IValue>{});
  const int64_t OH = out_size(H, k, stride, padding), OW = out_size(W, k, stride, padding);
  // The image channels-last as [N, H, W, C], padded with zeros on every side (row by row: ATen's
  // constant_pad_nd of the permuted view took 12-16 ms for 8 x 224 x 224 x 3)
  const auto xc = x.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t Hp = H + 2 * padding, Wp = W + 2 * padding;
  at::Tensor xp = xc;
  if (padding > 0) {
    xp = at::empty({N, Hp, Wp, C}, x.options());
    const float* in = xc.const_data_ptr<float>();
    float* out = xp.data_ptr<float>();
    at::parallel_for(0, N * Hp, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t n = r / Hp, yy = r % Hp - padding;
        float* row = out + r * Wp * C;
        if (yy < 0 || yy >= H) {
          std::fill(row, row + Wp * C, 0.0f);
          continue;
        }
        std::fill(row, row + padding * C, 0.0f);
        std::copy_n(in + (n * H + yy) * W * C, W * C, row + padding * C);
        std::fill(row + (padding + W) * C, row + Wp * C, 0.0f);
      }
    });
  }
  auto y = at::empty({N, K, OH, OW}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
#ifdef IMGTRAIN_DIRECT_CONV_X86
  const float* src = xp.const_data_ptr<float>();
  const float* w = packed.const_data_ptr<float>();
  const float* b = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  float* dst = y.data_ptr<float>();
  const int64_t rows = k * k * C, panels = K / kNR;
  // one output row at a time: its k input rows (at most 7 x 230 x 4 floats) and one panel stay in L1
  at::parallel_for(0, N * OH, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t n = row / OH, oy = row % OH;
      const float* in = src + (n * Hp + oy * stride) * Wp * C;
      float* out = dst + row * OW * K;
      for (int64_t p = 0; p < panels; ++p) {
        avx2::Tile t{nullptr, stride * C, Wp * C, k, k * C, w + p * rows * kNR, b ? b + p * kNR : nullptr, relu,
                     nullptr, K};
        for (int64_t ox = 0; ox < OW; ox += kMR) {
          t.x = in + ox * stride * C;
          t.y = out + ox * K + p * kNR;
          avx2::kTiles[std::min(kMR, OW - ox)](t);
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace imgtrain::ops


#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>
#include <vector>

int main() {
  c10::InferenceMode guard;
  auto& disp = c10::Dispatcher::singleton();
  const auto conv = disp.findSchemaOrThrow("mkldnn::_convolution_pointwise", "");
  const auto reorder = disp.findSchemaOrThrow("mkldnn::_reorder_convolution_weight", "");
  struct Shape { const char* name; int64_t n, c, hw, k_out, k, stride, padding; };
  const std::vector<Shape> shapes = {{"resnet 7x7/2", 8, 3, 224, 64, 7, 2, 3},  {"resnet 7x7/2", 1, 3, 224, 64, 7, 2, 3},
                                     {"effnet 3x3/2", 8, 3, 224, 32, 3, 2, 1},  {"mnv3 3x3/2", 8, 3, 224, 16, 3, 2, 1},
                                     {"1-ch 7x7/2", 128, 1, 28, 64, 7, 2, 3}};
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%-13s %3s %4s | %16s %16s %7s | %8s %8s\n", "stem", "N", "HxW", "oneDNN ms (GF/s)", "direct ms (GF/s)",
              "ratio", "err dnn", "err ours");
  for (const auto& s : shapes) {
    const auto x = at::randn({s.n, s.c, s.hw, s.hw}).contiguous(at::MemoryFormat::ChannelsLast);
    const auto w = at::randn({s.k_out, s.c, s.k, s.k}) / std::sqrt(double(s.c * s.k * s.k));
    const auto b = at::randn({s.k_out}) * 0.1;
    const std::vector<int64_t> pad{s.padding, s.padding}, stride{s.stride, s.stride}, one{1, 1};
    torch::jit::Stack st{w.contiguous(at::MemoryFormat::ChannelsLast), pad, stride, one, int64_t(1), x.sizes().vec()};
    reorder.callBoxed(&st);
    const auto wd = st[0].toTensor();
    const auto packed = imgtrain::ops::direct_conv_pack(w);
    at::Tensor yd, yo;
    std::vector<double> td, to;
    for (int round = 0; round < 9; ++round) {
      td.push_back(best_ms([&] {
        torch::jit::Stack q{x, wd, b, pad, stride, one, int64_t(1), std::string("relu"),
                            c10::List<std::optional<at::Scalar>>(), std::string()};
        conv.callBoxed(&q);
        yd = q[0].toTensor();
      }, 3));
      to.push_back(best_ms([&] { yo = imgtrain::ops::direct_conv(x, packed, b, s.k, s.stride, s.padding, true); }, 3));
    }
    const auto ref = at::relu(at::conv2d(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble), stride, pad));
    const double scale = ref.abs().max().item<double>();
    auto err = [&](const at::Tensor& y) { return (y.to(at::kDouble) - ref).abs().max().item<double>() / scale; };
    const double gf = 2e-6 * double(yo.numel()) * double(s.c * s.k * s.k);
    const double a = median(td), o = median(to);
    std::printf("%-13s %3ld %4ld | %7.2f (%6.1f) %7.2f (%6.1f) %6.3fx | %.2e %.2e\n", s.name, long(s.n), long(s.hw), a,
                gf / a, o, gf / o, a / o, err(yd), err(yo));
  }
}
