#include "data/normalize.h"

#include <torch/torch.h>
#ifdef IMGTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace imgtrain::data {

#ifdef IMGTRAIN_WITH_CUDA
namespace cuda {
int launch_normalize_nhwc_u8(const uint8_t* src, float* dst, int64_t n, int64_t h, int64_t w, int c,
                             const float* mean, const float* std, bool channels_last, void* stream);
}
bool normalize_has_cuda_kernel() { return true; }
#else
bool normalize_has_cuda_kernel() { return false; }
#endif

at::Tensor normalize_nhwc_u8(const at::Tensor& nhwc, const std::vector<double>& mean, const std::vector<double>& std,
                             bool channels_last) {
  TORCH_CHECK(nhwc.scalar_type() == at::kByte && nhwc.dim() == 4, "normalize: expected uint8 [N, H, W, C]");
  const int64_t c = nhwc.size(3);
  TORCH_CHECK(int64_t(mean.size()) == c && int64_t(std.size()) == c, "normalize: mean/std length != channels");
#ifdef IMGTRAIN_WITH_CUDA
  if (nhwc.is_cuda() && c <= 4) {
    c10::cuda::CUDAGuard guard(nhwc.device());
    auto src = nhwc.contiguous();
    auto out = at::empty({nhwc.size(0), c, nhwc.size(1), nhwc.size(2)},
                         nhwc.options().dtype(at::kFloat).memory_format(channels_last ? at::MemoryFormat::ChannelsLast
                                                                                      : at::MemoryFormat::Contiguous));
    std::vector<float> m(mean.begin(), mean.end()), s(std.begin(), std.end());
    int err = cuda::launch_normalize_nhwc_u8(src.data_ptr<uint8_t>(), out.data_ptr<float>(), nhwc.size(0),
                                             nhwc.size(1), nhwc.size(2), int(c), m.data(), s.data(), channels_last,
                                             c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "normalize: CUDA kernel launch failed with error ", err);
    return out;
  }
#endif
  auto o = at::TensorOptions().dtype(at::kFloat).device(nhwc.device());
  auto m = (torch::tensor(mean, at::TensorOptions().dtype(at::kFloat)) * 255).view({1, -1, 1, 1}).to(o);
  auto s = (torch::tensor(std, at::TensorOptions().dtype(at::kFloat)) * 255).view({1, -1, 1, 1}).to(o);
  if (channels_last)  // NHWC memory is the channels-last layout: normalise in place of the layout change
    return nhwc.to(at::kFloat).permute({0, 3, 1, 2}).sub_(m).div_(s);
  return nhwc.permute({0, 3, 1, 2}).to(at::kFloat).contiguous().sub_(m).div_(s);
}

}  // namespace imgtrain::data
