#include "ops/attention.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>

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

// exp(x) for x <= 0 (a score less its row's maximum) within ~1 ulp: Cephes' expf (kernel_util.h,
// as norm_act.cpp's exp_approx) on 16 lanes, with AVX-512's own rounding (roundscale) and power of
// two (scalef) and the reduction in FMAs: 14 instructions where the integer-exponent form took 21.
// The clamp keeps a NaN (max returns its second operand for one), so a NaN score gives a NaN row
// as ATen's kernel does.
IMGTRAIN_ATTN_AI __m512 exp16(__m512 x) {
  namespace ce = cephes_expf;
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 fn = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(ce::log2e)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(ce::ln2_hi), x);
  r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(ce::ln2_lo), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(ce::p0);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ce::p1));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ce::p2));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ce::p3));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ce::p4));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(ce::p5));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, fn);
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

// o[r][0..64) (row stride ldo) += sum over j < nj of p(r, j) v[j][0..64) for R rows, p(r, j) =
// p[r * ldp + j], or p[j * ldp + r] where Trans (the rows of a transposed matrix: P^T dO, dS^T Q),
// v rows of 64 with stride ldv: from zero where First, each row times mul[r] where Last.
template <int R, bool Trans, bool First, bool Last>
IMGTRAIN_ATTN_AI void values_block(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t nj, float* o,
                                   int64_t ldo, const float* mul) {
  __m512 acc[R][4];
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c)
    acc[r][c] = First ? _mm512_setzero_ps() : _mm512_loadu_ps(o + r * ldo + 16 * c);
  for (int64_t j = 0; j < nj; ++j) {
    __m512 b[4];
    IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c) b[c] = _mm512_loadu_ps(v + j * ldv + 16 * c);
    IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(Trans ? p[j * ldp + r] : p[r * ldp + j]);
      IMGTRAIN_ATTN_UNROLL for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  IMGTRAIN_ATTN_UNROLL for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_set1_ps(Last ? mul[r] : 1.0f);
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

int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }
// The valid lanes of the last vector of a row of n values (all 16 when n is a multiple of 16).
__mmask16 tail_mask(int64_t n) { return n % 16 ? __mmask16((1u << (n % 16)) - 1) : __mmask16(0xffff); }

// dst[j] = src[j * ld ...] for n rows of 64: strided rows made contiguous for the value products.
void copy_rows(const float* src, int64_t ld, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; ++j)
    IMGTRAIN_ATTN_UNROLL for (int64_t d = 0; d < kHead; d += 16)
      _mm512_storeu_ps(dst + j * kHead + d, _mm512_loadu_ps(src + j * ld + d));
}

// Rows src[0..n) of 64 (stride ld) times `scale`, transposed into panels of 64 columns (the last
// ones 16) of kHead rows each: dst[p0 * kHead + d * w + (j - p0)] = scale * src[j][d] for j in the
// panel [p0, p0 + w), zero for n <= j < padded(n). A panel of 64 is 16 KB, which stays in L1 while
// every row of the other operand meets it.
void transpose_panels(const float* src, int64_t ld, int64_t n, float scale, float* dst) {
  const int64_t np = padded(n);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < np; j0 += 16) {
    const bool wide = j0 / 64 * 64 + 64 <= np;  // inside a panel of 64 keys, else one of 16
    const int64_t p0 = wide ? j0 / 64 * 64 : j0, w = wide ? 64 : 16;
    float* out = dst + p0 * kHead + (j0 - p0);
    const int64_t rows = std::min<int64_t>(16, n - j0);
    IMGTRAIN_ATTN_UNROLL for (int64_t dc = 0; dc < kHead; dc += 16) {
      __m512 r[16];
      IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 16; ++i)
        r[i] = i < rows ? _mm512_mul_ps(_mm512_loadu_ps(src + (j0 + i) * ld + dc), vscale) : _mm512_setzero_ps();
      transpose16(r);
      IMGTRAIN_ATTN_UNROLL for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + (dc + i) * w, r[i]);
    }
  }
}

