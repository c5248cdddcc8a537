// Multi-head self-attention on the CPU, one (image, head) at a time: its N x N scores are computed,
// normalised and used while they are in cache, with no pass over a [B, H, N, N] tensor in memory
// and none of a flash kernel's per-block rescaling (a ViT's N = 197 fits one block). The q, k and v
// are read where the qkv projection wrote them and the output is written with the heads already
// concatenated, so the permute of q / k / v and the transpose of the output (two copies in timm's
// Attention) are not made; the backward writes dq, dk and dv straight into the projection's
// output gradient (autograd's unbind backward stacks three tensors into one).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace imgtrain::ops {

// Whether attention_from_qkv takes this input: qkv [B, N, 3 * C] float32 on the CPU, C divisible
// by heads, N and C within a BLAS int.
bool attention_from_qkv_supported(const at::Tensor& qkv, int64_t heads);

// softmax(q k^T / sqrt(D)) v per head, for q, k, v = qkv.reshape(B, N, 3, heads, D) (timm's
// Attention layout, D = C / heads); returns [B, N, C] (timm's o.transpose(1, 2).reshape(B, N, C)).
// Autograd: the backward recomputes each head's probabilities from q and k (as the flash kernel
// does; nothing [B, H, N, N] is kept between forward and backward).
at::Tensor attention_from_qkv(const at::Tensor& qkv, int64_t heads);

// Tests: on, the GEMMs go through at::addmm_out, as where the torch library exports no sgemm_.
void attention_force_aten_gemm(bool on);

}  // namespace imgtrain::ops
