#include "ops/norm_act.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

#ifdef IMGTRAIN_WITH_CUDA
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace imgtrain::ops::cuda {  // norm_act_cuda.cu; each returns the cudaError_t of its launches
int64_t norm_act_chunk(int64_t M);
template <typename T>
int bn_stats(const T* x, int64_t N, int64_t C, int64_t HW, bool cl, double momentum, double eps, T* mean, T* invstd,
             T* rm, T* rv, double* pa, double* pb, cudaStream_t stream);
template <typename T>
int bn_act_forward(const T* x, const T* r, T* out, int64_t N, int64_t C, int64_t HW, bool cl, const T* scale,
                   const T* shift, const T* mean, int act, cudaStream_t stream);
template <typename T>
int bn_act_backward(const T* g, const T* x, const T* r, T* gy, T* gx, int64_t N, int64_t C, int64_t HW, bool cl,
                    const T* scale, const T* shift, const T* mean, const T* invstd, int act, T* b, T* d, T* gw,
                    T* gb, double* pa, double* pb, cudaStream_t stream);
}  // namespace imgtrain::ops::cuda
#endif

namespace imgtrain::ops {
namespace {

// The loops below are plain C++ that the compiler vectorises, with SIMD clones (kernel_util.h).

constexpr int64_t kRowBlock = 64;      // channels-last statistics: rows per float partial sum
constexpr int64_t kPlaneChunk = 1024;  // NCHW statistics: elements per float partial sum
constexpr int kLanes = 16;             // independent float accumulators along a plane

// exp in the element type: the approximation for float, the library's for double (the double
// path exists to check the fused layers against torch's modules with float64 exactness)
IMGTRAIN_AI float exp_t(float x) { return exp_approx(x); }
IMGTRAIN_AI double exp_t(double x) { return std::exp(x); }

template <NormAct A, typename T>
IMGTRAIN_AI T act_fwd(T v) {
  if constexpr (A == NormAct::None) return v;
  if constexpr (A == NormAct::ReLU) return std::max(v, T(0));
  if constexpr (A == NormAct::ReLU6) return std::min(std::max(v, T(0)), T(6));
  if constexpr (A == NormAct::SiLU) return v / (T(1) + exp_t(-v));
  if constexpr (A == NormAct::HardSwish) return v * std::min(std::max(v + T(3), T(0)), T(6)) / T(6);
}

// d act / d v at the pre-activation v, as torch's backward formulas: ReLU's mask is v > 0, ReLU6
// (hardtanh) passes 0 < v < 6, hard-swish is v / 3 + 1/2 on [-3, 3].
template <NormAct A, typename T>
IMGTRAIN_AI T act_grad(T v) {
  if constexpr (A == NormAct::None) return T(1);
  if constexpr (A == NormAct::ReLU) return v > T(0) ? T(1) : T(0);
  if constexpr (A == NormAct::ReLU6) return (v > T(0) && v < T(6)) ? T(1) : T(0);
  if constexpr (A == NormAct::SiLU) {
    const T s = T(1) / (T(1) + exp_t(-v));
    return s * (T(1) + v * (T(1) - s));
  }
  if constexpr (A == NormAct::HardSwish) return v < T(-3) ? T(0) : (v <= T(3) ? v / T(3) + T(0.5) : T(1));
}

// ---- channels-last: `rows` rows of C contiguous channels ----

template <typename T>
IMGTRAIN_AI void cl_stats_t(const T* x, const T* k, int64_t rows, int64_t C, T* __restrict__ s, T* __restrict__ q) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * C;
    for (int64_t c = 0; c < C; ++c) {
      const T d = xr[c] - k[c];
      s[c] += d;
      q[c] += d * d;
    }
  }
}

template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cl_fwd_t(const T* x, const T* r, T* __restrict__ out, int64_t rows, int64_t C, const T* scale,
                          const T* shift, const T* mean) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * C;
    T* o = out + i * C;
    const T* rr = R ? r + i * C : nullptr;
    for (int64_t c = 0; c < C; ++c) {
      T v = (xr[c] - mean[c]) * scale[c] + shift[c];
      if constexpr (R) v += rr[c];
      o[c] = act_fwd<A>(v);
    }
  }
}

