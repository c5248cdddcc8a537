// The prefetcher's job on the training device: uint8 NHWC batches become float NCHW tensors,
// normalised as (x - 255 mean) / (255 std). On CUDA one fused kernel does the layout change (or
// keeps NHWC order for channels-last), the conversion and the normalisation in a single pass; on
// the CPU ATen ops do it.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace imgtrain::data {

// `nhwc` is uint8 [N, H, W, C] on any device; mean/std per channel in [0, 1] units. The result is
// [N, C, H, W], in channels-last memory when asked (made so by the same pass, not a second copy).
// Arithmetic: (x - float(mean) * 255) / (float(std) * 255) in float32 everywhere, as timm's prefetcher.
at::Tensor normalize_nhwc_u8(const at::Tensor& nhwc, const std::vector<double>& mean, const std::vector<double>& std,
                             bool channels_last = false);

// True when this build compiled the CUDA kernel (IMGTRAIN_CUDA on, nvcc present).
bool normalize_has_cuda_kernel();

}  // namespace imgtrain::data
