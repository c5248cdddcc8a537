// A transformer-style MLP with its LayerNorm and residual, for inference on the CPU, computed on
// tiles of pixels so that the hidden activations (4x the channels in ConvNeXt) are written and read
// in cache rather than in memory: a pass over fc1's output costs more than its GEMM on a machine
// with little memory bandwidth (ConvNeXt-T's first stage at batch 8, 224 px: 38 MB per block).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace imgtrain::ops {

// In place h = gelu(h + b), the exact (erf) GELU, for h [rows, cols] and b [cols]: the bias of a
// linear computed as a plain product and its activation in one pass. Float32 rows with unit stride
// take imgtrain's loop (erf as ATen's float kernel evaluates it, with a ~1 ulp exp: the values are
// at::gelu(h + b)'s within float rounding), threaded over rows by at::parallel_for (the calling
// thread alone inside a parallel region); anything else runs add_ and gelu_.
void bias_gelu_(const at::Tensor& h, const at::Tensor& b);
// For training, which keeps the pre-activation: h += b in place, and gelu(h) returned (a new
// contiguous tensor). The same loop and conditions.
at::Tensor bias_gelu_keep_(const at::Tensor& h, const at::Tensor& b);
// GELU's backward with its forward recomputed: d *= gelu'(h) in place (ATen's gelu_backward,
// cdf + h pdf), and gelu(h) returned; one erf and one exp a value for both. h and d [rows, cols].
at::Tensor gelu_grad_(const at::Tensor& h, const at::Tensor& d);

// out[n, h, w] = residual[n, h, w] + gelu(layer_norm(x[n, h, w]) W1^T + b1) W2^T + b2 for x and
// residual [N, H, W, C] (any strides; ConvNeXt's NCHW maps permuted), W1 [D, C], W2 [C, D], GELU
// the exact (erf) one. Returns a contiguous [N, H, W, C] tensor. Each tile is `rows` pixels of one
// image; the tiles are shared among the threads and each tile's ops run on one thread: ATen's
// layer_norm, fc1 as mm with bias_gelu_ after it, fc2 accumulated by addmm_ into residual + b2, so
// the values are those of the modules up to float rounding (the GEMMs' blocking, the order of the
// bias and residual adds, GELU's exp). No autograd: call it without gradients.
at::Tensor ln_mlp_residual_tiled(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                 const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                 const at::Tensor& b2, const at::Tensor& residual, int64_t rows);

// Training: out = residual + scale[n] * gamma * (gelu(layer_norm(x) W1^T + b1) W2^T + b2), the same
// MLP on tiles as one autograd function (ConvNeXt's block after its depthwise convolution, with its
// layer scale `gamma` [C] and timm's drop path as the per-image `scale` [N], undefined for none).
// Forward: per tile, LayerNorm, fc1 into the one saved tensor (fc1's output, [N, H*W, D]), its bias
// and GELU in one pass (bias_gelu_keep_), fc2 (gamma folded into its weight and bias) accumulated
// into the residual, in cache. Backward: per tile, GELU with its gradient (gelu_grad_) and LayerNorm
// recomputed in cache, the input gradients through the same GEMMs, and the weight gradients summed
// over the tiles of fixed groups of tiles and then over the groups in order, so a run's bits do not
// depend on the thread count. The modules' autograd saves and reads back four full-size tensors per
// block (LayerNorm's output, fc1's output, GELU's output, fc2's output); this saves one. The
// gradients equal the modules' up to float rounding (the GEMMs' blocking, gamma folded; the layer
// scale's gradient summed as rows of W2 * (g^T a) + b2 * sum(g)). CPU, float32 or float64; call
// ln_mlp_tiled_train_supported first.
bool ln_mlp_tiled_train_supported(const at::Tensor& x);
at::Tensor ln_mlp_residual_tiled_train(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                       const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                       const at::Tensor& b2, const at::Tensor& gamma, const at::Tensor& scale,
                                       const at::Tensor& residual, int64_t rows);

}  // namespace imgtrain::ops
