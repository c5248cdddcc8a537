#include "ops/attention.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <string>
#include <vector>

// The kernels (attention_kernels.inc) are written once over a small vector interface and compiled
// for AVX-512 and for AVX2 + FMA, each copy in functions compiled for that target (the rest of the
// build is baseline x86-64); the CPU is asked once which copy runs. Other compilers and CPUs keep
// ATen's scaled_dot_product_attention.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_ATTENTION_SIMD 1
#include <immintrin.h>
#endif

namespace imgtrain::ops {
namespace {

constexpr int64_t kHead = 64;   // head size the kernels are written for
constexpr int kRows = 6;        // query rows per register block (attention_kernels.inc)
constexpr int64_t kVChunk = 64;  // value rows per pass of the second product (16 KB, in L1)
// Longest sequence it takes: it holds a head's whole score matrix (4 MB at 1024 tokens), where ATen's
// flash kernel blocks the keys; measured on 48 heads at two threads, this kernel against ATen's:
// 197 tokens 2.25 / 2.96 ms, 577 tokens 18.3 / 21.2, 1025 tokens 63.4 / 63.8, 2048 tokens 256 / 237.
constexpr int64_t kMaxTokens = 1024;

int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

// Scratch floats for one head of n tokens (forward and backward). A thread holds them in an
// AlignedVector (64-byte boundary): every buffer in it starts at a multiple of 16 floats and its
// rows are multiples of 16 floats, so the kernels' vector loads never straddle two cache lines.
int64_t scratch_size(int64_t n) {
  const int64_t np = padded(n);
  return 2 * kHead * np + 2 * n * np + n * kHead + 3 * n;
}

// One image and head forward (attend_head) and backward (attend_head_backward), from one copy of
// attention_kernels.inc.
struct Kernels {
  const char* name;
  void (*forward)(const float* q, const float* k, const float* v, int64_t ld, int64_t n, float scale, float* out,
                  int64_t ldo, float* lse, float* ws);
  void (*backward)(const float* q, const float* k, const float* v, int64_t ld, const float* o, const float* go,
                   int64_t ldo, const float* lse, int64_t n, float scale, float* dq, float* dk, float* dv,
                   float* ws);
};

#ifdef IMGTRAIN_ATTENTION_SIMD
#define IMGTRAIN_ATTN_UNROLL _Pragma("GCC unroll 8")
#define IMGTRAIN_ATTN_AI inline __attribute__((always_inline))

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
struct V {
  using vec = __m512;
  static constexpr int W = 16;
  static constexpr int kKeyVecs = 4;  // 6 x 4 accumulators, 4 key vectors, 1 broadcast: 29 of 32 registers
  static constexpr int kColVecs = 4;
  static IMGTRAIN_ATTN_AI vec zero() { return _mm512_setzero_ps(); }
  static IMGTRAIN_ATTN_AI vec set1(float x) { return _mm512_set1_ps(x); }
  static IMGTRAIN_ATTN_AI vec load(const float* p) { return _mm512_loadu_ps(p); }
  static IMGTRAIN_ATTN_AI void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
  static IMGTRAIN_ATTN_AI vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
  static IMGTRAIN_ATTN_AI vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
  static IMGTRAIN_ATTN_AI float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }
  static IMGTRAIN_ATTN_AI float reduce_add(vec v) { return _mm512_reduce_add_ps(v); }
  static IMGTRAIN_ATTN_AI vec first(vec v, int k, vec fill) {
    const __mmask16 keep = k >= W ? __mmask16(0xffff) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1);
    return _mm512_mask_blend_ps(keep, fill, v);
  }
  // exp's pieces (attention_kernels.inc): AVX-512's own rounding (roundscale) and power of two
  // (scalef), 14 instructions for exp where the integer-exponent form took 21.
  static IMGTRAIN_ATTN_AI vec fnmadd(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
  static IMGTRAIN_ATTN_AI vec round(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static IMGTRAIN_ATTN_AI vec times_pow2(vec y, vec n) { return _mm512_scalef_ps(y, n); }
  static IMGTRAIN_ATTN_AI vec lo(vec a, vec b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  }
  static IMGTRAIN_ATTN_AI vec hi(vec a, vec b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  }
  // The 16 x 16 floats in r[0..16) (r[i] = row i) transposed in registers.
  static IMGTRAIN_ATTN_AI void transpose(vec r[16]) {
    __m512 t[16];
    IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // r[4g + k]: rows 4g..4g+3, element k of each 128-bit lane
    IMGTRAIN_ATTN_UNROLL for (int g = 0; g < 4; ++g) {
      r[4 * g + 0] = lo(t[4 * g + 0], t[4 * g + 2]);
      r[4 * g + 1] = hi(t[4 * g + 0], t[4 * g + 2]);
      r[4 * g + 2] = lo(t[4 * g + 1], t[4 * g + 3]);
      r[4 * g + 3] = hi(t[4 * g + 1], t[4 * g + 3]);
    }
    // gather lane l of the four row groups into output row 4l + k
    IMGTRAIN_ATTN_UNROLL for (int k = 0; k < 4; ++k) {
      const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
      const __m512 b = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
      const __m512 c = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
      const __m512 d = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
      t[k] = _mm512_shuffle_f32x4(a, c, 0x88);
      t[8 + k] = _mm512_shuffle_f32x4(a, c, 0xdd);
      t[4 + k] = _mm512_shuffle_f32x4(b, d, 0x88);
      t[12 + k] = _mm512_shuffle_f32x4(b, d, 0xdd);
    }
    IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 16; ++i) r[i] = t[i];
  }
};
#include "ops/attention_kernels.inc"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
// AVX2's 16 registers of 8 floats: 6 x 2 accumulators, 2 key (or value) vectors, 1 broadcast.
struct V {
  using vec = __m256;
  static constexpr int W = 8;
  static constexpr int kKeyVecs = 2;
  static constexpr int kColVecs = 2;
  static IMGTRAIN_ATTN_AI vec zero() { return _mm256_setzero_ps(); }
  static IMGTRAIN_ATTN_AI vec set1(float x) { return _mm256_set1_ps(x); }
  static IMGTRAIN_ATTN_AI vec load(const float* p) { return _mm256_loadu_ps(p); }
  static IMGTRAIN_ATTN_AI void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
  static IMGTRAIN_ATTN_AI vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
  static IMGTRAIN_ATTN_AI vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
  static IMGTRAIN_ATTN_AI vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
  static IMGTRAIN_ATTN_AI float reduce_max(vec v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static IMGTRAIN_ATTN_AI float reduce_add(vec v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static IMGTRAIN_ATTN_AI vec first(vec v, int k, vec fill) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(k), lane));
    return _mm256_blendv_ps(fill, v, keep);
  }
  static IMGTRAIN_ATTN_AI vec fnmadd(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
  static IMGTRAIN_ATTN_AI vec round(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y * 2^n with 2^n built in the exponent field (n >= -126 after exp's clamp, a normal number):
  // exact, as AVX-512's scalef, so both copies give the same bits.
  static IMGTRAIN_ATTN_AI vec times_pow2(vec y, vec n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  }
  // The 8 x 8 floats in r[0..8) transposed in registers.
  static IMGTRAIN_ATTN_AI void transpose(vec r[8]) {
    __m256 t[8], u[8];
    IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // a0 b0 a1 b1 | a4 b4 a5 b5
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // a2 b2 a3 b3 | a6 b6 a7 b7
    }
    IMGTRAIN_ATTN_UNROLL for (int g = 0; g < 2; ++g) {  // rows 4g..4g+3, columns k and k + 4
      u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0x44);
      u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g + 0], t[4 * g + 2], 0xee);
      u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
      u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xee);
    }
    IMGTRAIN_ATTN_UNROLL for (int k = 0; k < 4; ++k) {
      r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
      r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
  }
};
#include "ops/attention_kernels.inc"
#pragma GCC pop_options
}  // namespace avx2

