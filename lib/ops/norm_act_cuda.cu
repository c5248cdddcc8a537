// Device twin of the fused training BatchNorm (norm_act.cpp dispatches CUDA tensors here):
// act(batch_norm(x) + residual) with batch statistics, forward and backward, NCHW or
// channels-last, float32 or float64, with the CPU kernels' arithmetic per element (the same
// shifted statistics, normalisation (x - mean) * scale + shift and backward formulas), so CPU and
// CUDA agree to float rounding (SiLU uses the device's exp). Per-channel sums are taken in double
// over fixed chunks and combined in a fixed order: for given shapes a run gives the same bits
// every time (no atomics). Two passes over memory each way, as on the CPU. No torch headers:
// norm_act.cpp owns the tensors and the stream.
#include <cuda_runtime.h>

#include <cstdint>

namespace imgtrain::ops::cuda {

// Values of one channel per partial sum: 4096, more where that would make over 4096 chunks (the
// caller allocates the partials: chunks x C doubles, twice).
int64_t norm_act_chunk(int64_t M) {
  int64_t chunk = 4096;
  if ((M + chunk - 1) / chunk > 4096) chunk = (M + 4095) / 4096;
  return chunk;
}

namespace {

constexpr int kThreads = 256;
constexpr int kTileC = 32;  // channels-last: channels per block (one warp across them)
constexpr int kRowsCL = kThreads / kTileC;

// NormAct's order (norm_act.h): None, ReLU, ReLU6, SiLU, HardSwish.
__device__ inline float dexp(float v) { return expf(v); }
__device__ inline double dexp(double v) { return exp(v); }

template <typename T>
__device__ inline T act_fwd(int a, T v) {
  switch (a) {
    case 1: return v > T(0) ? v : T(0);
    case 2: return v < T(0) ? T(0) : (v > T(6) ? T(6) : v);
    case 3: return v / (T(1) + dexp(-v));
    case 4: {
      T t = v + T(3);
      t = t < T(0) ? T(0) : (t > T(6) ? T(6) : t);
      return v * t / T(6);
    }
    default: return v;
  }
}

// torch's backward formulas: ReLU's mask is v > 0, ReLU6 passes 0 < v < 6, hard-swish is
// v / 3 + 1/2 on [-3, 3].
template <typename T>
__device__ inline T act_grad(int a, T v) {
  switch (a) {
    case 1: return v > T(0) ? T(1) : T(0);
    case 2: return (v > T(0) && v < T(6)) ? T(1) : T(0);
    case 3: {
      const T s = T(1) / (T(1) + dexp(-v));
      return s * (T(1) + v * (T(1) - s));
    }
    case 4: return v < T(-3) ? T(0) : (v <= T(3) ? v / T(3) + T(0.5) : T(1));
    default: return T(1);
  }
}

struct Shape {
  int64_t N, C, HW;
  bool cl;
  int64_t chunk;  // values of one channel per partial sum
  __host__ __device__ int64_t M() const { return N * HW; }
};

__device__ inline int64_t offset(const Shape& s, int64_t m, int64_t c) {  // m: the value's index in its channel
  return s.cl ? m * s.C + c : ((m / s.HW) * s.C + c) * s.HW + m % s.HW;
}

__device__ inline int64_t channel_of(const Shape& s, int64_t i) { return s.cl ? i % s.C : (i / s.HW) % s.C; }

// Per-channel partial sums of f(i, c) = (a, b) over chunk blockIdx.y of every channel, written to
// pa / pb [chunk][C]. Channels-last: a block is 32 channels x 8 rows (a warp reads 32 adjacent
// channels); NCHW: a block is one channel, its 256 threads along the plane. Each thread sums its
// values in order, the block adds the threads' sums in a fixed order.
template <typename F>
__global__ void channel_partials(F f, Shape s, double* __restrict__ pa, double* __restrict__ pb) {
  __shared__ double sa[kThreads], sb[kThreads];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int64_t r = blockIdx.y, m0 = r * s.chunk, m1 = m0 + s.chunk < s.M() ? m0 + s.chunk : s.M();
  double a = 0, b = 0;
  int64_t c;
  if (s.cl) {
    c = int64_t(blockIdx.x) * kTileC + threadIdx.x;
    if (c < s.C)
      for (int64_t m = m0 + threadIdx.y; m < m1; m += kRowsCL) f(offset(s, m, c), c, a, b);
  } else {
    c = blockIdx.x;
    for (int64_t m = m0 + t; m < m1; m += kThreads) f(offset(s, m, c), c, a, b);
  }
  sa[t] = a;
  sb[t] = b;
  __syncthreads();
  if (s.cl) {
    if (threadIdx.y == 0 && c < s.C) {
      for (int y = 1; y < kRowsCL; ++y) a += sa[y * kTileC + threadIdx.x], b += sb[y * kTileC + threadIdx.x];
      pa[r * s.C + c] = a;
      pb[r * s.C + c] = b;
    }
  } else {
    for (int w = kThreads / 2; w > 0; w /= 2) {
      if (t < w) sa[t] += sa[t + w], sb[t] += sb[t + w];
      __syncthreads();
    }
    if (t == 0) pa[r * s.C + c] = sa[0], pb[r * s.C + c] = sb[0];
  }
}

template <typename T>
struct StatsTerm {  // (x - k, (x - k)^2), k = the channel's first value
  const T* x;
  Shape s;
  __device__ void operator()(int64_t i, int64_t c, double& a, double& b) const {
    const double d = double(x[i]) - double(x[offset(s, 0, c)]);
    a += d;
    b += d * d;
  }
};

template <typename T>
struct GradTerm {  // gy = g * act'(pre) (stored for the residual), (gy, gy * (x - mean))
  const T *g, *x, *r, *scale, *shift, *mean;
  T* gy_out;
  int act;
  __device__ void operator()(int64_t i, int64_t c, double& a, double& b) const {
    T gy = g[i];
    if (act != 0) {
      T v = (x[i] - mean[c]) * scale[c] + shift[c];
      if (r) v += r[i];
      gy *= act_grad(act, v);
    }
    if (gy_out) gy_out[i] = gy;
    a += double(gy);
    b += double(gy) * double(x[i] - mean[c]);
  }
};

template <typename T>
__global__ void stats_finish(const T* __restrict__ x, Shape s, int64_t chunks, const double* __restrict__ pa,
                             const double* __restrict__ pb, double momentum, double eps, T* __restrict__ mean,
                             T* __restrict__ invstd, T* rm, T* rv) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= s.C) return;
  double S = 0, Q = 0;
  for (int64_t r = 0; r < chunks; ++r) S += pa[r * s.C + c], Q += pb[r * s.C + c];
  const double M = double(s.M()), ms = S / M;
  double var = Q / M - ms * ms;
  var = var > 0 ? var : 0;
  const double mu = double(x[offset(s, 0, c)]) + ms;
  mean[c] = T(mu);
  invstd[c] = T(1.0 / sqrt(var + eps));
  if (rm) {
    rm[c] = T(momentum * mu + (1.0 - momentum) * double(rm[c]));
    rv[c] = T(momentum * var * M / (M - 1.0) + (1.0 - momentum) * double(rv[c]));
  }
}

