// What imgtrain's own CPU kernels (norm_act, se_gate, optim_step, attention, mlp) and benches share:
// the SIMD clones of their hot loops, 64-byte-aligned scratch, Cephes' expf, ATen's erf and GELU
// and, in CUDA builds, the check of a device launch's result.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

// The loops are plain C++ that the compiler vectorises; on x86-64 GCC builds each hot function
// also gets AVX-512 and AVX2+FMA clones picked at load time (the baseline build is SSE2 only).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define IMGTRAIN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define IMGTRAIN_CLONES
#endif
#define IMGTRAIN_AI inline __attribute__((always_inline))

namespace imgtrain::ops {
// Scratch whose vector loads never straddle two cache lines: a std::vector on 64-byte boundaries
// (std::vector's own memory is 16-byte aligned, which split every 64-byte load of the attention
// kernels' panels across two lines: 177 against 196 GFLOP/s for the score block on one core).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;
}  // namespace imgtrain::ops

namespace imgtrain::ops::cephes_expf {
// Cephes' expf: exp(x) = 2^n exp(r), n = round(x log2(e)), r = x - n ln(2) with ln(2) in two parts
// (ln2_hi exact in few bits), exp(r) = 1 + r + r^2 p(r), p of degree 5; ~1 ulp over [-87, 88].
// norm_act.cpp's scalar exp_approx and attention_kernels.inc's vector exp_approx both evaluate it.
constexpr float log2e = 1.44269504088896341f;
constexpr float ln2_hi = 0.693359375f;
constexpr float ln2_lo = -2.12194440e-4f;  // ln(2) = ln2_hi + ln2_lo
constexpr float p0 = 1.9875691500e-4f, p1 = 1.3981999507e-3f, p2 = 8.3334519073e-3f, p3 = 4.1665795894e-2f,
                p4 = 1.6666665459e-1f, p5 = 5.0000001201e-1f;
}  // namespace imgtrain::ops::cephes_expf

namespace imgtrain::ops {
// exp(x) within ~1 ulp for x in [-87, 88] (clamped there), Cephes' expf: n = floor(x log2 e + 1/2)
// by truncation of a positive number, x - n ln 2 in two parts, a degree-6 polynomial, 2^n through
// the exponent bits. No branches and no library call, so loops over it vectorise.
IMGTRAIN_AI float exp_approx(float x) {
  namespace ce = cephes_expf;
  x = std::min(std::max(x, -87.0f), 88.0f);
  const int32_t n = int32_t(x * ce::log2e + 0.5f + 128.0f) - 128;
  const float fn = float(n);
  float r = x - fn * ce::ln2_hi;
  r = r - fn * ce::ln2_lo;
  const float z = r * r;
  float y = ce::p0;
  y = y * r + ce::p1;
  y = y * r + ce::p2;
  y = y * r + ce::p3;
  y = y * r + ce::p4;
  y = y * r + ce::p5;
  y = y * z + r + 1.0f;
  return y * std::bit_cast<float>((n + 127) << 23);
}

// erf(x) as ATen's float CPU kernels evaluate it (Vectorized<float>::erf: Abramowitz and Stegun
// 7.1.26, |error| < 1.5e-7, the same constants and order of operations), with exp_approx for
// Sleef's exp: 1 - t r(t) exp(-x^2) with t = 1 / (1 + p |x|), signed as x. Also returns exp(-x^2),
// which at x = v / sqrt 2 is the exponent of GELU's derivative's normal density.
struct ErfParts {
  float erf, e;
};
IMGTRAIN_AI ErfParts erf_parts(float x) {
  const float t = 1.0f / (0.3275911f * std::fabs(x) + 1.0f);
  float r = 1.061405429f * t + -1.453152027f;
  r = r * t + 1.421413741f;
  r = r * t + -0.284496736f;
  r = r * t + 0.254829592f;
  const float e = exp_approx(-(x * x));
  return {std::copysign(1.0f - r * t * e, x), e};
}

// GELU as ATen's: v / 2 (1 + erf(v / sqrt 2)); its derivative cdf + v pdf, pdf = exp(-v^2 / 2) / sqrt(2 pi)
constexpr float kAlpha = float(M_SQRT1_2), kBeta = float(M_2_SQRTPI * M_SQRT1_2 * 0.5);
IMGTRAIN_AI float gelu_of(float v, float erf) { return v * 0.5f * (1.0f + erf); }
}  // namespace imgtrain::ops

#ifdef IMGTRAIN_WITH_CUDA
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace imgtrain::ops {
// err: the cudaError_t a .cu launcher returned; throws with `what` and CUDA's message.
inline void check_cuda(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string(what) + ": CUDA error " + cudaGetErrorString(cudaError_t(err)));
}
}  // namespace imgtrain::ops
#endif
