// imgtrain's GELU loops (ops/mlp.cpp) against ATen's gelu and gelu_backward, one thread, float32,
// [rows, 1536] (ConvNeXt-T's and ViT-S's fc1 width): 256 rows stay in L2, 1568 (a batch of 8 at
// 14x14 or 196 tokens) do not. Each op timed alone, best of 15 passes, in milliseconds. In-place
// ops run again on their own output (zero bias), so no copy is timed with them. It compiles the
// loops' translation unit into itself.
//   g++ -O3 -std=gnu++20 -fno-trapping-math -fno-thread-jumps -Ilib -isystem $T/include \
//       -isystem $T/include/torch/csrc/api/include bench/gelu_parts.cpp -o /tmp/gelu_parts \
//       -L$T/lib -ltorch -ltorch_cpu -lc10 -Wl,-rpath,$T/lib -Wno-psabi
//       (T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))'))
//   taskset -c 1 /tmp/gelu_parts
#include "best_ms.h"
#include "ops/mlp.cpp"

#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>

#include <cstdio>

int main() {
  using namespace imgtrain::ops;
  at::set_num_threads(1);
  for (int64_t rows : {256, 1568}) {
    const auto h = at::randn({rows, 1536}), d = at::randn({rows, 1536}), zero = at::zeros({1536});
    auto inplace = h.clone(), kept = h.clone(), dg = d.clone();
    const double gelu = best_ms([&] { auto a = at::gelu(h); }, 15);
    const double gelu_bw = best_ms([&] { auto g = at::gelu_backward(d, h); }, 15);
    const double ours_inplace = best_ms([&] { bias_gelu_(inplace, zero); }, 15);
    const double ours_keep = best_ms([&] { auto a = bias_gelu_keep_(kept, zero); }, 15);
    const double ours_grad = best_ms([&] { auto a = gelu_grad_(h, dg); }, 15);
    std::printf("%lld x 1536: at::gelu %.3f  at::gelu_backward %.3f  |  bias_gelu_ (in place) %.3f  "
                "bias_gelu_keep_ (h and gelu(h)) %.3f  gelu_grad_ (gelu(h) and the gradient) %.3f\n",
                (long long)rows, gelu, gelu_bw, ours_inplace, ours_keep, ours_grad);
  }
}
