// A transformer-style MLP with its LayerNorm and residual, for inference on the CPU, computed on
// tiles of pixels so that the hidden activations (4x the channels in ConvNeXt) are written and read
// in cache rather than in memory: a pass over fc1's output costs more than its GEMM on a machine
// with little memory bandwidth (ConvNeXt-T's first stage at batch 8, 224 px: 38 MB per block).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace imgtrain::ops {

// out[n, h, w] = residual[n, h, w] + gelu(layer_norm(x[n, h, w]) W1^T + b1) W2^T + b2 for x and
// residual [N, H, W, C] (any strides; ConvNeXt's NCHW maps permuted), W1 [D, C], W2 [C, D], GELU
// the exact (erf) one. Returns a contiguous [N, H, W, C] tensor. Each tile is `rows` pixels of one
// image; the tiles are shared among the threads and each tile's ops run on one thread, ATen's own
// (layer_norm, addmm, gelu_), so the values are those of the same ops on the whole tensor up to
// the GEMM's blocking. No autograd: call it without gradients.
at::Tensor ln_mlp_residual_tiled(const at::Tensor& x, const at::Tensor& ln_w, const at::Tensor& ln_b, double eps,
                                 const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                 const at::Tensor& b2, const at::Tensor& residual, int64_t rows);

}  // namespace imgtrain::ops
