#include "ops/depthwise.h"
#include "ops/winograd.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/flip.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace imgtrain::ops {
namespace {

// Plain loops the compiler vectorises along the channels; on x86-64 GCC builds the entry also gets
// AVX-512 and AVX2+FMA clones picked at load time (the baseline build is SSE2 only).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_DW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define IMGTRAIN_DW_AI inline __attribute__((always_inline))
#else
#define IMGTRAIN_DW_CLONES
#define IMGTRAIN_DW_AI inline
#endif

// The shape of one convolution, channels-last: x [N, H, W, C], gy [N, Ho, Wo, C].
struct Geometry {
  int64_t N, H, W, C, Ho, Wo, stride, pad;
};

// The weight and bias gradients of channels [c0, c0 + cw) (cw <= CB; Full: cw == CB, a bound the
// compiler knows): tot[(i * K + j) * CB + l] += sum over n, ho, wo of x[n, ho*s+i-p, wo*s+j-p, c0+l]
// * gy[n, ho, wo, c0+l], btot[l] += sum of gy[n, ho, wo, c0+l]. Per output row and tap row the
// products go into K x CB float (or double) accumulators, which are then added into the doubles.
template <typename T, int K, int CB, bool Full>
IMGTRAIN_DW_AI void wgrad_block_t(const T* x, const T* gy, const Geometry& g, int64_t c0, int64_t cw, double* tot,
                                  double* btot) {
  const int64_t C = g.C, s = g.stride, p = g.pad;
  const int64_t n_lanes = Full ? CB : cw;
  // output columns whose K input columns all lie inside the row: [wo_lo, wo_hi)
  const int64_t wo_lo = std::min(g.Wo, (p + s - 1) / s);
  const int64_t wo_hi = std::max(wo_lo, std::min(g.Wo, g.W - K + p >= 0 ? (g.W - K + p) / s + 1 : 0));
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t ho = 0; ho < g.Ho; ++ho) {
      const T* grow = gy + ((n * g.Ho + ho) * g.Wo) * C + c0;
      {
        T b[CB] = {};
        for (int64_t wo = 0; wo < g.Wo; ++wo)
          for (int64_t l = 0; l < n_lanes; ++l) b[l] += grow[wo * C + l];
        for (int64_t l = 0; l < n_lanes; ++l) btot[l] += double(b[l]);
      }
      for (int i = 0; i < K; ++i) {
        const int64_t hi = ho * s + i - p;
        if (hi < 0 || hi >= g.H) continue;
        const T* xrow = x + ((n * g.H + hi) * g.W) * C + c0;
        T acc[K][CB] = {};
        auto edge = [&](int64_t wo) {
          const T* gp = grow + wo * C;
          for (int j = 0; j < K; ++j) {
            const int64_t wi = wo * s + j - p;
            if (wi < 0 || wi >= g.W) continue;
            const T* xp = xrow + wi * C;
            for (int64_t l = 0; l < n_lanes; ++l) acc[j][l] += xp[l] * gp[l];
          }
        };
        for (int64_t wo = 0; wo < wo_lo; ++wo) edge(wo);
        int64_t wo = wo_lo;
        if (s == 1)  // two output columns at a time share K - 1 of their K + 1 input columns
          for (; wo + 2 <= wo_hi; wo += 2) {
            const T* gp = grow + wo * C;
            const T* xp = xrow + (wo - p) * C;
            for (int j = 0; j < K; ++j)
              for (int64_t l = 0; l < n_lanes; ++l) {
                acc[j][l] += xp[j * C + l] * gp[l];
                acc[j][l] += xp[(j + 1) * C + l] * gp[C + l];
              }
          }
        for (; wo < wo_hi; ++wo) {
          const T* gp = grow + wo * C;
          const T* xp = xrow + (wo * s - p) * C;
          for (int j = 0; j < K; ++j)
            for (int64_t l = 0; l < n_lanes; ++l) acc[j][l] += xp[j * C + l] * gp[l];
        }
        for (int64_t wo = wo_hi; wo < g.Wo; ++wo) edge(wo);
        for (int j = 0; j < K; ++j)
          for (int64_t l = 0; l < n_lanes; ++l) tot[(i * K + j) * CB + l] += double(acc[j][l]);
      }
    }
}

