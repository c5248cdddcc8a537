#include "ops/attention.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

// The kernels are AVX-512 intrinsics in functions compiled for that target (the rest of the build
// is baseline x86-64); attention_infer_supported asks the CPU before they run. Other compilers and
// CPUs keep ATen's scaled_dot_product_attention.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_ATTENTION_AVX512 1
#include <immintrin.h>
#endif

namespace imgtrain::ops {
namespace {

constexpr int64_t kHead = 64;   // head size the kernels are written for
constexpr int kRows = 6;        // query rows per register block: 6 x 4 accumulators of 16 floats
constexpr int64_t kVChunk = 64;  // value rows per pass of the second product (16 KB, in L1)
// Longest sequence it takes: it holds a head's whole score matrix (4 MB at 1024 tokens), where ATen's
// flash kernel blocks the keys; measured on 48 heads at two threads, this kernel against ATen's:
// 197 tokens 2.25 / 2.96 ms, 577 tokens 18.3 / 21.2, 1025 tokens 63.4 / 63.8, 2048 tokens 256 / 237.
constexpr int64_t kMaxTokens = 1024;

#ifdef IMGTRAIN_ATTENTION_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#define IMGTRAIN_ATTN_UNROLL _Pragma("GCC unroll 8")
#define IMGTRAIN_ATTN_AI inline __attribute__((always_inline))

// exp(x) for x <= 0 (a score less its row's maximum) within ~1 ulp: Cephes' expf as norm_act.cpp's
// exp_approx, on 16 lanes. The clamp keeps a NaN (max returns its second operand for one), so a
// NaN score gives a NaN row as ATen's kernel does.
IMGTRAIN_ATTN_AI __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512i n = _mm512_sub_epi32(
      _mm512_cvttps_epi32(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _mm512_set1_ps(128.5f))),
      _mm512_set1_epi32(128));
  const __m512 fn = _mm512_cvtepi32_ps(n);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(fn, _mm512_set1_ps(0.693359375f)));
  r = _mm512_add_ps(r, _mm512_mul_ps(fn, _mm512_set1_ps(2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23)));
}

// Transposes the 16 x 16 floats in r[0..16) (r[i] = row i) in registers.
IMGTRAIN_ATTN_AI void transpose16(__m512 r[16]) {
  __m512 t[16];
  IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
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

// Scores of R query rows (q, row stride ldq) against a panel of 16*C keys stored transposed (kt:
// kHead rows of 16*C floats): s[r][0..16C) (row stride lds); rmax[r] takes the maximum of the row's
// first `valid` lanes of the last vector (all of them where Tail is false).
template <int R, int C, bool Tail>
IMGTRAIN_ATTN_AI void scores_block(const float* q, int64_t ldq, const float* kt, float* s, int64_t lds, float* rmax,
                              __mmask16 valid) {
  __m512 acc[R][C];
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) IMGTRAIN_ATTN_UNROLL for (int c = 0; c < C; ++c)
    acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < kHead; ++d) {
    __m512 b[C];
    IMGTRAIN_ATTN_UNROLL for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(kt + d * 16 * C + 16 * c);
    IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * ldq + d]);
      IMGTRAIN_ATTN_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
    __m512 m = Tail ? _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), acc[r][C - 1]) : acc[r][0];
    IMGTRAIN_ATTN_UNROLL for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(s + r * lds + 16 * c, acc[r][c]);
      if (!Tail) m = _mm512_max_ps(m, acc[r][c]);
    }
    rmax[r] = std::max(rmax[r], _mm512_reduce_max_ps(m));
  }
}

// o[r][0..64) (row stride ldo) += p[r][0..nj) v[0..nj)[0..64) for R rows (p row stride ldp, v rows
// of 64): from zero where First, times inv[r] where Last.
template <int R, bool First, bool Last>
IMGTRAIN_ATTN_AI void values_block(const float* p, int64_t ldp, const float* v, int64_t nj, float* o, int64_t ldo,
                              const float* inv) {
  __m512 acc[R][4];
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c)
    acc[r][c] = First ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * c);
  for (int64_t j = 0; j < nj; ++j) {
    __m512 b[4];
    IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c) b[c] = _mm512_loadu_ps(v + j * kHead + 16 * c);
    IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(p[r * ldp + j]);
      IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_set1_ps(Last ? inv[r] : 1.0f);
    IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(o + r * ldo + 16 * c, Last ? _mm512_mul_ps(acc[r][c], sc) : acc[r][c]);
  }
}

// f(rows as an integral constant, first row) over n rows in blocks of kRows and the remainder
template <typename F>
IMGTRAIN_ATTN_AI void row_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + kRows <= n; i += kRows) f(std::integral_constant<int, kRows>{}, i);
  switch (n - i) {
    case 1: f(std::integral_constant<int, 1>{}, i); break;
    case 2: f(std::integral_constant<int, 2>{}, i); break;
    case 3: f(std::integral_constant<int, 3>{}, i); break;
    case 4: f(std::integral_constant<int, 4>{}, i); break;
    case 5: f(std::integral_constant<int, 5>{}, i); break;
    default: break;
  }
}

// Scratch floats for one head of n tokens.
int64_t scratch_size(int64_t n) {
  const int64_t np = (n + 15) / 16 * 16;
  return kHead * np + n * np + n * kHead + 2 * n;
}

