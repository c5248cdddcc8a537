// Multi-head self-attention on the CPU for inference and training, read straight from the qkv
// projection's output (ViT's blocks): each image's head on one thread with its keys, scores and
// values in that core's caches, the products as register-blocked kernels for AVX-512 or AVX2 + FMA. At ViT-S's 197
// tokens and head size 64 it takes 22-23 ms of the batch-8 inference step where
// at::scaled_dot_product_attention's CPU kernel took 35-37 (docs/performance.md).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace imgtrain::ops {

// Whether attention_infer applies: qkv float32 on the CPU, contiguous [B, N, 3 * heads * 64] (head
// size 64: ViT-Ti/S/B) with 1 <= N <= 1024 (ViT at 224 px has 197 tokens, at 384 px 577; longer
// sequences keep ATen's kernel, faster there), no gradient to record, a GCC x86-64 build and a CPU
// with FMA and AVX-512F or AVX2.
bool attention_infer_supported(const at::Tensor& qkv, int64_t heads);

// qkv [B, N, 3C] as timm's Attention reshapes it (B, N, 3, heads, 64: q, k, v of head h at columns
// h*64, C + h*64, 2C + h*64). Returns o [B, N, C], contiguous, o[b, :, h*64 : h*64+64] =
// softmax(q k^T / 8) v for that image and head: scaled_dot_product_attention(q, k, v)
// .transpose(1, 2).reshape(B, N, C) up to float rounding (sums in another order, exp by Cephes'
// polynomial within ~1 ulp; the 1/8 folded into k is exact). Each (image, head) runs on one thread.
at::Tensor attention_infer(const at::Tensor& qkv, int64_t heads);

// Training (an autograd function): the same output, and in backward the gradient of qkv in its
// layout, computed per image and head on one thread as flash attention's backward does (the
// probabilities recomputed from the saved log-sum-exp of each row: P = exp(q k^T / 8 - lse),
// dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K / 8, dK = dS^T Q / 8), the products as
// the forward's kernels. Equal to scaled_dot_product_attention's gradients up to float rounding; the
// same bits for any thread count. The conditions of attention_infer_supported but for the gradient.
bool attention_train_supported(const at::Tensor& qkv, int64_t heads);
at::Tensor attention_train(const at::Tensor& qkv, int64_t heads);

// The kernels' copies this CPU can run, the one used by default first: "avx512", "avx2", and
// "avx2-w16" (for the tests: AVX-512's blocking on pairs of AVX2 registers, so that CPUs without
// AVX-512 run the code paths the AVX-512 copy takes); empty where the kernels do not apply.
std::vector<std::string> attention_kernel_variants();
// The copy in use ("" where none).
std::string attention_kernel_variant();
// Tests: run `variant` (one of attention_kernel_variants()) from now on; "" restores the default.
void use_attention_kernels(const std::string& variant);

}  // namespace imgtrain::ops