namespace avx2_w16 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
// For the tests only: vectors of 16 floats as pairs of AVX2 registers, with AVX-512's blocking
// (6 x 4 blocks, panels of 64 keys in one block, 64 output columns a block), so a CPU without
// AVX-512 runs the shared kernels' code paths as the AVX-512 copy does. Slow (the blocks spill).
struct V {
  struct vec {
    __m256 lo, hi;
  };
  using H = avx2::V;
  static constexpr int W = 16;
  static constexpr int kKeyVecs = 4;
  static constexpr int kColVecs = 4;
  static IMGTRAIN_ATTN_AI vec zero() { return {H::zero(), H::zero()}; }
  static IMGTRAIN_ATTN_AI vec set1(float x) { return {H::set1(x), H::set1(x)}; }
  static IMGTRAIN_ATTN_AI vec load(const float* p) { return {H::load(p), H::load(p + 8)}; }
  static IMGTRAIN_ATTN_AI void store(float* p, vec v) {
    H::store(p, v.lo);
    H::store(p + 8, v.hi);
  }
  static IMGTRAIN_ATTN_AI vec fmadd(vec a, vec b, vec c) { return {H::fmadd(a.lo, b.lo, c.lo), H::fmadd(a.hi, b.hi, c.hi)}; }
  static IMGTRAIN_ATTN_AI vec mul(vec a, vec b) { return {H::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static IMGTRAIN_ATTN_AI vec sub(vec a, vec b) { return {H::sub(a.lo, b.lo), H::sub(a.hi, b.hi)}; }
  static IMGTRAIN_ATTN_AI vec add(vec a, vec b) { return {H::add(a.lo, b.lo), H::add(a.hi, b.hi)}; }
  static IMGTRAIN_ATTN_AI vec max(vec a, vec b) { return {H::max(a.lo, b.lo), H::max(a.hi, b.hi)}; }
  static IMGTRAIN_ATTN_AI float reduce_max(vec v) { return H::reduce_max(H::max(v.lo, v.hi)); }
  static IMGTRAIN_ATTN_AI float reduce_add(vec v) { return H::reduce_add(H::add(v.lo, v.hi)); }
  static IMGTRAIN_ATTN_AI vec first(vec v, int k, vec fill) { return {H::first(v.lo, k, fill.lo), H::first(v.hi, k - 8, fill.hi)}; }
  static IMGTRAIN_ATTN_AI vec fnmadd(vec a, vec b, vec c) { return {H::fnmadd(a.lo, b.lo, c.lo), H::fnmadd(a.hi, b.hi, c.hi)}; }
  static IMGTRAIN_ATTN_AI vec round(vec x) { return {H::round(x.lo), H::round(x.hi)}; }
  static IMGTRAIN_ATTN_AI vec times_pow2(vec y, vec n) { return {H::times_pow2(y.lo, n.lo), H::times_pow2(y.hi, n.hi)}; }
  static IMGTRAIN_ATTN_AI void transpose(vec r[16]) {
    alignas(64) float m[16][16];
    for (int i = 0; i < 16; ++i) store(m[i], r[i]);
    for (int i = 0; i < 16; ++i)
      for (int j = i + 1; j < 16; ++j) std::swap(m[i][j], m[j][i]);
    for (int i = 0; i < 16; ++i) r[i] = load(m[i]);
  }
};
#include "ops/attention_kernels.inc"
#pragma GCC pop_options
}  // namespace avx2_w16

#undef IMGTRAIN_ATTN_AI
#undef IMGTRAIN_ATTN_UNROLL

// The copies this CPU runs, fastest first.
const std::vector<Kernels>& runnable_kernels() {
  static const std::vector<Kernels> all = [] {
    std::vector<Kernels> k;
    const bool fma = __builtin_cpu_supports("fma");
    if (fma && __builtin_cpu_supports("avx512f"))
      k.push_back({"avx512", avx512::attend_head, avx512::attend_head_backward});
    if (fma && __builtin_cpu_supports("avx2")) {
      k.push_back({"avx2", avx2::attend_head, avx2::attend_head_backward});
      k.push_back({"avx2-w16", avx2_w16::attend_head, avx2_w16::attend_head_backward});
    }
    return k;
  }();
  return all;
}
#else
const std::vector<Kernels>& runnable_kernels() {
  static const std::vector<Kernels> none;
  return none;
}
#endif

// The copy in use: the CPU's fastest, or the one a test chose (use_attention_kernels).
std::atomic<const Kernels*> chosen{nullptr};
const Kernels* kernels() {
  const Kernels* k = chosen.load(std::memory_order_relaxed);
  if (k) return k;
  const auto& all = runnable_kernels();
  return all.empty() ? nullptr : &all.front();
}

// The shape, type and CPU conditions both entry points share.
bool attention_applies(const at::Tensor& qkv, int64_t heads) {
  return kernels() && qkv.defined() && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 &&
         qkv.is_contiguous() && heads > 0 && qkv.size(2) == 3 * heads * kHead && qkv.size(1) > 0 &&
         qkv.size(1) <= kMaxTokens;
}

// The forward over every image and head; lse [B, heads, N] when defined.
at::Tensor run_forward(const at::Tensor& qkv, int64_t heads, const at::Tensor& lse) {
  const int64_t b = qkv.size(0), n = qkv.size(1), c = heads * kHead, ld = 3 * c;
  auto out = at::empty({b, n, c}, qkv.options());
  const auto attend_head = kernels()->forward;
  const float* src = qkv.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  float* l = lse.defined() ? lse.mutable_data_ptr<float>() : nullptr;
  const float scale = 1.0f / std::sqrt(float(kHead));
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    AlignedVector<float> ws(size_t(scratch_size(n)));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t img = t / heads, h = t % heads;
      const float* base = src + img * n * ld + h * kHead;
      attend_head(base, base + c, base + 2 * c, ld, n, scale, dst + img * n * c + h * kHead, c,
                  l ? l + t * n : nullptr, ws.data());
    }
  });
  return out;
}

