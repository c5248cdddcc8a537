// Device twin of the squeeze-and-excite backward's two full-size passes (se_gate.cpp dispatches
// CUDA tensors here): the gate's gradient, sum over H, W of g * x per (n, c), and the input
// gradient g * gate[n, c] + add[n, c], NCHW or channels-last, float32 or float64. The sums are
// taken in double in a fixed order (no atomics: the same bits every run); the input gradient
// rounds the product and the sum apart, as autograd's two ATen ops do (no fused multiply-add).
// No torch headers: se_gate.cpp owns the tensors and the stream.
#include <cuda_runtime.h>

#include <cstdint>

namespace imgtrain::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTileC = 32;
constexpr int kRowsCL = kThreads / kTileC;

__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }

// NCHW: one block per (n, c) plane, its threads along the plane, a tree in shared memory.
template <typename T>
__global__ void gate_grad_planes(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ out, int64_t HW) {
  __shared__ double acc[kThreads];
  const int64_t p = blockIdx.x;
  const T *gp = g + p * HW, *xp = x + p * HW;
  double s = 0;
  for (int64_t i = threadIdx.x; i < HW; i += kThreads) s += double(mul_rn(gp[i], xp[i]));
  acc[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) acc[threadIdx.x] += acc[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[p] = T(acc[0]);
}

// Channels-last: a block is 32 channels x 8 rows of one image; each thread sums every 8th pixel.
template <typename T>
__global__ void gate_grad_rows(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ out, int64_t C,
                               int64_t HW) {
  __shared__ double acc[kThreads];
  const int64_t n = blockIdx.y, c = int64_t(blockIdx.x) * kTileC + threadIdx.x;
  double s = 0;
  if (c < C)
    for (int64_t p = threadIdx.y; p < HW; p += kRowsCL) {
      const int64_t i = (n * HW + p) * C + c;
      s += double(mul_rn(g[i], x[i]));
    }
  acc[threadIdx.y * kTileC + threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int y = 1; y < kRowsCL; ++y) s += acc[y * kTileC + threadIdx.x];
    out[n * C + c] = T(s);
  }
}

template <typename T>
__global__ void input_grad_kernel(const T* __restrict__ g, T* __restrict__ gx, const T* __restrict__ mul,
                                  const T* __restrict__ add, int64_t N, int64_t C, int64_t HW, bool cl) {
  const int64_t n_all = N * C * HW;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_all; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t nc = cl ? (i / (HW * C)) * C + i % C : i / HW;
    gx[i] = add_rn(mul_rn(g[i], mul[nc]), add[nc]);
  }
}

}  // namespace

template <typename T>
int se_gate_grad(const T* g, const T* x, T* out, int64_t N, int64_t C, int64_t HW, bool cl, cudaStream_t stream) {
  if (cl)
    gate_grad_rows<T><<<dim3(unsigned((C + kTileC - 1) / kTileC), unsigned(N)), dim3(kTileC, kRowsCL), 0, stream>>>(
        g, x, out, C, HW);
  else
    gate_grad_planes<T><<<unsigned(N * C), kThreads, 0, stream>>>(g, x, out, HW);
  return int(cudaGetLastError());
}

template <typename T>
int se_input_grad(const T* g, T* gx, const T* mul, const T* add, int64_t N, int64_t C, int64_t HW, bool cl,
                  cudaStream_t stream) {
  const int64_t n = N * C * HW, b = (n + kThreads - 1) / kThreads;
  input_grad_kernel<T><<<unsigned(b > 65535 * 8 ? 65535 * 8 : b), kThreads, 0, stream>>>(g, gx, mul, add, N, C, HW, cl);
  return int(cudaGetLastError());
}

template int se_gate_grad<float>(const float*, const float*, float*, int64_t, int64_t, int64_t, bool, cudaStream_t);
template int se_gate_grad<double>(const double*, const double*, double*, int64_t, int64_t, int64_t, bool,
                                  cudaStream_t);
template int se_input_grad<float>(const float*, float*, const float*, const float*, int64_t, int64_t, int64_t, bool,
                                  cudaStream_t);
template int se_input_grad<double>(const double*, double*, const double*, const double*, int64_t, int64_t, int64_t,
                                   bool, cudaStream_t);

}  // namespace imgtrain::ops::cuda