template <typename T, int CB, bool Full>
IMGTRAIN_DW_AI void wgrad_block_k(int k, const T* x, const T* gy, const Geometry& g, int64_t c0, int64_t cw,
                                  double* tot, double* btot) {
  switch (k) {
    case 3: wgrad_block_t<T, 3, CB, Full>(x, gy, g, c0, cw, tot, btot); break;
    case 5: wgrad_block_t<T, 5, CB, Full>(x, gy, g, c0, cw, tot, btot); break;
    default: wgrad_block_t<T, 7, CB, Full>(x, gy, g, c0, cw, tot, btot); break;
  }
}

constexpr int kBlockF = 16;  // channels per block: one AVX-512 register of floats
constexpr int kBlockD = 8;   // and of doubles

IMGTRAIN_DW_CLONES void wgrad_f32(int k, const float* x, const float* gy, const Geometry& g, int64_t c0,
                                  int64_t cw, double* tot, double* btot) {
  if (cw == kBlockF)
    wgrad_block_k<float, kBlockF, true>(k, x, gy, g, c0, cw, tot, btot);
  else
    wgrad_block_k<float, kBlockF, false>(k, x, gy, g, c0, cw, tot, btot);
}

void wgrad_f64(int k, const double* x, const double* gy, const Geometry& g, int64_t c0, int64_t cw, double* tot,
               double* btot) {
  if (cw == kBlockD)
    wgrad_block_k<double, kBlockD, true>(k, x, gy, g, c0, cw, tot, btot);
  else
    wgrad_block_k<double, kBlockD, false>(k, x, gy, g, c0, cw, tot, btot);
}

template <typename T, int CB>
void weight_grad_impl(const at::Tensor& xc, const at::Tensor& gc, int k, const Geometry& g, at::Tensor& gw,
                      at::Tensor& gb) {
  const T* x = xc.const_data_ptr<T>();
  const T* gy = gc.const_data_ptr<T>();
  T* w = gw.mutable_data_ptr<T>();
  T* b = gb.mutable_data_ptr<T>();
  const int64_t blocks = (g.C + CB - 1) / CB;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<double> tot(size_t(k) * k * CB), btot(CB);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * CB, cw = std::min<int64_t>(CB, g.C - c0);
      std::fill(tot.begin(), tot.end(), 0.0);
      std::fill(btot.begin(), btot.end(), 0.0);
      if constexpr (std::is_same_v<T, float>)
        wgrad_f32(k, x, gy, g, c0, cw, tot.data(), btot.data());
      else
        wgrad_f64(k, x, gy, g, c0, cw, tot.data(), btot.data());
      for (int64_t l = 0; l < cw; ++l) {
        for (int t = 0; t < k * k; ++t) w[(c0 + l) * k * k + t] = T(tot[size_t(t) * CB + l]);
        b[c0 + l] = T(btot[l]);
      }
    }
  });
}

// What the backward of a convolution with imgtrain's weight gradient (DepthwiseFunction,
// DenseConvFunction) reads back: saved by save_conv in the forward.
struct SavedConv {
  at::Tensor x, w;
  int64_t stride, padding;
  bool has_bias;
};
// Saves them; an empty bias tensor stands for none (autograd functions take no undefined tensors).
// Returns whether there is a bias.
bool save_conv(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
               int64_t stride, int64_t padding) {
  ctx->save_for_backward({x, w});
  ctx->saved_data["stride"] = stride;
  ctx->saved_data["padding"] = padding;
  const bool has_bias = bias.numel() > 0;
  ctx->saved_data["bias"] = has_bias;
  return has_bias;
}
SavedConv saved_conv(torch::autograd::AutogradContext* ctx) {
  const auto v = ctx->get_saved_variables();
  return {v[0], v[1], ctx->saved_data["stride"].toInt(), ctx->saved_data["padding"].toInt(),
          ctx->saved_data["bias"].toBool()};
}

struct DepthwiseFunction : torch::autograd::Function<DepthwiseFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& bias, int64_t stride, int64_t padding) {
    const bool has_bias = save_conv(ctx, x, w, bias, stride, padding);
    return at::conv2d(x, w, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt, {stride, stride},
                      {padding, padding}, {1, 1}, x.size(1));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [x, w, stride, padding, has_bias] = saved_conv(ctx);
    const auto& gy = grads[0];
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {
      const int64_t k = w.size(2);
      if (stride == 1)  // the gradient of a stride-1 correlation is the correlation with the flipped filter
        gx = at::conv2d(gy, w.flip({2, 3}), {}, {1, 1}, {k - 1 - padding, k - 1 - padding}, {1, 1}, x.size(1));
      else
        gx = std::get<0>(at::convolution_backward(gy, x, w, std::nullopt, {stride, stride}, {padding, padding}, {1, 1},
                                                  false, {0, 0}, x.size(1), {true, false, false}));
    }
    if (ctx->needs_input_grad(1) || (has_bias && ctx->needs_input_grad(2))) {
      auto [gw_, gb_] = depthwise_conv_weight_grad(x, gy, w.size(2), stride, padding);
      gw = std::move(gw_);
      if (has_bias) gb = std::move(gb_);
    }
    return {gx, gw, gb, at::Tensor(), at::Tensor()};
  }
};