// Training: the output and, in backward, the gradient of qkv (its layout); saves qkv, the output
// (proj's input, saved by proj anyway) and the log-sum-exp per row, as ATen's flash kernel does.
struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv, int64_t heads) {
    RECORD_FUNCTION("imgtrain::attention_forward", std::vector<c10::IValue>());
    auto lse = at::empty({qkv.size(0), heads, qkv.size(1)}, qkv.options());
    auto out = run_forward(qkv, heads, lse);
    ctx->save_for_backward({qkv, out, lse});
    ctx->saved_data["heads"] = heads;
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    RECORD_FUNCTION("imgtrain::attention_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    const auto &qkv = saved[0], &out = saved[1], &lse = saved[2];
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const auto go = grads[0].contiguous();
    auto dqkv = at::empty_like(qkv);
    const auto attend_head_backward = kernels()->backward;
    const int64_t b = qkv.size(0), n = qkv.size(1), c = heads * kHead, ld = 3 * c;
    const float *src = qkv.const_data_ptr<float>(), *o = out.const_data_ptr<float>();
    const float *g = go.const_data_ptr<float>(), *l = lse.const_data_ptr<float>();
    float* dst = dqkv.mutable_data_ptr<float>();
    const float scale = 1.0f / std::sqrt(float(kHead));
    at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
      AlignedVector<float> ws(size_t(scratch_size(n)));
      for (int64_t t = begin; t < end; ++t) {
        const int64_t img = t / heads, h = t % heads;
        const int64_t in_off = img * n * ld + h * kHead, out_off = img * n * c + h * kHead;
        const float* base = src + in_off;
        float* d = dst + in_off;
        attend_head_backward(base, base + c, base + 2 * c, ld, o + out_off, g + out_off, c, l + t * n, n, scale, d,
                             d + c, d + 2 * c, ws.data());
      }
    });
    return {dqkv, at::Tensor()};
  }
};
}  // namespace