// gy = g * act'(pre) with pre = (x - mean) * scale + shift (+ r); sums of gy and gy * (x - mean) per channel;
// gy stored when `gy_out` is given (the residual's gradient).
template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cl_bwd1_t(const T* g, const T* x, const T* r, T* __restrict__ gy_out, int64_t rows, int64_t C,
                           const T* scale, const T* shift, const T* mean, T* __restrict__ sg, T* __restrict__ sgx) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* gr = g + i * C;
    const T* xr = x + i * C;
    const T* rr = R ? r + i * C : nullptr;
    T* gyr = R ? gy_out + i * C : nullptr;
    for (int64_t c = 0; c < C; ++c) {
      T gy = gr[c];
      if constexpr (A != NormAct::None) {
        T v = (xr[c] - mean[c]) * scale[c] + shift[c];
        if constexpr (R) v += rr[c];
        gy *= act_grad<A>(v);
      }
      if constexpr (R) gyr[c] = gy;
      sg[c] += gy;
      sgx[c] += gy * (xr[c] - mean[c]);
    }
  }
}

// gx = (gy - b * (x - mean) - d) * a, gy read back (residual: stored by pass 1) or recomputed from g.
// ATen's order: gy minus its channel mean d before the scale a (a = the forward's scale).
template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cl_bwd2_t(const T* g, const T* x, const T* gy_in, T* __restrict__ gx, int64_t rows, int64_t C,
                           const T* scale, const T* shift, const T* mean, const T* a, const T* b,
                           const T* d) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * C;
    T* o = gx + i * C;
    if constexpr (R) {
      const T* gyr = gy_in + i * C;
      for (int64_t c = 0; c < C; ++c) o[c] = (gyr[c] - b[c] * (xr[c] - mean[c]) - d[c]) * a[c];
    } else {
      const T* gr = g + i * C;
      for (int64_t c = 0; c < C; ++c) {
        T gy = gr[c];
        if constexpr (A != NormAct::None) gy *= act_grad<A>((xr[c] - mean[c]) * scale[c] + shift[c]);
        o[c] = (gy - b[c] * (xr[c] - mean[c]) - d[c]) * a[c];
      }
    }
  }
}

// ---- NCHW: one plane of `n` contiguous values of one channel ----

template <typename T>
IMGTRAIN_AI void cf_stats_t(const T* p, int64_t n, T k, double& S, double& Q) {
  for (int64_t start = 0; start < n; start += kPlaneChunk) {
    const int64_t len = std::min(kPlaneChunk, n - start);
    const T* x = p + start;
    T s[kLanes] = {}, q[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const T d = x[i + l] - k;
        s[l] += d;
        q[l] += d * d;
      }
    for (; i < len; ++i) {
      const T d = x[i] - k;
      s[0] += d;
      q[0] += d * d;
    }
    T ss = 0, qq = 0;
    for (int l = 0; l < kLanes; ++l) ss += s[l], qq += q[l];
    S += ss;
    Q += qq;
  }
}

template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cf_fwd_t(const T* x, const T* r, T* __restrict__ out, int64_t n, T scale, T shift,
                          T mean) {
  for (int64_t i = 0; i < n; ++i) {
    T v = (x[i] - mean) * scale + shift;
    if constexpr (R) v += r[i];
    out[i] = act_fwd<A>(v);
  }
}

template <typename T, NormAct A, bool R>
IMGTRAIN_AI T cf_gy(const T* g, const T* x, const T* r, int64_t j, T scale, T shift,
                        T mean) {
  T gy = g[j];
  if constexpr (A != NormAct::None) {
    T v = (x[j] - mean) * scale + shift;
    if constexpr (R) v += r[j];
    gy *= act_grad<A>(v);
  }
  return gy;
}