// s[i][0..np) = a[i] . bt panels (a: n rows of 64, stride lda; bt from transpose_panels) for i < n;
// rmax[i] = the row's largest of its first n values.
void scores(const float* a, int64_t lda, const float* bt, int64_t n, float* s, float* rmax) {
  const int64_t np = padded(n);
  std::fill(rmax, rmax + n, -INFINITY);
  int64_t j0 = 0;
  for (; j0 + 64 <= np; j0 += 64)
    row_blocks(n, [&](auto R, int64_t i) {
      scores_block<R(), 4, false>(a + i * lda, lda, bt + j0 * kHead, s + i * np + j0, np, rmax + i, 0);
    });
  const __mmask16 tail = tail_mask(n);
  for (; j0 < np; j0 += 16) {
    const __mmask16 valid = j0 + 16 >= np ? tail : __mmask16(0xffff);
    row_blocks(n, [&](auto R, int64_t i) {
      scores_block<R(), 1, true>(a + i * lda, lda, bt + j0 * kHead, s + i * np + j0, np, rmax + i, valid);
    });
  }
}

// out[r] (rows of 64, stride ldo) = mul[r] * sum over j < n of p(r, j) v[j] for r < n (values_block;
// p row stride ldp), the sum over j in chunks of kVChunk rows of v (16 KB, in L1).
template <bool Trans>
void products(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, float* out, int64_t ldo,
              const float* mul) {
  for (int64_t jc = 0; jc < n; jc += kVChunk) {
    const int64_t nj = std::min(kVChunk, n - jc);
    const float* pc = p + (Trans ? jc * ldp : jc);
    const float* vc = v + jc * ldv;
    const bool first = jc == 0, last = jc + kVChunk >= n;
    row_blocks(n, [&](auto R, int64_t i) {
      constexpr int Rn = R();
      float* o = out + i * ldo;
      const float* pi = pc + (Trans ? i : i * ldp);
      if (first && last) values_block<Rn, Trans, true, true>(pi, ldp, vc, ldv, nj, o, ldo, mul + i);
      else if (first) values_block<Rn, Trans, true, false>(pi, ldp, vc, ldv, nj, o, ldo, mul + i);
      else if (last) values_block<Rn, Trans, false, true>(pi, ldp, vc, ldv, nj, o, ldo, mul + i);
      else values_block<Rn, Trans, false, false>(pi, ldp, vc, ldv, nj, o, ldo, mul + i);
    });
  }
}

// Scratch floats for one head of n tokens (forward and backward). A thread holds them in an
// AlignedVector (64-byte boundary): every buffer in it starts at a multiple of 16 floats and its
// rows are multiples of 16 floats, so the kernels' vector loads never straddle two cache lines.
int64_t scratch_size(int64_t n) {
  const int64_t np = padded(n);
  return 2 * kHead * np + 2 * n * np + n * kHead + 3 * n;
}

// The scores s [n, padded(n)] in place to exp(s - rmax) with the tail lanes zero; inv[r] = 1 / the
// row's sum, lse[r] (if not null) its log-sum-exp.
void softmax_rows(float* s, int64_t n, const float* rmax, float* inv, float* lse) {
  const int64_t np = padded(n);
  const int64_t nfull = n - n % 16;
  const __mmask16 tail = tail_mask(n);
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
    const float total = _mm512_reduce_add_ps(sum);
    inv[r] = 1.0f / total;
    if (lse) lse[r] = rmax[r] + std::log(total);
  }
}

// One image and head: q, k, v rows of 64 with row stride ld, n tokens; out rows of 64 with stride
// ldo; lse (if not null) the row's log-sum-exp of the scaled scores, for the backward. The keys
// scaled and transposed into panels; the scores [n, np] (np: n to a multiple of 16) with their row
// maxima taken as they are stored; exp in place and the row sums; then the values (copied to rows
// of 64) against every row of probabilities, the division by the row sum at the end.
void attend_head(const float* q, const float* k, const float* v, int64_t ld, int64_t n, float scale, float* out,
                 int64_t ldo, float* lse, float* ws) {
  const int64_t np = padded(n);
  float *kt = ws, *s = kt + kHead * np, *vb = s + n * np, *rmax = vb + n * kHead, *inv = rmax + n;
  transpose_panels(k, ld, n, scale, kt);
  copy_rows(v, ld, n, vb);
  scores(q, ld, kt, n, s, rmax);
  softmax_rows(s, n, rmax, inv, lse);
  products<false>(s, np, vb, kHead, n, out, ldo, inv);
}

