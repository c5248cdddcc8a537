#include "ops/mlp.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace imgtrain::ops {

namespace {

// The tiles of an [N, H, W, C] map: `rows` pixels of one image each, the last of an image shorter
struct Tiles {
  int64_t N, HW, rows, per_image;
  Tiles(const at::Tensor& x, int64_t r)
      : N(x.size(0)), HW(x.size(1) * x.size(2)), rows(std::clamp<int64_t>(r, 1, std::max<int64_t>(1, HW))),
        per_image((HW + rows - 1) / rows) {}
  int64_t count() const { return N * per_image; }
  int64_t image(int64_t t) const { return t / per_image; }
  int64_t first(int64_t t) const { return (t % per_image) * rows; }
  int64_t last(int64_t t) const { return std::min(HW, first(t) + rows); }
  // the (pixels, C) view of tile t of m ([N, H, W, C], H and W mergeable)
  at::Tensor of(const at::Tensor& m, int64_t t) const {
    return m.select(0, image(t)).flatten(0, 1).slice(0, first(t), last(t));
  }
  // the (pixels, D) rows of tile t of an [N, H * W, D] tensor
  at::Tensor rows_of(const at::Tensor& m, int64_t t) const {
    return m.select(0, image(t)).slice(0, first(t), last(t));
  }
};

// The loops, over `rows` rows of `cols` floats at the given row strides:
// p = gelu(p + b)
IMGTRAIN_CLONES void bias_gelu_rows(float* p, int64_t ld, int64_t rows, int64_t cols, const float* b) {
  for (int64_t i = 0; i < rows; ++i, p += ld)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = p[j] + b[j];
      p[j] = gelu_of(v, erf_parts(v * kAlpha).erf);
    }
}
// h = h + b, a = gelu(h)
IMGTRAIN_CLONES void bias_gelu_keep_rows(float* h, int64_t ldh, float* a, int64_t lda, int64_t rows, int64_t cols,
                                         const float* b) {
  for (int64_t i = 0; i < rows; ++i, h += ldh, a += lda)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = h[j] + b[j];
      h[j] = v;
      a[j] = gelu_of(v, erf_parts(v * kAlpha).erf);
    }
}
// a = gelu(h), d = d gelu'(h): one erf and one exp for both
IMGTRAIN_CLONES void gelu_grad_rows(const float* h, int64_t ldh, float* a, int64_t lda, float* d, int64_t ldd,
                                    int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i, h += ldh, a += lda, d += ldd)
    for (int64_t j = 0; j < cols; ++j) {
      const float v = h[j];
      const auto [erf, e] = erf_parts(v * kAlpha);
      a[j] = gelu_of(v, erf);
      d[j] = d[j] * (0.5f * (1.0f + erf) + v * (kBeta * e));
    }
}

// Whether the loops take these: float32 CPU matrices of one shape with unit column stride, and a
// contiguous bias row of their width
bool rows_ok(std::initializer_list<const at::Tensor*> ms, const at::Tensor* b) {
  const auto& m0 = **ms.begin();
  for (auto* m : ms)
    if (m->dim() != 2 || m->scalar_type() != at::kFloat || !m->device().is_cpu() || m->sizes() != m0.sizes() ||
        m->stride(1) != 1)
      return false;
  return !b || (b->dim() == 1 && b->scalar_type() == at::kFloat && b->device().is_cpu() && b->is_contiguous() &&
                b->size(0) == m0.size(1));
}
// f(first row, row count) over the rows, on at::parallel_for's threads (the caller's alone inside
// a parallel region)
template <typename F>
void over_rows(const at::Tensor& m, F f) {
  at::parallel_for(0, m.size(0), std::max<int64_t>(1, 16384 / std::max<int64_t>(m.size(1), 1)),
                   [&](int64_t r0, int64_t r1) { f(r0, r1 - r0); });
}
template <typename T = float>
T* row(const at::Tensor& m, int64_t r) {
  return m.data_ptr<T>() + r * m.stride(0);
}

}  // namespace

void bias_gelu_(const at::Tensor& h, const at::Tensor& b) {
  TORCH_CHECK(h.dim() == 2 && b.dim() == 1 && b.size(0) == h.size(1), "bias_gelu_: h [rows, cols] and b [cols]");
  if (!rows_ok({&h}, &b)) {
    at::gelu_(h.add_(b));
    return;
  }
  over_rows(h, [&](int64_t r0, int64_t n) { bias_gelu_rows(row(h, r0), h.stride(0), n, h.size(1), b.data_ptr<float>()); });
}

