// Squeeze-and-excite (timm's SqueezeExcite: mean over H, W; 1x1 conv reduce with bias;
// activation; 1x1 conv expand with bias; gate; x * gate) as one autograd function for training.
// Forward runs ATen's own ops (the same values as the modules). Backward reads the output
// gradient g and x once for the gate's gradient, sum over H, W of g * x per (n, c), runs the
// small MLP's backward with ATen's backward ops, and then writes the input gradient in one pass,
// g * gate + (gradient of the mean) / (H * W), which autograd builds from the modules in four
// passes and three full-size temporaries (g * gate, g * x, the mean's expanded gradient, their
// sum). The input gradient is bitwise the modules' given the same gate gradient; that gradient is
// a float sum in a fixed order (so the same bits for any thread count) where ATen's reduction
// rounds differently. CPU float32 and float64, NCHW or channels-last; in CUDA builds the same on
// CUDA tensors (se_gate_cuda.cu: sums in double in a fixed order, the input gradient without
// fused multiply-adds; compiled, not yet run on a GPU).
#pragma once
#include <ATen/core/Tensor.h>

namespace imgtrain::ops {

enum class SeAct { ReLU, ReLU6, SiLU, HardSwish, GELU };
enum class SeGate { Sigmoid, HardSigmoid };

// Whether se_gate_train takes x: float32 or float64 on the CPU (or CUDA, in CUDA builds), 4-D,
// contiguous or channels-last,
// with weights of x's dtype.
bool se_gate_supported(const at::Tensor& x, const at::Tensor& w_reduce);

// x * gate(conv_expand(act(conv_reduce(mean_hw(x))))), the convolutions 1x1 with bias:
// w_reduce [R, C, 1, 1], b_reduce [R], w_expand [C, R, 1, 1], b_expand [C].
at::Tensor se_gate_train(const at::Tensor& x, const at::Tensor& w_reduce, const at::Tensor& b_reduce,
                         const at::Tensor& w_expand, const at::Tensor& b_expand, SeAct act, SeGate gate);

}  // namespace imgtrain::ops
