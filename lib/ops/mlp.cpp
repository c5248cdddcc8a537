#include "ops/mlp.h"

#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>

#include <algorithm>

namespace imgtrain::ops {

at::Tensor ln_mlp_residual_tiled(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                 const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                 const at::Tensor& b2, const at::Tensor& residual, int64_t rows) {
  TORCH_CHECK(x.dim() == 4 && residual.sizes() == x.sizes(), "ln_mlp_residual_tiled: x and residual [N, H, W, C]");
  const int64_t N = x.size(0), C = x.size(3), HW = x.size(1) * x.size(2);
  rows = std::max<int64_t>(1, rows);
  const int64_t per_image = (HW + rows - 1) / rows;
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const auto w1t = w1.t(), w2t = w2.t();
  // ATen ops inside the parallel region run on the calling thread (and MKL's GEMM with one thread)
  at::parallel_for(0, N * per_image, 1, [&](int64_t t0, int64_t t1) {
    c10::AutoGradMode no_grad(false);  // thread-local: OpenMP's threads start with autograd on
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t / per_image, p0 = (t % per_image) * rows, p1 = std::min(HW, p0 + rows);
      // (pixels, C) views of image n, strided where the map is NCHW in memory
      const auto pixels = [&](const at::Tensor& m) { return m.select(0, n).flatten(0, 1).slice(0, p0, p1); };
      auto h = at::addmm(b1, at::layer_norm(pixels(x), {C}, ln_w, ln_b, eps), w1t);
      at::gelu_(h);
      auto o = pixels(out);
      at::addmm_out(o, b2, h, w2t);
      o.add_(pixels(residual));
    }
  });
  return out;
}

}  // namespace imgtrain::ops