at::Tensor bias_gelu_keep_(const at::Tensor& h, const at::Tensor& b) {
  TORCH_CHECK(h.dim() == 2 && b.dim() == 1 && b.size(0) == h.size(1), "bias_gelu_keep_: h [rows, cols] and b [cols]");
  if (!rows_ok({&h}, &b)) return at::gelu(h.add_(b));
  auto a = at::empty(h.sizes(), h.options());
  over_rows(h, [&](int64_t r0, int64_t n) {
    bias_gelu_keep_rows(row(h, r0), h.stride(0), row(a, r0), a.stride(0), n, h.size(1), b.data_ptr<float>());
  });
  return a;
}

at::Tensor gelu_grad_(const at::Tensor& h, const at::Tensor& d) {
  TORCH_CHECK(h.dim() == 2 && d.sizes() == h.sizes(), "gelu_grad_: h and d [rows, cols]");
  if (!rows_ok({&h, &d}, nullptr)) {
    d.copy_(at::gelu_backward(d, h));
    return at::gelu(h);
  }
  auto a = at::empty(h.sizes(), h.options());
  over_rows(h, [&](int64_t r0, int64_t n) {
    gelu_grad_rows(row(h, r0), h.stride(0), row(a, r0), a.stride(0), row(d, r0), d.stride(0), n, h.size(1));
  });
  return a;
}

at::Tensor ln_mlp_residual_tiled(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                 const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                 const at::Tensor& b2, const at::Tensor& residual, int64_t rows) {
  TORCH_CHECK(x.dim() == 4 && residual.sizes() == x.sizes(), "ln_mlp_residual_tiled: x and residual [N, H, W, C]");
  const Tiles tl(x, rows);
  const int64_t C = x.size(3);
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto w1t = w1.t(), w2t = w2.t();
  RECORD_FUNCTION("imgtrain::ln_mlp_residual_tiled", std::vector<c10::IValue>());  // a row in --profile
  // ATen ops inside the parallel region run on the calling thread (and MKL's GEMM with one thread).
  // Per tile: fc1 as a plain product with its bias added in GELU's pass (addmm would first copy the
  // bias into the output), then fc2 accumulated into residual + b2 (one pass instead of addmm's
  // bias copy and a residual add after it).
  at::parallel_for(0, tl.count(), 1, [&](int64_t t0, int64_t t1) {
    c10::AutoGradMode no_grad(false);  // thread-local: OpenMP's threads start with autograd on
    for (int64_t t = t0; t < t1; ++t) {
      auto h = at::mm(at::layer_norm(tl.of(x, t), {C}, ln_w, ln_b, eps), w1t);
      bias_gelu_(h, b1);
      auto o = tl.of(out, t);
      at::add_out(o, tl.of(residual, t), b2);
      o.addmm_(h, w2t);
    }
  });
  return out;
}