template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cf_bwd1_t(const T* g, const T* x, const T* r, T* __restrict__ gy_out, int64_t n,
                           T scale, T shift, T mean, double& SG, double& SGX) {
  for (int64_t start = 0; start < n; start += kPlaneChunk) {
    const int64_t end = start + std::min(kPlaneChunk, n - start);
    T sg[kLanes] = {}, sgx[kLanes] = {};
    int64_t i = start;
    for (; i + kLanes <= end; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const T gy = cf_gy<T, A, R>(g, x, r, i + l, scale, shift, mean);
        if constexpr (R) gy_out[i + l] = gy;
        sg[l] += gy;
        sgx[l] += gy * (x[i + l] - mean);
      }
    for (; i < end; ++i) {
      const T gy = cf_gy<T, A, R>(g, x, r, i, scale, shift, mean);
      if constexpr (R) gy_out[i] = gy;
      sg[0] += gy;
      sgx[0] += gy * (x[i] - mean);
    }
    T a = 0, b = 0;
    for (int l = 0; l < kLanes; ++l) a += sg[l], b += sgx[l];
    SG += a;
    SGX += b;
  }
}

template <typename T, NormAct A, bool R>
IMGTRAIN_AI void cf_bwd2_t(const T* g, const T* x, const T* gy_in, T* __restrict__ gx, int64_t n, T scale,
                           T shift, T mean, T a, T b, T d) {
  for (int64_t i = 0; i < n; ++i) {
    T gy;
    if constexpr (R) {
      gy = gy_in[i];
    } else {
      gy = g[i];
      if constexpr (A != NormAct::None) gy *= act_grad<A>((x[i] - mean) * scale + shift);
    }
    gx[i] = (gy - b * (x[i] - mean) - d) * a;
  }
}

// One clone-dispatched entry per kernel, switching on the activation and the residual outside
// the loops.
#define IMGTRAIN_DISPATCH(act, res, CALL)                                         \
  switch (act) {                                                                 \
    case NormAct::None: res ? CALL(NormAct::None, true) : CALL(NormAct::None, false); break;           \
    case NormAct::ReLU: res ? CALL(NormAct::ReLU, true) : CALL(NormAct::ReLU, false); break;           \
    case NormAct::ReLU6: res ? CALL(NormAct::ReLU6, true) : CALL(NormAct::ReLU6, false); break;        \
    case NormAct::SiLU: res ? CALL(NormAct::SiLU, true) : CALL(NormAct::SiLU, false); break;           \
    case NormAct::HardSwish: res ? CALL(NormAct::HardSwish, true) : CALL(NormAct::HardSwish, false); break; \
  }

// The entries for one element type: float with the clones, double (the float64 check) without.
#define IMGTRAIN_ENTRIES(T, ATTR)                                                                                    \
  ATTR void cl_stats(const T* x, const T* k, int64_t rows, int64_t C, T* s, T* q) {                               \
    cl_stats_t<T>(x, k, rows, C, s, q);                                                                            \
  }                                                                                                                \
  ATTR void cf_stats(const T* p, int64_t n, T k, double& S, double& Q) { cf_stats_t<T>(p, n, k, S, Q); }           \
  ATTR void cl_fwd(NormAct act, const T* x, const T* r, T* out, int64_t rows, int64_t C, const T* scale,          \
                   const T* shift, const T* mean) {                                                                \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, r != nullptr, CL_FWD)                                                                   \
  }                                                                                                                \
  ATTR void cl_bwd1(NormAct act, const T* g, const T* x, const T* r, T* gy, int64_t rows, int64_t C,              \
                    const T* scale, const T* shift, const T* mean, T* sg, T* sgx) {                                \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, r != nullptr, CL_BWD1)                                                                  \
  }                                                                                                                \
  ATTR void cl_bwd2(NormAct act, bool res, const T* g, const T* x, const T* gy, T* gx, int64_t rows, int64_t C,   \
                    const T* scale, const T* shift, const T* mean, const T* a, const T* b, const T* d) {           \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, res, CL_BWD2)                                                                           \
  }                                                                                                                \
  ATTR void cf_fwd(NormAct act, const T* x, const T* r, T* out, int64_t n, T scale, T shift, T mean) {             \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, r != nullptr, CF_FWD)                                                                   \
  }                                                                                                                \
  ATTR void cf_bwd1(NormAct act, const T* g, const T* x, const T* r, T* gy, int64_t n, T scale, T shift, T mean,  \
                    double& SG, double& SGX) {                                                                     \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, r != nullptr, CF_BWD1)                                                                  \
  }                                                                                                                \
  ATTR void cf_bwd2(NormAct act, bool res, const T* g, const T* x, const T* gy, T* gx, int64_t n, T scale,        \
                    T shift, T mean, T a, T b, T d) {                                                              \
    using Elem = T;                                                                                                \
    IMGTRAIN_DISPATCH(act, res, CF_BWD2)                                                                           \
  }
