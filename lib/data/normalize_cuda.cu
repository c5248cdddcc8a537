// Fused uint8 NHWC -> float NCHW normalisation. No torch headers here: nvcc only sees plain CUDA.
#include <cuda_runtime.h>
#include <cstdint>

namespace imgtrain::data::cuda {

struct ChannelParams {
  float offset[4];   // 255 * mean
  float divisor[4];  // 255 * std: (v - offset) / divisor, the CPU path's (and timm's) arithmetic
};

__global__ void normalize_nhwc_u8_kernel(const uint8_t* __restrict__ src, float* __restrict__ dst, int64_t hw,
                                         int c, int64_t total, ChannelParams p) {
  // One thread per output element, in NCHW order so the writes coalesce.
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t n = i / (c * hw);
    int64_t rem = i - n * c * hw;
    int ch = int(rem / hw);
    int64_t pix = rem - int64_t(ch) * hw;
    float v = float(src[(n * hw + pix) * c + ch]);
    dst[i] = (v - p.offset[ch]) / p.divisor[ch];
  }
}

// The same into channels-last memory: NHWC in, NHWC-ordered float out, element for element.
__global__ void normalize_nhwc_u8_cl_kernel(const uint8_t* __restrict__ src, float* __restrict__ dst, int c,
                                            int64_t total, ChannelParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int ch = int(i % c);
    dst[i] = (float(src[i]) - p.offset[ch]) / p.divisor[ch];
  }
}

// Returns the cudaError_t of the launch.
int launch_normalize_nhwc_u8(const uint8_t* src, float* dst, int64_t n, int64_t h, int64_t w, int c,
                             const float* mean, const float* std, bool channels_last, void* stream) {
  ChannelParams p{};
  for (int i = 0; i < c && i < 4; ++i) {
    p.offset[i] = 255.0f * mean[i];
    p.divisor[i] = 255.0f * std[i];
  }
  const int64_t total = n * h * w * c;
  if (total == 0) return 0;
  const int threads = 256;
  int64_t blocks = (total + threads - 1) / threads;
  if (blocks > 65535 * 8) blocks = 65535 * 8;
  if (channels_last)
    normalize_nhwc_u8_cl_kernel<<<unsigned(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, c, total,
                                                                                                    p);
  else
    normalize_nhwc_u8_kernel<<<unsigned(blocks), threads, 0, static_cast<cudaStream_t>(stream)>>>(src, dst, h * w, c,
                                                                                                   total, p);
  return int(cudaGetLastError());
}

}  // namespace imgtrain::data::cuda