template <typename T>
__global__ void grad_finish(Shape s, int64_t chunks, const double* __restrict__ pa, const double* __restrict__ pb,
                            const T* __restrict__ invstd, T* __restrict__ b, T* __restrict__ d, T* __restrict__ gw,
                            T* __restrict__ gb) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= s.C) return;
  double SG = 0, SGX = 0;
  for (int64_t r = 0; r < chunks; ++r) SG += pa[r * s.C + c], SGX += pb[r * s.C + c];
  const double M = double(s.M()), is = double(invstd[c]);
  b[c] = T(is * is * SGX / M);
  d[c] = T(SG / M);
  gw[c] = T(SGX * is);
  gb[c] = T(SG);
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ out, Shape s,
                               int64_t n, const T* __restrict__ scale, const T* __restrict__ shift,
                               const T* __restrict__ mean, int act) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = channel_of(s, i);
    T v = (x[i] - mean[c]) * scale[c] + shift[c];
    if (r) v += r[i];
    out[i] = act_fwd(act, v);
  }
}

// gx = (gy - b * (x - mean) - d) * scale, gy read back (residual) or recomputed from g.
template <typename T>
__global__ void backward_kernel(const T* __restrict__ g, const T* __restrict__ x, const T* __restrict__ gy_in,
                                T* __restrict__ gx, Shape s, int64_t n, const T* __restrict__ scale,
                                const T* __restrict__ shift, const T* __restrict__ mean, const T* __restrict__ b,
                                const T* __restrict__ d, int act) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = channel_of(s, i);
    T gy;
    if (gy_in) {
      gy = gy_in[i];
    } else {
      gy = g[i];
      if (act != 0) gy *= act_grad(act, (x[i] - mean[c]) * scale[c] + shift[c]);
    }
    gx[i] = (gy - b[c] * (x[i] - mean[c]) - d[c]) * scale[c];
  }
}