#define CL_FWD(A, R) cl_fwd_t<Elem, A, R>(x, r, out, rows, C, scale, shift, mean)
#define CL_BWD1(A, R) cl_bwd1_t<Elem, A, R>(g, x, r, gy, rows, C, scale, shift, mean, sg, sgx)
#define CL_BWD2(A, R) cl_bwd2_t<Elem, A, R>(g, x, gy, gx, rows, C, scale, shift, mean, a, b, d)
#define CF_FWD(A, R) cf_fwd_t<Elem, A, R>(x, r, out, n, scale, shift, mean)
#define CF_BWD1(A, R) cf_bwd1_t<Elem, A, R>(g, x, r, gy, n, scale, shift, mean, SG, SGX)
#define CF_BWD2(A, R) cf_bwd2_t<Elem, A, R>(g, x, gy, gx, n, scale, shift, mean, a, b, d)
IMGTRAIN_ENTRIES(float, IMGTRAIN_CLONES)
IMGTRAIN_ENTRIES(double, )
#undef CL_FWD
#undef CL_BWD1
#undef CL_BWD2
#undef CF_FWD
#undef CF_BWD1
#undef CF_BWD2
#undef IMGTRAIN_ENTRIES
#undef IMGTRAIN_DISPATCH

// The geometry of a supported input: channels-last rows of C, or N planes of HW per channel.
struct Geometry {
  bool channels_last;
  int64_t N, C, HW;
  int64_t count() const { return N * HW; }  // values per channel
};

Geometry geometry(const at::Tensor& x) {
  return {x.is_contiguous(at::MemoryFormat::ChannelsLast), x.size(0), x.size(1), x.size(2) * x.size(3)};
}

at::Tensor in_layout(const at::Tensor& t, const Geometry& g) {
  return t.contiguous(g.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

// Per-channel sums over every value of x: channels-last in fixed blocks of rows (float partials,
// added in block order in double), NCHW per channel plane by plane. Both orders are fixed, so the
// result does not depend on the number of threads. `fn(block or plane, ...)` does the work.
// Channels-last data seen as rows of W = k * C values (k consecutive pixels), so that the loops
// over a row are long enough to vectorise well when C is small (16 channels would be two AVX2
// vectors per row); per-channel arrays are repeated k times (repeat). The last pixels, fewer than
// k, are one row of `tail` values.
struct Wide {
  int64_t k, W, rows, tail;
};

Wide wide(const Geometry& g) {
  const int64_t k = std::max<int64_t>(1, 512 / g.C), pixels = g.N * g.HW;
  return {k, k * g.C, pixels / k, (pixels % k) * g.C};
}

template <typename T>
std::vector<T> repeat(const T* p, int64_t C, const Wide& w) {
  std::vector<T> out(size_t(w.W));
  for (int64_t j = 0; j < w.k; ++j) std::copy(p, p + C, out.begin() + j * C);
  return out;
}

// Per-channel sums over every value of x: channels-last in fixed blocks of wide rows (float
// partials, added in block order in double), NCHW per channel plane by plane. Both orders are
// fixed, so the result does not depend on the number of threads.
//   cl_block(offset, rows, width, s, q): adds the sums of `rows` rows of `width` values at
//   `offset` into s[0..width) and q[0..width); cf_channel(c, S, Q): one channel's sums.
template <typename T, typename PartialFn>
void channel_sums(const Geometry& g, std::vector<double>& A, std::vector<double>& B, PartialFn&& cl_block,
                  const std::function<void(int64_t c, double&, double&)>& cf_channel) {
  const int64_t C = g.C;
  A.assign(C, 0.0);
  B.assign(C, 0.0);
  if (g.channels_last) {
    const auto w = wide(g);
    const int64_t full = (w.rows + kRowBlock - 1) / kRowBlock, blocks = full + (w.tail ? 1 : 0);
    const int64_t W = w.W;
    std::vector<T> part(size_t(blocks * 2 * W), T(0));
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        T* s = part.data() + blk * 2 * W;
        if (blk == full) {
          cl_block(w.rows * W, 1, w.tail, s, s + W);
        } else {
          const int64_t r0 = blk * kRowBlock;
          cl_block(r0 * W, std::min(kRowBlock, w.rows - r0), W, s, s + W);
        }
      }
    });
    at::parallel_for(0, C, 16, [&](int64_t c0, int64_t c1) {
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int64_t j = 0; j < w.k; ++j)
          for (int64_t c = c0; c < c1; ++c) {
            A[c] += part[blk * 2 * W + j * C + c];
            B[c] += part[blk * 2 * W + W + j * C + c];
          }
    });
  } else {
    at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) cf_channel(c, A[c], B[c]);
    });
  }
}