namespace {

std::vector<double> scale_values(const at::Tensor& scale) {
  std::vector<double> v;
  if (scale.numel() == 0) return v;
  const auto d = scale.to(at::kDouble).contiguous();
  v.assign(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  return v;
}

constexpr int64_t kGradGroups = 16;  // backward: the tiles in this many fixed groups (thread-independent sums)

struct LnMlpTrainFunction : torch::autograd::Function<LnMlpTrainFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& ln_w,
                            const at::Tensor& ln_b, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                            const at::Tensor& b2, const at::Tensor& gamma, const at::Tensor& residual,
                            const at::Tensor& scale, double eps, int64_t rows) {
    const Tiles tl(x, rows);
    const int64_t C = x.size(3), D = w1.size(0);
    auto hs = at::empty({tl.N, tl.HW, D}, x.options());  // fc1's output: the one tensor kept for backward
    auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    const auto w2f = w2 * gamma.unsqueeze(1), b2f = b2 * gamma;
    const auto w1t = w1.t(), w2ft = w2f.t();
    const auto sv = scale_values(scale);
    at::parallel_for(0, tl.count(), 1, [&](int64_t t0, int64_t t1) {
      c10::AutoGradMode no_grad(false);  // thread-local: OpenMP's threads start with autograd on
      for (int64_t t = t0; t < t1; ++t) {
        // as the inference tiles: fc1's bias added in GELU's pass, fc2 accumulated into the
        // residual plus its (scaled) bias
        auto h = tl.rows_of(hs, t);
        at::mm_out(h, at::layer_norm(tl.of(x, t), {C}, ln_w, ln_b, eps), w1t);
        const auto a = bias_gelu_keep_(h, b1);
        auto o = tl.of(out, t);
        const double s = sv.empty() ? 1.0 : sv[size_t(tl.image(t))];
        at::add_out(o, tl.of(residual, t), b2f, s);
        o.addmm_(a, w2ft, 1.0, s);
      }
    });
    ctx->save_for_backward({x, ln_w, ln_b, w1, w2, b2, gamma, scale, hs});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rows"] = tl.rows;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &ln_w = s[1], &ln_b = s[2], &w1 = s[3], &w2 = s[4], &b2 = s[5], &gamma = s[6],
               &scale = s[7], &hs = s[8];
    const auto& g = grads[0];
    if (!g.defined()) return torch::autograd::variable_list(12);
    const double eps = ctx->saved_data["eps"].toDouble();
    const Tiles tl(x, ctx->saved_data["rows"].toInt());
    const int64_t C = x.size(3), D = w1.size(0), T = tl.count(), G = std::min(T, kGradGroups);
    const auto w2f = w2 * gamma.unsqueeze(1);
    const auto sv = scale_values(scale);
    auto dx = at::empty_like(x);
    auto acc_w1 = at::zeros({G, D, C}, x.options()), acc_gw2 = at::zeros({G, C, D}, x.options());
    auto acc_b1 = at::zeros({G, D}, x.options()), acc_c = at::zeros({G, 3, C}, x.options());  // sum g, LN w, LN b
    // group k takes tiles [k T / G, (k + 1) T / G): fixed whatever the thread count, each group's
    // sums in tile order, then the groups summed in order
    at::parallel_for(0, G, 1, [&](int64_t k0, int64_t k1) {
      c10::AutoGradMode no_grad(false);
      for (int64_t k = k0; k < k1; ++k) {
        auto aw1 = acc_w1.select(0, k), agw2 = acc_gw2.select(0, k), ab1 = acc_b1.select(0, k);
        auto ac = acc_c.select(0, k);
        for (int64_t t = k * T / G; t < (k + 1) * T / G; ++t) {
          auto gt = tl.of(g, t);
          if (!sv.empty()) gt = gt * sv[size_t(tl.image(t))];
          const auto xt = tl.of(x, t);
          const auto h = tl.rows_of(hs, t);
          const auto [xn, mean, rstd] = at::native_layer_norm(xt, {C}, ln_w, ln_b, eps);
          const auto dh = at::mm(gt, w2f);
          const auto a = gelu_grad_(h, dh);  // dh = gelu'(h) (g W2f), a = gelu(h)
          agw2.addmm_(gt.t(), a);            // fc2's weight gradient before gamma: g^T gelu(h)
          ac.select(0, 0).add_(gt.sum(0));
          aw1.addmm_(dh.t(), xn);
          ab1.add_(dh.sum(0));
          const auto [dxt, dlw, dlb] =
              at::native_layer_norm_backward(at::mm(dh, w1), xt, {C}, mean, rstd, ln_w, ln_b, {true, true, true});
          tl.of(dx, t).copy_(dxt);
          ac.select(0, 1).add_(dlw);
          ac.select(0, 2).add_(dlb);
        }
      }
    });
    const auto gw2 = acc_gw2.sum(0), c = acc_c.sum(0);
    const auto gsum = c.select(0, 0);
    // out = gamma * (a W2^T + b2): dW2 = gamma * g^T a, db2 = gamma * sum g, dgamma = sum over
    // pixels of g * (a W2^T + b2) = rows of W2 * (g^T a) + b2 * sum g
    auto dgamma = (w2 * gw2).sum(1) + b2 * gsum;
    return {dx,
            c.select(0, 1).clone(),
            c.select(0, 2).clone(),
            acc_w1.sum(0),
            acc_b1.sum(0),
            gw2 * gamma.unsqueeze(1),
            gsum * gamma,
            dgamma,
            ctx->needs_input_grad(8) ? g : at::Tensor(),  // the residual's
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

bool ln_mlp_tiled_train_supported(const at::Tensor& x) {
  return x.defined() && x.device().is_cpu() && x.dim() == 4 && x.numel() > 0 &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble) &&
         x.stride(1) == x.size(2) * x.stride(2) && !at::autocast::is_autocast_enabled(at::kCPU);
}

at::Tensor ln_mlp_residual_tiled_train(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                       const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                       const at::Tensor& b2, const at::Tensor& gamma, const at::Tensor& scale,
                                       const at::Tensor& residual, int64_t rows) {
  TORCH_CHECK(ln_mlp_tiled_train_supported(x) && residual.sizes() == x.sizes(),
              "ln_mlp_residual_tiled_train: x and residual [N, H, W, C] on the CPU, float32 or float64");
  TORCH_CHECK(!scale.defined() || scale.numel() == x.size(0), "ln_mlp_residual_tiled_train: scale [N]");
  return LnMlpTrainFunction::apply(x, ln_w, ln_b, w1, b1, w2, b2, gamma, residual,
                                   scale.defined() ? scale : at::empty({0}, x.options()), eps, rows);
}

}  // namespace imgtrain::ops
