// Device kernels for the detection ops (ops.cpp dispatches CUDA tensors here): RoIAlign forward
// and backward and the NMS overlap mask, with the CPU kernels' arithmetic (the same sample points,
// taps and float order per output), so CPU and CUDA agree to float rounding. No torch headers:
// nvcc sees plain CUDA; ops.cpp owns the tensors, the streams and the sort.
#include <cuda_runtime.h>

#include <cstdint>

namespace imgtrain::ops::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return unsigned(b > 65535 * 32 ? 65535 * 32 : b);
}

// One RoI's geometry, as roi_geom in ops.cpp: the scale products taken in double, rounded once.
template <typename T>
struct Geom {
  int64_t batch;
  T start_h, start_w, bin_h, bin_w, count;
  int64_t grid_h, grid_w;
};

template <typename T>
__device__ Geom<T> geom(const T* r, double scale, int64_t ph, int64_t pw, int64_t sampling, bool aligned) {
  Geom<T> g;
  g.batch = int64_t(r[0]);
  const double off = aligned ? 0.5 : 0.0;
  g.start_w = T(double(r[1]) * scale - off);
  g.start_h = T(double(r[2]) * scale - off);
  const T end_w = T(double(r[3]) * scale - off), end_h = T(double(r[4]) * scale - off);
  T rw = end_w - g.start_w, rh = end_h - g.start_h;
  if (!aligned) {
    rw = rw > T(1) ? rw : T(1);
    rh = rh > T(1) ? rh : T(1);
  }
  g.bin_h = rh / T(ph);
  g.bin_w = rw / T(pw);
  g.grid_h = sampling > 0 ? sampling : int64_t(ceil(rh / T(ph)));
  g.grid_w = sampling > 0 ? sampling : int64_t(ceil(rw / T(pw)));
  const int64_t n = g.grid_h * g.grid_w;
  g.count = T(n > 1 ? n : 1);
  return g;
}

// The four taps of (y, x) on an h x w map; false outside by more than a pixel.
template <typename T>
__device__ bool taps(int64_t h, int64_t w, T y, T x, int64_t& yl, int64_t& yh, int64_t& xl, int64_t& xh, T& w1,
                     T& w2, T& w3, T& w4) {
  if (y < T(-1.0) || y > T(h) || x < T(-1.0) || x > T(w)) return false;
  if (y <= T(0)) y = T(0);
  if (x <= T(0)) x = T(0);
  yl = int64_t(y);
  xl = int64_t(x);
  if (yl >= h - 1) {
    yh = yl = h - 1;
    y = T(yl);
  } else {
    yh = yl + 1;
  }
  if (xl >= w - 1) {
    xh = xl = w - 1;
    x = T(xl);
  } else {
    xh = xl + 1;
  }
  const T ly = y - T(yl), lx = x - T(xl);
  const T hy = T(1.) - ly, hx = T(1.) - lx;
  w1 = hy * hx;
  w2 = hy * lx;
  w3 = ly * hx;
  w4 = ly * lx;
  return true;
}

template <typename T>
__global__ void roi_align_forward_kernel(const T* __restrict__ in, const T* __restrict__ rois, T* __restrict__ out,
                                         int64_t total, int64_t C, int64_t H, int64_t W, int64_t ph, int64_t pw,
                                         double scale, int64_t sampling, bool aligned) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % pw, i = (idx / pw) % ph, c = (idx / (pw * ph)) % C, k = idx / (pw * ph * C);
    const auto g = geom(rois + k * 5, scale, ph, pw, sampling, aligned);
    const T* plane = in + (g.batch * C + c) * H * W;
    T v = 0;
    for (int64_t iy = 0; iy < g.grid_h; ++iy) {
      const T y = g.start_h + T(i) * g.bin_h + T(float(iy) + .5f) * g.bin_h / T(g.grid_h);
      for (int64_t ix = 0; ix < g.grid_w; ++ix) {
        const T x = g.start_w + T(j) * g.bin_w + T(float(ix) + .5f) * g.bin_w / T(g.grid_w);
        int64_t yl, yh, xl, xh;
        T w1, w2, w3, w4;
        if (!taps(H, W, y, x, yl, yh, xl, xh, w1, w2, w3, w4)) continue;
        v += w1 * plane[yl * W + xl] + w2 * plane[yl * W + xh] + w3 * plane[yh * W + xl] + w4 * plane[yh * W + xh];
      }
    }
    out[idx] = v / g.count;
  }
}

template <typename T>
__global__ void roi_align_backward_kernel(const T* __restrict__ grad, const T* __restrict__ rois, T* gin,
                                          int64_t total, int64_t C, int64_t H, int64_t W, int64_t ph, int64_t pw,
                                          double scale, int64_t sampling, bool aligned) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % pw, i = (idx / pw) % ph, c = (idx / (pw * ph)) % C, k = idx / (pw * ph * C);
    const auto g = geom(rois + k * 5, scale, ph, pw, sampling, aligned);
    T* plane = gin + (g.batch * C + c) * H * W;
    const T gb = grad[idx];
    for (int64_t iy = 0; iy < g.grid_h; ++iy) {
      const T y = g.start_h + T(i) * g.bin_h + T(float(iy) + .5f) * g.bin_h / T(g.grid_h);
      for (int64_t ix = 0; ix < g.grid_w; ++ix) {
        const T x = g.start_w + T(j) * g.bin_w + T(float(ix) + .5f) * g.bin_w / T(g.grid_w);
        int64_t yl, yh, xl, xh;
        T w1, w2, w3, w4;
        if (!taps(H, W, y, x, yl, yh, xl, xh, w1, w2, w3, w4)) continue;
        atomicAdd(plane + yl * W + xl, gb * w1 / g.count);
        atomicAdd(plane + yl * W + xh, gb * w2 / g.count);
        atomicAdd(plane + yh * W + xl, gb * w3 / g.count);
        atomicAdd(plane + yh * W + xh, gb * w4 / g.count);
      }
    }
  }
}