// ---- dense convolutions: the weight gradient as k*k matrix products over shifted rows ----
//
// Output pixel (yo, xo), tap (ky, kx) reads input (s*yo + ky - p, s*xo + kx - p). Writing ky - p =
// s*q + r (0 <= r < s), that is row yo + q of the input's phase r (its rows r, r + s, ...). Each
// phase (ry, rx) is copied once into a grid of Hg x Wg pixels per image whose first c0 = -qmin rows
// and columns are zeros (as are the cells past the phase's edge), and the output gradient into the
// same grid at (0, 0), zeros elsewhere. In that grid the tap's input pixel sits a fixed number of
// rows (of C floats) after its output pixel, off = (qy - qmin) * Wg + (qx - qmin), for every pixel
// of the batch at once: a read past a row's (an image's) end lands in the next row's (image's)
// leading zeros, since Wg >= Wo + qmax (Hg >= Ho + qmax). So the tap's [Co, Ci] gradient is one
// GEMM, gy_grid^T [Co, P] times phase[off : off + P] [P, Ci], P = N * Hg * Wg, MKL's sgemm at
// these shapes where oneDNN's weight gradient ran at half the rate.
struct DenseGrid {
  int64_t N, H, W, Ci, Co, Ho, Wo, k, s, p;
  int64_t qmin, qmax, Hg, Wg, P, tail;
  std::vector<int64_t> q, r;  // per tap
};

DenseGrid dense_grid(const at::Tensor& x, const at::Tensor& gy, int64_t k, int64_t s, int64_t p) {
  DenseGrid g{x.size(0), x.size(2), x.size(3), x.size(1), gy.size(1), gy.size(2), gy.size(3), k, s, p};
  g.qmin = INT64_MAX, g.qmax = INT64_MIN;
  for (int64_t t = 0; t < k; ++t) {
    const int64_t d = t - p, q = d >= 0 ? d / s : -((-d + s - 1) / s);
    g.q.push_back(q), g.r.push_back(d - s * q);
    g.qmin = std::min(g.qmin, q), g.qmax = std::max(g.qmax, q);
  }
  const int64_t c0 = -g.qmin;
  int64_t rows = 0, cols = 0;  // phase rows / columns read at all: below Ho + qmax, inside the input
  for (int64_t t = 0; t < k; ++t) {
    rows = std::max(rows, std::min((g.H - g.r[t] + s - 1) / s, g.Ho + g.qmax));
    cols = std::max(cols, std::min((g.W - g.r[t] + s - 1) / s, g.Wo + g.qmax));
  }
  const int64_t ahead = std::max<int64_t>(g.qmax, 0);
  g.Hg = std::max(c0 + rows, g.Ho + ahead), g.Wg = std::max(c0 + cols, g.Wo + ahead);
  g.P = g.N * g.Hg * g.Wg;
  g.tail = (g.qmax - g.qmin) * (g.Wg + 1);
  return g;
}

// dst [N * Hg * Wg (+ tail), C]: src (channels-last [N, C, Hs, Ws]) rows r0, r0 + s, ... and columns
// cs0, cs0 + s, ... placed from grid cell (c0, c0), count rows x cols; zeros elsewhere.
void fill_grid(const at::Tensor& src, int64_t r0, int64_t cs0, int64_t s, int64_t rows, int64_t cols,
               const DenseGrid& g, int64_t c0, int64_t tail, float* dst) {
  const int64_t C = src.size(1), Hs = src.size(2), Ws = src.size(3);
  const float* in = src.const_data_ptr<float>();
  const int64_t rows_total = g.N * g.Hg;
  at::parallel_for(0, rows_total, 16, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t n = row / g.Hg, i = row % g.Hg - c0;
      float* out = dst + row * g.Wg * C;
      if (i < 0 || i >= rows) {
        std::fill(out, out + g.Wg * C, 0.f);
        continue;
      }
      std::fill(out, out + c0 * C, 0.f);
      const float* irow = in + ((n * Hs + r0 + i * s) * Ws + cs0) * C;
      if (s == 1)
        std::copy(irow, irow + cols * C, out + c0 * C);
      else
        for (int64_t j = 0; j < cols; ++j) std::copy(irow + j * s * C, irow + j * s * C + C, out + (c0 + j) * C);
      std::fill(out + (c0 + cols) * C, out + g.Wg * C, 0.f);
    }
  });
  std::fill(dst + g.P * C, dst + (g.P + tail) * C, 0.f);
}

