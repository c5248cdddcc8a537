#include "ops/attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/_softmax_backward_data.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <atomic>
#include <climits>
#include <cmath>

// The BLAS single-precision GEMM the torch library carries (MKL's on x86-64, OpenBLAS's on arm64
// wheels): called directly, a head's GEMMs skip the dispatcher and the tensor wrappers (six GEMMs
// per head and step, 48 heads per ViT-S block at batch 8). Weak: where the library does not export
// it, at::addmm_out on views does the same.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace imgtrain::ops {
namespace {

std::atomic<bool> force_aten{false};

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C, op(A) [M, K] (A stored [K, M] when ta), op(B)
// [K, N] (B stored [N, K] when tb), each with its leading dimension. Column-major BLAS sees the
// transposes, so it computes C^T = op(B)^T op(A)^T.
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (sgemm_ && !force_aten.load(std::memory_order_relaxed)) {
    const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
    const int m = int(M), n = int(N), k = int(K), la = int(lda), lb = int(ldb), lc = int(ldc);
    sgemm_(&b, &a, &n, &m, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
    return;
  }
  const auto f = at::TensorOptions().dtype(at::kFloat);
  auto a = ta ? at::from_blob(const_cast<float*>(A), {K, M}, {lda, 1}, f).t()
              : at::from_blob(const_cast<float*>(A), {M, K}, {lda, 1}, f);
  auto b = tb ? at::from_blob(const_cast<float*>(B), {N, K}, {ldb, 1}, f).t()
              : at::from_blob(const_cast<float*>(B), {K, N}, {ldb, 1}, f);
  auto c = at::from_blob(C, {M, N}, {ldc, 1}, f);
  at::addmm_out(c, c, a, b, beta, alpha);  // beta 0: c's old values are not read
}

struct Shape {
  int64_t B, N, C, H, D;
  float scale;
};

Shape shape_of(const at::Tensor& qkv, int64_t heads) {
  Shape s{qkv.size(0), qkv.size(1), qkv.size(2) / 3, heads, qkv.size(2) / 3 / heads, 0.f};
  s.scale = float(1.0 / std::sqrt(double(s.D)));
  return s;
}

// The scores of head h of image b: S = scale q k^T, P = softmax(S) by rows (S, P [N, N]).
void probabilities(const float* q, const float* k, const Shape& s, at::Tensor& S, at::Tensor& P) {
  const int64_t ld = 3 * s.C;
  gemm(false, true, s.N, s.N, s.D, s.scale, q, ld, k, ld, 0.f, S.data_ptr<float>(), s.N);
  at::_softmax_out(P, S, 1, false);
}

void forward_heads(const at::Tensor& qkv, at::Tensor& out, const Shape& s) {
  const float* base = qkv.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t t0, int64_t t1) {
    c10::AutoGradMode no_grad(false);  // thread-local: OpenMP's threads start with autograd on
    auto S = at::empty({s.N, s.N}, qkv.options()), P = at::empty({s.N, s.N}, qkv.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / s.H, h = t % s.H;
      const float* q = base + b * s.N * 3 * s.C + h * s.D;
      probabilities(q, q + s.C, s, S, P);
      // o_h = P v, written at the head's columns of [B, N, C]
      gemm(false, false, s.N, s.D, s.N, 1.f, P.data_ptr<float>(), s.N, q + 2 * s.C, 3 * s.C, 0.f,
           o + b * s.N * s.C + h * s.D, s.C);
    }
  });
}

void backward_heads(const at::Tensor& qkv, const at::Tensor& go, at::Tensor& gqkv, const Shape& s) {
  const float* base = qkv.data_ptr<float>();
  const float* g = go.data_ptr<float>();
  float* gq = gqkv.data_ptr<float>();
  const int64_t ld = 3 * s.C;
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t t0, int64_t t1) {
    c10::AutoGradMode no_grad(false);
    const auto f = qkv.options();
    auto S = at::empty({s.N, s.N}, f), P = at::empty({s.N, s.N}, f);
    auto dP = at::empty({s.N, s.N}, f), dS = at::empty({s.N, s.N}, f);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / s.H, h = t % s.H;
      const int64_t at_head = b * s.N * ld + h * s.D;
      const float* q = base + at_head;
      const float *k = q + s.C, *v = q + 2 * s.C;
      const float* gout = g + b * s.N * s.C + h * s.D;
      float* dq = gq + at_head;
      float *dk = dq + s.C, *dv = dq + 2 * s.C;
      probabilities(q, k, s, S, P);
      gemm(true, false, s.N, s.D, s.N, 1.f, P.data_ptr<float>(), s.N, gout, s.C, 0.f, dv, ld);  // P^T do
      gemm(false, true, s.N, s.N, s.D, 1.f, gout, s.C, v, ld, 0.f, dP.data_ptr<float>(), s.N);  // do v^T
      at::_softmax_backward_data_out(dS, dP, P, 1, at::kFloat);  // P * (dP - rowsum(dP * P))
      gemm(false, false, s.N, s.D, s.N, s.scale, dS.data_ptr<float>(), s.N, k, ld, 0.f, dq, ld);  // dS k
      gemm(true, false, s.N, s.D, s.N, s.scale, dS.data_ptr<float>(), s.N, q, ld, 0.f, dk, ld);   // dS^T q
    }
  });
}

struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, int64_t heads) {
    const auto x = qkv.contiguous();
    const auto s = shape_of(x, heads);
    auto out = at::empty({s.B, s.N, s.C}, x.options());
    forward_heads(x, out, s);
    ctx->save_for_backward({x});
    ctx->saved_data["heads"] = heads;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    const auto s = shape_of(x, ctx->saved_data["heads"].toInt());
    const auto go = grads[0].to(at::kFloat).contiguous();
    auto gx = at::empty(x.sizes(), x.options());  // every element is written: dq, dk, dv of every head
    backward_heads(x, go, gx, s);
    return {gx, at::Tensor()};
  }
};

}  // namespace

bool attention_from_qkv_supported(const at::Tensor& qkv, int64_t heads) {
  if (!qkv.defined() || qkv.dim() != 3 || !qkv.device().is_cpu() || qkv.scalar_type() != at::kFloat) return false;
  if (heads <= 0 || qkv.size(2) % (3 * heads) != 0 || qkv.size(0) == 0 || qkv.size(1) == 0 || qkv.size(2) == 0)
    return false;
  return qkv.size(1) * qkv.size(2) < INT_MAX;
}

void attention_force_aten_gemm(bool on) { force_aten = on; }

at::Tensor attention_from_qkv(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(attention_from_qkv_supported(qkv, heads), "attention_from_qkv: qkv [B, N, 3 * C] float32 on the CPU");
  return AttentionFunction::apply(qkv, heads);
}

}  // namespace imgtrain::ops