// NMS overlap mask: boxes already in score order; bit b of mask[i * blocks + cb] says box
// cb * 64 + b (> i) overlaps box i by IoU > thr. One 64-thread block per (row block, column block).
template <typename T>
__global__ void nms_mask_kernel(const T* __restrict__ boxes, int64_t n, double thr, uint64_t* __restrict__ mask,
                                int64_t blocks) {
  const int64_t rb = blockIdx.y, cb = blockIdx.x;
  if (cb < rb) return;  // only boxes after i matter
  __shared__ T col[64 * 4];
  const int64_t cols = n - cb * 64 < 64 ? n - cb * 64 : 64, rows = n - rb * 64 < 64 ? n - rb * 64 : 64;
  if (threadIdx.x < cols)
    for (int q = 0; q < 4; ++q) col[threadIdx.x * 4 + q] = boxes[(cb * 64 + threadIdx.x) * 4 + q];
  __syncthreads();
  if (threadIdx.x >= rows) return;
  const int64_t i = rb * 64 + threadIdx.x;
  const T* a = boxes + i * 4;
  const T area_a = (a[2] - a[0]) * (a[3] - a[1]);
  uint64_t bits = 0;
  for (int64_t b = (cb == rb ? threadIdx.x + 1 : 0); b < cols; ++b) {
    const T* o = col + b * 4;
    const T w = fmax(T(0), fmin(a[2], o[2]) - fmax(a[0], o[0]));
    const T h = fmax(T(0), fmin(a[3], o[3]) - fmax(a[1], o[1]));
    const T inter = w * h;
    const T area_b = (o[2] - o[0]) * (o[3] - o[1]);
    if (double(inter / (area_a + area_b - inter)) > thr) bits |= uint64_t(1) << b;  // as the CPU kernel
  }
  mask[i * blocks + cb] = bits;
}

}  // namespace

int roi_align_forward(const float* in, const float* rois, float* out, int64_t K, int64_t C, int64_t H, int64_t W,
                      int64_t ph, int64_t pw, double scale, int64_t sampling, bool aligned, void* stream) {
  const int64_t total = K * C * ph * pw;
  if (total == 0) return 0;
  roi_align_forward_kernel<float><<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, rois, out, total, C, H, W, ph, pw, scale, sampling, aligned);
  return int(cudaGetLastError());
}

int roi_align_forward(const double* in, const double* rois, double* out, int64_t K, int64_t C, int64_t H, int64_t W,
                      int64_t ph, int64_t pw, double scale, int64_t sampling, bool aligned, void* stream) {
  const int64_t total = K * C * ph * pw;
  if (total == 0) return 0;
  roi_align_forward_kernel<double><<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      in, rois, out, total, C, H, W, ph, pw, scale, sampling, aligned);
  return int(cudaGetLastError());
}

int roi_align_backward(const float* grad, const float* rois, float* gin, int64_t K, int64_t C, int64_t H, int64_t W,
                       int64_t ph, int64_t pw, double scale, int64_t sampling, bool aligned, void* stream) {
  const int64_t total = K * C * ph * pw;
  if (total == 0) return 0;
  roi_align_backward_kernel<float><<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      grad, rois, gin, total, C, H, W, ph, pw, scale, sampling, aligned);
  return int(cudaGetLastError());
}

int roi_align_backward(const double* grad, const double* rois, double* gin, int64_t K, int64_t C, int64_t H,
                       int64_t W, int64_t ph, int64_t pw, double scale, int64_t sampling, bool aligned,
                       void* stream) {
  const int64_t total = K * C * ph * pw;
  if (total == 0) return 0;
  roi_align_backward_kernel<double><<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      grad, rois, gin, total, C, H, W, ph, pw, scale, sampling, aligned);
  return int(cudaGetLastError());
}

int nms_mask(const float* boxes, int64_t n, double thr, uint64_t* mask, void* stream) {
  if (n == 0) return 0;
  const int64_t blocks = (n + 63) / 64;
  nms_mask_kernel<float><<<dim3(unsigned(blocks), unsigned(blocks)), 64, 0, static_cast<cudaStream_t>(stream)>>>(
      boxes, n, thr, mask, blocks);
  return int(cudaGetLastError());
}

int nms_mask(const double* boxes, int64_t n, double thr, uint64_t* mask, void* stream) {
  if (n == 0) return 0;
  const int64_t blocks = (n + 63) / 64;
  nms_mask_kernel<double><<<dim3(unsigned(blocks), unsigned(blocks)), 64, 0, static_cast<cudaStream_t>(stream)>>>(
      boxes, n, thr, mask, blocks);
  return int(cudaGetLastError());
}

}  // namespace imgtrain::ops::cuda