// Elementwise over every value: channels-last by wide rows, cl(offset, rows, width); NCHW by
// (n, c) planes, cf(n, c).
void elementwise(const Geometry& g, const std::function<void(int64_t off, int64_t rows, int64_t width)>& cl,
                 const std::function<void(int64_t n, int64_t c)>& cf) {
  if (g.channels_last) {
    const auto w = wide(g);
    at::parallel_for(0, w.rows, std::max<int64_t>(1, 32768 / w.W),
                     [&](int64_t r0, int64_t r1) { cl(r0 * w.W, r1 - r0, w.W); });
    if (w.tail) cl(w.rows * w.W, 1, w.tail);
  } else {
    at::parallel_for(0, g.N * g.C, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, g.HW)), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) cf(p / g.C, p % g.C);
    });
  }
}

// scale = weight * invstd; the kernels compute (x - mean) * scale + bias, which keeps ATen's exact
// cancellation of x - mean (a channel of near-constant values normalises to its bias, not to
// rounding noise of x * scale - mean * scale).
template <typename T>
std::vector<T> bn_scale(const at::Tensor& w, const at::Tensor& invstd) {
  const int64_t C = w.numel();
  auto wc = w.contiguous();
  const T* wp = wc.data_ptr<T>();
  const T* ip = invstd.data_ptr<T>();
  std::vector<T> scale(C);
  for (int64_t c = 0; c < C; ++c) scale[c] = T(double(wp[c]) * double(ip[c]));
  return scale;
}

// Autograd's custom functions take defined tensors only: no residual is an empty one.
bool has_residual(const at::Tensor& r) { return r.defined() && r.numel() > 0; }

#ifdef IMGTRAIN_WITH_CUDA
// scale = weight * invstd in double, rounded once (bn_scale's arithmetic), on the device.
at::Tensor device_scale(const at::Tensor& w, const at::Tensor& invstd) {
  return (w.to(at::kDouble) * invstd.to(at::kDouble)).to(w.scalar_type()).contiguous();
}

template <typename T>
at::Tensor cuda_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& residual, const at::Tensor& mean, const at::Tensor& invstd, int64_t act) {
  c10::cuda::CUDAGuard guard(x.device());
  const auto g = geometry(x);
  const auto scale = device_scale(weight, invstd), shift = bias.contiguous();
  auto out = at::empty_like(x);
  check_cuda(cuda::bn_act_forward<T>(x.data_ptr<T>(), has_residual(residual) ? residual.data_ptr<T>() : nullptr,
                                     out.data_ptr<T>(), g.N, g.C, g.HW, g.channels_last, scale.data_ptr<T>(),
                                     shift.data_ptr<T>(), mean.data_ptr<T>(), int(act),
                                     c10::cuda::getCurrentCUDAStream().stream()),
             "batch_norm_act forward");
  return out;
}

