// Training-mode BatchNorm fused with what follows it in a conv block: the optional residual add and
// the activation, act(batch_norm(x) + residual), forward and backward through autograd, in two
// passes over memory each way instead of the four to six of separate ATen ops (statistics,
// normalise, add, activation; and their backwards). CPU float32, NCHW or channels-last (float64
// too, in plain loops: it lets tests hold whole models to torch's float64 modules, where float32
// would differ wherever a pre-activation sits within rounding of a ReLU kink); in CUDA builds the
// same on CUDA tensors (norm_act_cuda.cu: the same arithmetic per element, per-channel sums in
// double over fixed chunks, no atomics; compiled, not yet run on a GPU). Other inputs are not
// taken (batch_norm_act_supported says which), and the caller keeps torch's modules for those.
//
// Numerics: the statistics are shifted sums (x - x[first]) in float over fixed blocks, added in
// double in a fixed order, so a run gives the same bits whatever the thread count; they differ
// from ATen's two-pass double sums by float rounding, as does the normalisation
// ((x - mean) * scale + bias with scale = weight / sqrt(var + eps)). The running statistics are updated as torch does
// (momentum, unbiased variance). SiLU uses an exp of ~1 ulp accuracy that vectorises.
#pragma once
#include <ATen/core/Tensor.h>

namespace imgtrain::ops {

enum class NormAct { None, ReLU, ReLU6, SiLU, HardSwish };

// Whether batch_norm_act_train takes x (and residual, when defined): float32 or float64 on the CPU
// (or a CUDA device, in CUDA builds), 4-D,
// contiguous or channels-last, a residual of x's sizes and strides, at least two values per channel.
bool batch_norm_act_supported(const at::Tensor& x, const at::Tensor& residual);

// act(batch_norm(x) + residual) with batch statistics; running_mean / running_var (x's dtype, [C])
// updated in place with `momentum` as torch's BatchNorm2d does. weight and bias: [C], defined.
at::Tensor batch_norm_act_train(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                double eps, NormAct act, const at::Tensor& residual);

// The number of threads an at::parallel_for of these kernels runs on now (1 when the library was
// built without OpenMP, whatever at::get_num_threads() says): the kernels' threading, testable.
int kernel_threads();

}  // namespace imgtrain::ops
