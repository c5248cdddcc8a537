// Detection ops with torchvision.ops' semantics and numbers: box_area, box_iou, nms, batched_nms,
// roi_align (forward and backward through autograd). CPU kernels, and CUDA kernels for CUDA
// tensors when the build has the CUDA path (ops_cuda.cu: the same arithmetic per output; NMS's
// greedy pass on the host, as torchvision's; RoIAlign's backward sums with atomics, so under
// deterministic algorithms it runs the host kernel). Without the CUDA path, CUDA tensors go
// through the host kernels (a copy each way).
// Under autocast they run in float32 and give roi_align's result back in the input's dtype, as
// torchvision's autocast wrappers do.
#pragma once
#include <ATen/core/Tensor.h>

#include <vector>

namespace imgtrain::ops {

// (x2 - x1) * (y2 - y1) of [N, 4] x1y1x2y2 boxes (half precision upcast to float, as torchvision).
at::Tensor box_area(const at::Tensor& boxes);
// [N, M] IoU of two sets of x1y1x2y2 boxes.
at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2);

// Indices (int64, by decreasing score; ties in score keep their input order) of the boxes kept
// after suppressing every box whose IoU with a kept, higher-scored box is > iou_threshold.
at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold);
// NMS within each category `idxs`: torchvision's coordinate-offset trick for up to 4,000 box
// values on the CPU, a loop over categories above (its _batched_nms_vanilla), the same choice.
at::Tensor batched_nms(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
                       double iou_threshold);

// RoIAlign (Mask R-CNN; aligned = true is Detectron2's ROIAlignV2): input [N, C, H, W], rois
// [K, 5] (batch index, x1, y1, x2, y2) in input coordinates before spatial_scale; output
// [K, C, pooled_h, pooled_w]. sampling_ratio <= 0: ceil(roi size / pooled size) samples per bin.
at::Tensor roi_align(const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_h,
                     int64_t pooled_w, int64_t sampling_ratio, bool aligned);
// MultiScaleRoIAlign's pooling: RoI k (rois as above) pooled from feats[levels[k]] at scales[levels[k]]
// into row k of one [K, C, pooled_h, pooled_w] output, the same numbers as roi_align level by level;
// one autograd node (no zero-filled result scattered into per level, no per-level gradient copies).
at::Tensor multiscale_roi_align(at::TensorList feats, const at::Tensor& rois, const at::Tensor& levels,
                                const std::vector<double>& scales, int64_t pooled_h, int64_t pooled_w,
                                int64_t sampling_ratio, bool aligned);

}  // namespace imgtrain::ops