template <typename T>
torch::autograd::variable_list cuda_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                             const at::Tensor& residual, const at::Tensor& mean,
                                             const at::Tensor& invstd, int64_t act, const at::Tensor& grad) {
  c10::cuda::CUDAGuard guard(x.device());
  const auto g = geometry(x);
  const int64_t C = g.C, M = g.count(), chunk = cuda::norm_act_chunk(M), chunks = (M + chunk - 1) / chunk;
  const auto scale = device_scale(weight, invstd), shift = bias.contiguous();
  const bool res = has_residual(residual);
  at::Tensor gy = res ? at::empty_like(x) : at::Tensor();
  auto gx = at::empty_like(x);
  auto per_channel = at::empty({4, C}, x.options());  // b, d, grad weight, grad bias
  auto part = at::empty({2, chunks, C}, x.options().dtype(at::kDouble));
  T* pc = per_channel.data_ptr<T>();
  check_cuda(cuda::bn_act_backward<T>(grad.data_ptr<T>(), x.data_ptr<T>(), res ? residual.data_ptr<T>() : nullptr,
                                      res ? gy.data_ptr<T>() : nullptr, gx.data_ptr<T>(), g.N, C, g.HW,
                                      g.channels_last, scale.data_ptr<T>(), shift.data_ptr<T>(), mean.data_ptr<T>(),
                                      invstd.data_ptr<T>(), int(act), pc, pc + C, pc + 2 * C, pc + 3 * C,
                                      part.data_ptr<double>(), part.data_ptr<double>() + chunks * C,
                                      c10::cuda::getCurrentCUDAStream().stream()),
             "batch_norm_act backward");
  return {gx, per_channel[2], per_channel[3], res ? gy : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}
#endif

template <typename T>
at::Tensor bn_act_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& residual, const at::Tensor& mean, const at::Tensor& invstd,
                        int64_t act_code) {
  const auto g = geometry(x);
  const auto act = NormAct(act_code);
#ifdef IMGTRAIN_WITH_CUDA
  if (x.is_cuda()) return cuda_forward<T>(x, weight, bias, residual, mean, invstd, act_code);
#endif
  const auto scale = bn_scale<T>(weight, invstd);
  const auto bias_c = bias.contiguous();
  const T* shift = bias_c.data_ptr<T>();
  auto out = at::empty_like(x);
  const T* xp = x.data_ptr<T>();
  const T* rp = has_residual(residual) ? residual.data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const T* mp = mean.data_ptr<T>();
  const int64_t C = g.C, HW = g.HW;
  const auto w = wide(g);
  const auto scale_w = repeat<T>(scale.data(), C, w), shift_w = repeat<T>(shift, C, w), mean_w = repeat<T>(mp, C, w);
  elementwise(
      g,
      [&](int64_t off, int64_t rows, int64_t width) {
        cl_fwd(act, xp + off, rp ? rp + off : nullptr, op + off, rows, width, scale_w.data(), shift_w.data(),
               mean_w.data());
      },
      [&](int64_t n, int64_t c) {
        const int64_t off = (n * C + c) * HW;
        cf_fwd(act, xp + off, rp ? rp + off : nullptr, op + off, HW, scale[c], shift[c], mp[c]);
      });
  return out;
}

