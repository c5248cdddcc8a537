#include "ops/depthwise.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/flip.h>
#include <torch/autograd.h>

#include <algorithm>
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

struct DepthwiseFunction : torch::autograd::Function<DepthwiseFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& bias, int64_t stride, int64_t padding) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    const bool has_bias = bias.numel() > 0;  // an empty tensor stands for none (see depthwise_conv_train)
    ctx->saved_data["bias"] = has_bias;
    return at::conv2d(x, w, has_bias ? std::optional<at::Tensor>(bias) : std::nullopt, {stride, stride},
                      {padding, padding}, {1, 1}, x.size(1));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto v = ctx->get_saved_variables();
    const auto& x = v[0];
    const auto& w = v[1];
    const int64_t stride = ctx->saved_data["stride"].toInt(), padding = ctx->saved_data["padding"].toInt();
    const bool has_bias = ctx->saved_data["bias"].toBool();
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

}  // namespace

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