at::Tensor dense_weight_grad(const at::Tensor& x, const at::Tensor& gy, int64_t k, int64_t s, int64_t p) {
  const auto cl = at::MemoryFormat::ChannelsLast;
  const auto xc = x.contiguous(cl), gc = gy.contiguous(cl);
  const auto g = dense_grid(xc, gc, k, s, p);
  auto ggrid = at::empty({g.P, g.Co}, x.options());
  fill_grid(gc, 0, 0, 1, g.Ho, g.Wo, g, 0, 0, ggrid.mutable_data_ptr<float>());
  const auto gt = ggrid.t();
  auto gw = at::empty({g.Co, g.Ci, k, k}, x.options().memory_format(cl));
  // [Co, k, k, Ci] in memory: the tap (ky, kx) is the [Co, Ci] matrix at ky * k + kx with rows k*k*Ci apart
  const auto taps = gw.permute({0, 2, 3, 1});
  const int64_t c0 = -g.qmin;
  std::vector<std::pair<int64_t, int64_t>> done;
  at::Tensor phase;
  for (int64_t ry = 0; ry < s; ++ry)
    for (int64_t rx = 0; rx < s; ++rx) {
      bool used_y = false, used_x = false;
      for (int64_t t = 0; t < k; ++t) used_y |= g.r[t] == ry, used_x |= g.r[t] == rx;
      if (!used_y || !used_x) continue;
      const int64_t rows = std::min((g.H - ry + s - 1) / s, g.Ho + g.qmax);
      const int64_t cols = std::min((g.W - rx + s - 1) / s, g.Wo + g.qmax);
      if (!phase.defined()) phase = at::empty({g.P + g.tail, g.Ci}, x.options());
      fill_grid(xc, ry, rx, s, std::max<int64_t>(rows, 0), std::max<int64_t>(cols, 0), g, c0, g.tail,
                phase.mutable_data_ptr<float>());
      for (int64_t ky = 0; ky < k; ++ky) {
        if (g.r[ky] != ry) continue;
        for (int64_t kx = 0; kx < k; ++kx) {
          if (g.r[kx] != rx) continue;
          const int64_t off = (g.q[ky] - g.qmin) * g.Wg + (g.q[kx] - g.qmin);
          auto out = taps.select(1, ky).select(1, kx);
          at::mm_out(out, gt, phase.narrow(0, off, g.P));
        }
      }
    }
  return gw;
}

// Whether the forward and input gradient run by Winograd's F(2x2, 3x3) (ops/winograd.h): stride 1,
// padding 1, at most kDenseWinogradMaxChannels in and out.
bool dense_winograd(const at::Tensor& w, int64_t stride, int64_t padding) {
  return stride == 1 && padding == 1 && w.size(2) == 3 && w.size(3) == 3 && w.size(0) <= kDenseWinogradMaxChannels &&
         w.size(1) <= kDenseWinogradMaxChannels;
}