unsigned elementwise_blocks(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b > 65535 * 8 ? 65535 * 8 : b);
}

dim3 partial_grid(const Shape& s, int64_t chunks) {
  return dim3(unsigned(s.cl ? (s.C + kTileC - 1) / kTileC : s.C), unsigned(chunks));
}

dim3 partial_block(const Shape& s) { return s.cl ? dim3(kTileC, kRowsCL) : dim3(kThreads); }

Shape shape(int64_t N, int64_t C, int64_t HW, bool cl) {
  Shape s{N, C, HW, cl, 0};
  s.chunk = norm_act_chunk(N * HW);
  return s;
}

}  // namespace

template <typename T>
int bn_stats(const T* x, int64_t N, int64_t C, int64_t HW, bool cl, double momentum, double eps, T* mean, T* invstd,
             T* rm, T* rv, double* pa, double* pb, cudaStream_t stream) {
  const Shape s = shape(N, C, HW, cl);
  const int64_t chunks = (s.M() + s.chunk - 1) / s.chunk;
  channel_partials<<<partial_grid(s, chunks), partial_block(s), 0, stream>>>(StatsTerm<T>{x, s}, s, pa, pb);
  stats_finish<T><<<unsigned((C + kThreads - 1) / kThreads), kThreads, 0, stream>>>(x, s, chunks, pa, pb, momentum,
                                                                                   eps, mean, invstd, rm, rv);
  return int(cudaGetLastError());
}

template <typename T>
int bn_act_forward(const T* x, const T* r, T* out, int64_t N, int64_t C, int64_t HW, bool cl, const T* scale,
                   const T* shift, const T* mean, int act, cudaStream_t stream) {
  const Shape s = shape(N, C, HW, cl);
  const int64_t n = N * C * HW;
  forward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(x, r, out, s, n, scale, shift, mean, act);
  return int(cudaGetLastError());
}

template <typename T>
int bn_act_backward(const T* g, const T* x, const T* r, T* gy, T* gx, int64_t N, int64_t C, int64_t HW, bool cl,
                    const T* scale, const T* shift, const T* mean, const T* invstd, int act, T* b, T* d, T* gw,
                    T* gb, double* pa, double* pb, cudaStream_t stream) {
  const Shape s = shape(N, C, HW, cl);
  const int64_t chunks = (s.M() + s.chunk - 1) / s.chunk, n = N * C * HW;
  channel_partials<<<partial_grid(s, chunks), partial_block(s), 0, stream>>>(
      GradTerm<T>{g, x, r, scale, shift, mean, r ? gy : nullptr, act}, s, pa, pb);
  grad_finish<T><<<unsigned((C + kThreads - 1) / kThreads), kThreads, 0, stream>>>(s, chunks, pa, pb, invstd, b, d,
                                                                                  gw, gb);
  backward_kernel<T><<<elementwise_blocks(n), kThreads, 0, stream>>>(g, x, r ? gy : nullptr, gx, s, n, scale, shift,
                                                                     mean, b, d, act);
  return int(cudaGetLastError());
}

#define IMGTRAIN_NORM_ACT_INSTANTIATE(T)                                                                          \
  template int bn_stats<T>(const T*, int64_t, int64_t, int64_t, bool, double, double, T*, T*, T*, T*, double*,    \
                           double*, cudaStream_t);                                                                \
  template int bn_act_forward<T>(const T*, const T*, T*, int64_t, int64_t, int64_t, bool, const T*, const T*,     \
                                 const T*, int, cudaStream_t);                                                    \
  template int bn_act_backward<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t, bool,          \
                                  const T*, const T*, const T*, const T*, int, T*, T*, T*, T*, double*, double*,  \
                                  cudaStream_t);
IMGTRAIN_NORM_ACT_INSTANTIATE(float)
IMGTRAIN_NORM_ACT_INSTANTIATE(double)

}  // namespace imgtrain::ops::cuda