bool attention_infer_supported(const at::Tensor& qkv, int64_t heads) {
  if (c10::GradMode::is_enabled() && qkv.defined() && qkv.requires_grad()) return false;
  return attention_applies(qkv, heads);
}

at::Tensor attention_infer(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(attention_infer_supported(qkv, heads), "attention_infer: unsupported input");
  RECORD_FUNCTION("imgtrain::attention_infer", std::vector<c10::IValue>());  // a row in --profile
  return run_forward(qkv, heads, at::Tensor());
}

bool attention_train_supported(const at::Tensor& qkv, int64_t heads) { return attention_applies(qkv, heads); }

at::Tensor attention_train(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(attention_train_supported(qkv, heads), "attention_train: unsupported input");
  return AttentionFunction::apply(qkv, heads);
}

std::vector<std::string> attention_kernel_variants() {
  std::vector<std::string> names;
  for (const auto& k : runnable_kernels()) names.emplace_back(k.name);
  return names;
}

std::string attention_kernel_variant() { return kernels() ? kernels()->name : ""; }

void use_attention_kernels(const std::string& variant) {
  if (variant.empty()) {
    chosen.store(nullptr);
    return;
  }
  for (const auto& k : runnable_kernels())
    if (variant == k.name) {
      chosen.store(&k);
      return;
    }
  TORCH_CHECK(false, "use_attention_kernels: no variant '", variant, "' on this CPU");
}

}  // namespace imgtrain::ops