// Backward's elementwise pass: the scores in p [n, padded(n)] to the probabilities
// P = exp(p - lse) in place, dP in ds to dS = P (dP - rowsum(dO * O)) in place, the tail lanes zero.
void probability_grads(float* p, float* ds, int64_t n, const float* o, const float* go, int64_t ldo,
                       const float* lse) {
  const int64_t np = padded(n);
  const int64_t nfull = n - n % 16;
  const __mmask16 tail = tail_mask(n);
  for (int64_t r = 0; r < n; ++r) {
    __m512 dot = _mm512_setzero_ps();
    IMGTRAIN_ATTN_UNROLL for (int64_t d = 0; d < kHead; d += 16)
      dot = _mm512_fmadd_ps(_mm512_loadu_ps(go + r * ldo + d), _mm512_loadu_ps(o + r * ldo + d), dot);
    const __m512 dl = _mm512_set1_ps(_mm512_reduce_add_ps(dot)), l = _mm512_set1_ps(lse[r]);
    float *pr = p + r * np, *dr = ds + r * np;
    auto step = [&](int64_t j, __mmask16 keep) {
      const __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + j), l)));
      _mm512_storeu_ps(pr + j, e);
      _mm512_storeu_ps(dr + j, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_loadu_ps(dr + j), dl)));
    };
    for (int64_t j = 0; j < nfull; j += 16) step(j, __mmask16(0xffff));
    if (n % 16) step(nfull, tail);
  }
}

// The gradients of one head (flash attention's backward, the probabilities recomputed from lse):
// P = exp(scale q k^T - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
// dQ = scale dS K, dK = scale dS^T Q. q, k, v and dq, dk, dv rows of 64 with stride ld; o and go
// (the output and its gradient) with stride ldo.
void attend_head_backward(const float* q, const float* k, const float* v, int64_t ld, const float* o,
                          const float* go, int64_t ldo, const float* lse, int64_t n, float scale, float* dq,
                          float* dk, float* dv, float* ws) {
  const int64_t np = padded(n);
  float *kt = ws, *vt = kt + kHead * np, *p = vt + kHead * np, *ds = p + n * np, *kb = ds + n * np;
  float *rmax = kb + n * kHead, *ones = rmax + n, *scales = ones + n;  // rmax: scores() fills it, unused
  transpose_panels(k, ld, n, scale, kt);
  transpose_panels(v, ld, n, 1.0f, vt);
  copy_rows(k, ld, n, kb);
  scores(q, ld, kt, n, p, rmax);   // scale q k^T
  scores(go, ldo, vt, n, ds, rmax);  // dO V^T
  probability_grads(p, ds, n, o, go, ldo, lse);
  std::fill(ones, ones + n, 1.0f);
  std::fill(scales, scales + n, scale);
  products<true>(p, np, go, ldo, n, dv, ld, ones);        // dV = P^T dO
  products<false>(ds, np, kb, kHead, n, dq, ld, scales);  // dQ = scale dS K
  products<true>(ds, np, q, ld, n, dk, ld, scales);       // dK = scale dS^T Q
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

namespace {
// The shape, type and CPU conditions both entry points share.
bool attention_applies(const at::Tensor& qkv, int64_t heads) {
#ifdef IMGTRAIN_ATTENTION_AVX512
  if (!cpu_has_avx512()) return false;
  return qkv.defined() && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 3 &&
         qkv.is_contiguous() && heads > 0 && qkv.size(2) == 3 * heads * kHead && qkv.size(1) > 0 &&
         qkv.size(1) <= kMaxTokens;
#else
  (void)qkv;
  (void)heads;
  return false;
#endif
}

// The forward over every image and head; lse [B, heads, N] when defined.
at::Tensor run_forward(const at::Tensor& qkv, int64_t heads, const at::Tensor& lse) {
  const int64_t b = qkv.size(0), n = qkv.size(1), c = heads * kHead, ld = 3 * c;
  auto out = at::empty({b, n, c}, qkv.options());
#ifdef IMGTRAIN_ATTENTION_AVX512
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
#endif
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
#ifdef IMGTRAIN_ATTENTION_AVX512
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
#endif
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

}  // namespace imgtrain::ops