template <typename T>
torch::autograd::variable_list bn_act_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                             const at::Tensor& residual, const at::Tensor& mean,
                                             const at::Tensor& invstd, int64_t act_code, const at::Tensor& grad_out) {
  const auto act = NormAct(act_code);
  const auto g = geometry(x);
  const auto grad = in_layout(grad_out, g);
#ifdef IMGTRAIN_WITH_CUDA
  if (x.is_cuda()) return cuda_backward<T>(x, weight, bias, residual, mean, invstd, act_code, grad);
#endif
  const auto scale = bn_scale<T>(weight, invstd);
  const auto bias_c = bias.contiguous();
  const T* shift = bias_c.data_ptr<T>();
  const bool res = has_residual(residual);
  at::Tensor gy = res ? at::empty_like(x) : at::Tensor();
  const T *gp = grad.data_ptr<T>(), *xp = x.data_ptr<T>();
  const T* rp = res ? residual.data_ptr<T>() : nullptr;
  T* gyp = res ? gy.data_ptr<T>() : nullptr;
  const T* mp = mean.data_ptr<T>();
  const int64_t C = g.C, HW = g.HW;
  std::vector<double> SG, SGX;
  const auto w = wide(g);
  const auto scale_w = repeat<T>(scale.data(), C, w), shift_w = repeat<T>(shift, C, w), mean_w = repeat<T>(mp, C, w);
  channel_sums<T>(
      g, SG, SGX,
      [&](int64_t off, int64_t rows, int64_t width, T* sg, T* sgx) {
        cl_bwd1(act, gp + off, xp + off, rp ? rp + off : nullptr, gyp ? gyp + off : nullptr, rows, width,
                scale_w.data(), shift_w.data(), mean_w.data(), sg, sgx);
      },
      [&](int64_t c, double& sg, double& sgx) {
        for (int64_t n = 0; n < g.N; ++n) {
          const int64_t off = (n * C + c) * HW;
          cf_bwd1(act, gp + off, xp + off, rp ? rp + off : nullptr, gyp ? gyp + off : nullptr, HW, scale[c],
                  shift[c], mp[c], sg, sgx);
        }
      });
  const double M = double(g.count());
  const T* ip = invstd.data_ptr<T>();
  auto gw = at::empty({C}, x.options()), gb = at::empty({C}, x.options());
  std::vector<T> b(C), d(C);
  for (int64_t c = 0; c < C; ++c) {
    const double is = ip[c];
    b[c] = T(is * is * SGX[c] / M);  // invstd^2 sum(gy (x - mean)) / M
    d[c] = T(SG[c] / M);             // the mean of gy
    gw.data_ptr<T>()[c] = T(SGX[c] * is);
    gb.data_ptr<T>()[c] = T(SG[c]);
  }
  auto gx = at::empty_like(x);
  T* gxp = gx.data_ptr<T>();
  const auto b_w = repeat<T>(b.data(), C, w), d_w = repeat<T>(d.data(), C, w);
  elementwise(
      g,
      [&](int64_t off, int64_t rows, int64_t width) {
        cl_bwd2(act, res, gp + off, xp + off, gyp ? gyp + off : nullptr, gxp + off, rows, width, scale_w.data(),
                shift_w.data(), mean_w.data(), scale_w.data(), b_w.data(), d_w.data());
      },
      [&](int64_t n, int64_t c) {
        const int64_t off = (n * C + c) * HW;
        cf_bwd2(act, res, gp + off, xp + off, gyp ? gyp + off : nullptr, gxp + off, HW, scale[c], shift[c], mp[c],
                scale[c], b[c], d[c]);
      });
  return {gx, gw, gb, res ? gy : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
}

struct BnActFunction : torch::autograd::Function<BnActFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& residual, const at::Tensor& mean,
                            const at::Tensor& invstd, int64_t act_code) {
    auto out = x.scalar_type() == at::kDouble ? bn_act_forward<double>(x, weight, bias, residual, mean, invstd, act_code)
                                              : bn_act_forward<float>(x, weight, bias, residual, mean, invstd, act_code);
    ctx->save_for_backward({x, weight, bias, residual, mean, invstd});
    ctx->saved_data["act"] = act_code;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto act = ctx->saved_data["act"].toInt();
    return saved[0].scalar_type() == at::kDouble
               ? bn_act_backward<double>(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], act, grads[0])
               : bn_act_backward<float>(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], act, grads[0]);
  }
};