// One image and head: q, k, v rows of 64 with row stride ld, n tokens; out rows of 64 with stride
// ldo. Keys scaled and transposed into panels of 64 columns (the last ones 16), kHead x 64 floats
// each (16 KB: one panel stays in L1 while every query row meets it); the scores [n, np] (np: n to
// a multiple of 16), their row maxima taken as they are stored; exp in place and the row sums; then
// the values (copied to rows of 64) in chunks of kVChunk rows against every row of probabilities,
// the division by the row sum on the last chunk.
void attend_head(const float* q, const float* k, const float* v, int64_t ld, int64_t n, float scale, float* out,
                 int64_t ldo, float* ws) {
  const int64_t np = (n + 15) / 16 * 16;
  float *kt = ws, *s = kt + kHead * np, *vb = s + n * np, *rmax = vb + n * kHead, *inv = rmax + n;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const bool wide = j0 / 64 * 64 + 64 <= np;  // inside a panel of 64 keys, else one of 16
    const int64_t p0 = wide ? j0 / 64 * 64 : j0, w = wide ? 64 : 16;
    float* dst = kt + p0 * kHead + (j0 - p0);
    const int64_t rows = std::min<int64_t>(16, n - j0);
    IMGTRAIN_ATTN_UNROLL for (int64_t dc = 0; dc < kHead; dc += 16) {
      __m512 r[16];
      IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_mul_ps(_mm512_loadu_ps(k + (j0 + i) * ld + dc), vscale) : _mm512_setzero_ps();
      transpose16(r);
      IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (dc + i) * w, r[i]);
    }
  }
  for (int64_t j = 0; j < n; ++j)
    IMGTRAIN_ATTN_UNROLL for (int64_t d = 0; d < kHead; d += 16)
      _mm512_storeu_ps(vb + j * kHead + d, _mm512_loadu_ps(v + j * ld + d));
  std::fill(rmax, rmax + n, -INFINITY);
  int64_t j0 = 0;
  for (; j0 + 64 <= np; j0 += 64)
    row_blocks(n, [&](auto R, int64_t i) {
      scores_block<R(), 4, false>(q + i * ld, ld, kt + j0 * kHead, s + i * np + j0, np, rmax + i, 0);
    });
  const __mmask16 tail = n % 16 ? __mmask16((1u << (n % 16)) - 1) : __mmask16(0xffff);
  for (; j0 < np; j0 += 16) {
    const __mmask16 valid = j0 + 16 >= np ? tail : __mmask16(0xffff);
    row_blocks(n, [&](auto R, int64_t i) {
      scores_block<R(), 1, true>(q + i * ld, ld, kt + j0 * kHead, s + i * np + j0, np, rmax + i, valid);
    });
  }
  const int64_t nfull = n - n % 16;
  for (int64_t r = 0; r < n; ++r) {
    float* row = s + r * np;
    const __m512 m = _mm512_set1_ps(rmax[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < nfull; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), m));
      _mm512_storeu_ps(row + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (n % 16) {
      const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + nfull), m)));
      _mm512_storeu_ps(row + nfull, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t jc = 0; jc < n; jc += kVChunk) {
    const int64_t nj = std::min(kVChunk, n - jc);
    const float* p = s + jc;
    const float* vc = vb + jc * kHead;
    const bool first = jc == 0, last = jc + kVChunk >= n;
    row_blocks(n, [&](auto R, int64_t i) {
      constexpr int Rn = R();
      float* o = out + i * ldo;
      const float* pi = p + i * np;
      if (first && last) values_block<Rn, true, true>(pi, np, vc, nj, o, ldo, inv + i);
      else if (first) values_block<Rn, true, false>(pi, np, vc, nj, o, ldo, inv + i);
      else if (last) values_block<Rn, false, true>(pi, np, vc, nj, o, ldo, inv + i);
      else values_block<Rn, false, false>(pi, np, vc, nj, o, ldo, inv + i);
    });
  }
}
#undef IMGTRAIN_ATTN_AI
#undef IMGTRAIN_ATTN_UNROLL
#pragma GCC pop_options

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

}  // namespace

bool attention_infer_supported(const at::Tensor& qkv, int64_t heads) {
#ifdef IMGTRAIN_ATTENTION_AVX512
  if (!cpu_has_avx512()) return false;
  if (c10::GradMode::is_enabled() && qkv.requires_grad()) return false;
  return qkv.defined() && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 &&
         qkv.is_contiguous() && heads > 0 && qkv.size(2) == 3 * heads * kHead && qkv.size(1) > 0 &&
         qkv.size(1) <= kMaxTokens;
#else
  (void)qkv;
  (void)heads;
  return false;
#endif
}

at::Tensor attention_infer(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(attention_infer_supported(qkv, heads), "attention_infer: unsupported input");
  const int64_t b = qkv.size(0), n = qkv.size(1), c = heads * kHead, ld = 3 * c;
  auto out = at::empty({b, n, c}, qkv.options());
  RECORD_FUNCTION("imgtrain::attention_infer", std::vector<c10::IValue>());  // a row in --profile
#ifdef IMGTRAIN_ATTENTION_AVX512
  const float* src = qkv.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  const float scale = 1.0f / std::sqrt(float(kHead));
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> ws(size_t(scratch_size(n)));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t img = t / heads, h = t % heads;
      const float* base = src + img * n * ld + h * kHead;
      attend_head(base, base + c, base + 2 * c, ld, n, scale, dst + img * n * c + h * kHead, c, ws.data());
    }
  });
#endif
  return out;
}

}  // namespace imgtrain::ops