struct DenseConvFunction : torch::autograd::Function<DenseConvFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& bias, int64_t stride, int64_t padding) {
    const bool has_bias = save_conv(ctx, x, w, bias, stride, padding);
    if (dense_winograd(w, stride, padding)) {
      const auto U = winograd_pack_3x3_train(w, false);
      if (winograd_conv3x3_supported(x, U))
        return winograd_conv3x3(x, U, has_bias ? bias.contiguous() : at::Tensor(), false);
    }
    return at::conv2d(x, w, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt, {stride, stride},
                      {padding, padding});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto [x, w, stride, padding, has_bias] = saved_conv(ctx);
    const auto gy = grads[0].contiguous(at::MemoryFormat::ChannelsLast);
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0) && dense_winograd(w, stride, padding))
      // the input gradient of a stride-1 correlation: the correlation of gy with the rotated, transposed filters
      gx = winograd_conv3x3(gy, winograd_pack_3x3_train(w, true), at::Tensor(), false);
    else if (ctx->needs_input_grad(0))
      gx = std::get<0>(at::convolution_backward(gy, x, w, std::nullopt, {stride, stride}, {padding, padding}, {1, 1},
                                                false, {0, 0}, 1, {true, false, false}));
    if (ctx->needs_input_grad(1)) gw = dense_weight_grad(x, gy, w.size(2), stride, padding);
    if (has_bias && ctx->needs_input_grad(2)) gb = at::sum(gy, {0, 2, 3});
    return {gx, gw, gb, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

namespace {
std::atomic<bool> dense_conv_on{true};
}  // namespace

void set_dense_conv_enabled(bool on) { dense_conv_on.store(on, std::memory_order_relaxed); }

bool dense_conv_supported(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding,
                          int64_t dilation, int64_t groups) {
  if (!dense_conv_on.load(std::memory_order_relaxed)) return false;
  if (!x.defined() || !w.defined() || x.dim() != 4 || w.dim() != 4 || !x.device().is_cpu() || !w.device().is_cpu())
    return false;
  if (x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat || groups != 1 || dilation != 1) return false;
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast) || x.is_contiguous()) return false;
  const int64_t k = w.size(2);
  if (w.size(3) != k || w.size(1) != x.size(1) || k != 3 || padding != 1 || (stride != 1 && stride != 2)) return false;
  if (x.size(1) < kDenseWgradMinChannels || w.size(0) < kDenseWgradMinChannels) return false;
  return x.size(0) > 0 && x.size(2) >= 1 && x.size(3) >= 1;
}

at::Tensor dense_conv_train(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                            int64_t padding) {
  return DenseConvFunction::apply(x, w, bias.defined() ? bias : at::empty({0}, w.options()), stride, padding);
}

at::Tensor dense_conv_weight_grad(const at::Tensor& x, const at::Tensor& gy, int64_t k, int64_t stride,
                                  int64_t padding) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && gy.scalar_type() == at::kFloat && x.dim() == 4 && gy.dim() == 4,
              "dense_conv_weight_grad: float32 [N, C, H, W] tensors");
  return dense_weight_grad(x, gy, k, stride, padding);
}

bool depthwise_conv_supported(const at::Tensor& x, const at::Tensor& w, int64_t stride, int64_t padding,
                              int64_t dilation, int64_t groups) {
  if (!x.defined() || !w.defined() || x.dim() != 4 || w.dim() != 4 || !x.device().is_cpu()) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) return false;
  if (w.scalar_type() != x.scalar_type() || !w.device().is_cpu()) return false;
  const int64_t C = x.size(1), k = w.size(2);
  if (groups != C || w.size(0) != C || w.size(1) != 1 || w.size(3) != k) return false;
  if (k != 3 && k != 5 && k != 7) return false;
  if ((stride != 1 && stride != 2) || dilation != 1 || padding < 0 || padding >= k) return false;
  const int64_t Ho = (x.size(2) + 2 * padding - k) / stride + 1, Wo = (x.size(3) + 2 * padding - k) / stride + 1;
  return x.size(0) > 0 && C > 0 && x.size(2) + 2 * padding >= k && x.size(3) + 2 * padding >= k && Ho > 0 && Wo > 0;
}

std::pair<at::Tensor, at::Tensor> depthwise_conv_weight_grad(const at::Tensor& x, const at::Tensor& gy, int64_t k,
                                                             int64_t stride, int64_t padding) {
  const auto xc = x.contiguous(at::MemoryFormat::ChannelsLast);
  const auto gc = gy.to(x.scalar_type()).contiguous(at::MemoryFormat::ChannelsLast);
  const Geometry g{x.size(0), x.size(2), x.size(3), x.size(1), gy.size(2), gy.size(3), stride, padding};
  auto gw = at::empty({g.C, 1, k, k}, x.options().memory_format(at::MemoryFormat::Contiguous));
  auto gb = at::empty({g.C}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.scalar_type() == at::kDouble)
    weight_grad_impl<double, kBlockD>(xc, gc, int(k), g, gw, gb);
  else
    weight_grad_impl<float, kBlockF>(xc, gc, int(k), g, gw, gb);
  return {gw, gb};
}

at::Tensor depthwise_conv_train(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t stride,
                                int64_t padding) {
  // autograd functions take no undefined tensors
  return DepthwiseFunction::apply(x, w, bias.defined() ? bias : at::empty({0}, w.options()), stride, padding);
}

}  // namespace imgtrain::ops