// Batch statistics of x per channel (mean, 1 / sqrt(var + eps)) and the running statistics
// update, as torch's training-mode batch_norm.
template <typename T>
void bn_stats(const at::Tensor& x, const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
              double eps, at::Tensor& mean, at::Tensor& invstd) {
  const auto g = geometry(x);
  const int64_t C = g.C, HW = g.HW;
#ifdef IMGTRAIN_WITH_CUDA
  if (x.is_cuda()) {
    c10::cuda::CUDAGuard guard(x.device());
    const int64_t M = g.count(), chunk = cuda::norm_act_chunk(M), chunks = (M + chunk - 1) / chunk;
    auto part = at::empty({2, chunks, C}, x.options().dtype(at::kDouble));
    mean = at::empty({C}, x.options());
    invstd = at::empty({C}, x.options());
    const bool update = running_mean.defined() && running_var.defined();
    check_cuda(cuda::bn_stats<T>(x.data_ptr<T>(), g.N, C, HW, g.channels_last, momentum, eps, mean.data_ptr<T>(),
                                 invstd.data_ptr<T>(), update ? running_mean.data_ptr<T>() : nullptr,
                                 update ? running_var.data_ptr<T>() : nullptr, part.data_ptr<double>(),
                                 part.data_ptr<double>() + chunks * C, c10::cuda::getCurrentCUDAStream().stream()),
               "batch_norm_act statistics");
    return;
  }
#endif
  // the statistics: sums of x - k with k = the channel's first value (shifted sums keep the
  // variance exact when the mean is large against the spread)
  std::vector<T> k(C);
  at::NoGradGuard no_grad;
  const T* xp = x.data_ptr<T>();
  for (int64_t c = 0; c < C; ++c) k[c] = g.channels_last ? xp[c] : xp[c * HW];
  const auto k_w = repeat<T>(k.data(), C, wide(g));
  std::vector<double> S, Q;
  channel_sums<T>(
      g, S, Q,
      [&](int64_t off, int64_t rows, int64_t width, T* s, T* q) {
        cl_stats(xp + off, k_w.data(), rows, width, s, q);
      },
      [&](int64_t c, double& s, double& q) {
        for (int64_t n = 0; n < g.N; ++n) cf_stats(xp + (n * C + c) * HW, HW, k[c], s, q);
      });
  const double M = double(g.count());
  mean = at::empty({C}, x.options());
  invstd = at::empty({C}, x.options());
  T *mp = mean.data_ptr<T>(), *ip = invstd.data_ptr<T>();
  const bool update = running_mean.defined() && running_var.defined();
  T* rm = update ? running_mean.data_ptr<T>() : nullptr;
  T* rv = update ? running_var.data_ptr<T>() : nullptr;
  for (int64_t c = 0; c < C; ++c) {
    const double ms = S[c] / M;
    const double var = std::max(0.0, Q[c] / M - ms * ms);
    const double mu = double(k[c]) + ms;
    mp[c] = T(mu);
    ip[c] = T(1.0 / std::sqrt(var + eps));
    if (update) {
      rm[c] = T(momentum * mu + (1.0 - momentum) * double(rm[c]));
      rv[c] = T(momentum * var * M / (M - 1.0) + (1.0 - momentum) * double(rv[c]));
    }
  }
}

}  // namespace

int kernel_threads() {
  std::atomic<int> seen{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num() + 1;
    int prev = seen.load();
    while (prev < t && !seen.compare_exchange_weak(prev, t)) {
    }
  });
  return seen.load();
}

bool batch_norm_act_supported(const at::Tensor& x, const at::Tensor& residual) {
#ifdef IMGTRAIN_WITH_CUDA
  const bool device_ok = x.defined() && (x.device().is_cpu() || x.device().is_cuda());
#else
  const bool device_ok = x.defined() && x.device().is_cpu();
#endif
  if (!device_ok || x.dim() != 4 || x.size(1) == 0) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) return false;
  if (x.size(0) * x.size(2) * x.size(3) < 2) return false;
  const bool cl = x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (!cl && !x.is_contiguous()) return false;
  if (!residual.defined()) return true;
  return residual.sizes() == x.sizes() && residual.device() == x.device() && residual.scalar_type() == x.scalar_type() &&
         (cl ? residual.is_contiguous(at::MemoryFormat::ChannelsLast) : residual.is_contiguous());
}

at::Tensor batch_norm_act_train(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                                double eps, NormAct act, const at::Tensor& residual) {
  if (!batch_norm_act_supported(x, residual))
    throw std::invalid_argument("batch_norm_act_train: unsupported input (float32 or float64 4-D on the CPU or CUDA, NCHW or channels-last)");
  at::Tensor mean, invstd;
  if (x.scalar_type() == at::kDouble)
    bn_stats<double>(x, running_mean, running_var, momentum, eps, mean, invstd);
  else
    bn_stats<float>(x, running_mean, running_var, momentum, eps, mean, invstd);
  return BnActFunction::apply(x, weight, bias, residual.defined() ? residual : at::empty({0}, x.options()), mean,
                              invstd, int64_t(act));
}

}  // namespace imgtrain::ops
