// imgtrain's Winograd F(2x2, 3x3) convolution (ops/winograd.cpp) against oneDNN's fused
// convolution + bias + ReLU (mkldnn::_convolution_pointwise, what imgtrain's inference runs), on
// ResNet-50's stride-1 3x3 convolutions at batch 8, 224 px, channels-last, float32. Best of 9
// passes, milliseconds, at the thread count OMP_NUM_THREADS gives; and each one's largest error
// against a float64 convolution, relative to the output's largest magnitude.
//   g++ -O3 -std=gnu++20 -fno-trapping-math -Ilib -isystem $T/include \
//       -isystem $T/include/torch/csrc/api/include bench/winograd_parts.cpp -o /tmp/winograd_parts \
//       -L$T/lib -ltorch -ltorch_cpu -lc10 -Wl,-rpath,$T/lib -Wno-psabi -fopenmp
//       (T=$(.venv/bin/python -c 'import torch, os; print(os.path.dirname(torch.__file__))'))
//   OMP_NUM_THREADS=2 /tmp/winograd_parts
#include "best_ms.h"
#include "ops/winograd.cpp"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <cstdio>

int main() {
  c10::InferenceMode guard;
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("mkldnn::_convolution_pointwise", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                        at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, c10::string_view,
                                        c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>)>();
  std::printf("%3s %6s %4s | %9s %9s %9s | %9s %9s %9s | GFLOP/s direct-equivalent\n", "N", "C", "HxW", "oneDNN",
              "F(2x2)", "F(4x4)", "err dnn", "err F2", "err F4");
  const std::vector<std::array<int64_t, 3>> shapes = {{8, 64, 56},  {8, 128, 28}, {8, 256, 14}, {8, 512, 7},
                                                      {1, 64, 56},  {1, 128, 28}, {1, 256, 14}, {1, 512, 7},
                                                      {8, 32, 112}, {8, 16, 112}, {32, 256, 14}, {32, 512, 7}};
  for (auto [N, C, S] : shapes) {
    auto x = at::randn({N, C, S, S}).relu_().contiguous(at::MemoryFormat::ChannelsLast);
    auto w = at::randn({C, C, 3, 3}) * (1.0 / std::sqrt(9.0 * C));
    auto b = at::randn({C}) * 0.1;
    auto wc = w.contiguous(at::MemoryFormat::ChannelsLast);
    const auto U = imgtrain::ops::winograd_pack_3x3(w);
    const auto U4 = imgtrain::ops::winograd_pack_3x3(w, 4);
    at::Tensor yd, yw, y4;
    const double td = best_ms([&] {
      yd = op.call(x, wc, b, {1, 1}, {1, 1}, {1, 1}, 1, "relu", c10::List<std::optional<c10::Scalar>>(), std::nullopt);
    }, 9);
    const double tw = best_ms([&] { yw = imgtrain::ops::winograd_conv3x3(x, U, b, true); }, 9);
    const double t4 = best_ms([&] { y4 = imgtrain::ops::winograd_conv3x3(x, U4, b, true); }, 9);
    const auto ref = at::conv2d(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble), 1, 1).relu_();
    const double scale = ref.abs().max().item<double>();
    const double ed = (yd.to(at::kDouble) - ref).abs().max().item<double>() / scale;
    const double ew = (yw.to(at::kDouble) - ref).abs().max().item<double>() / scale;
    const double e4 = (y4.to(at::kDouble) - ref).abs().max().item<double>() / scale;
    const double gf = 2.0 * N * C * C * 9 * S * S / 1e9;
    std::printf("%3ld %6ld %4ld | %9.3f %9.3f %9.3f | %9.2e %9.2e %9.2e | %.0f %.0f %.0f\n", long(N), long(C), long(S), td,
                tw, t4, ed, ew, e4, gf / td * 1e3, gf / tw * 1e3, gf / t4 * 1e3);
  }
}
