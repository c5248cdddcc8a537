// The training losses timm's train.py picks: label-smoothed cross entropy, soft-target cross
// entropy (after mixup/cutmix), and binary cross entropy (--bce-loss) with smoothing and a target
// threshold. Targets are class indices [B] or soft targets [B, C].
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

namespace imgtrain::tasks {

struct LossConfig {
  double smoothing = 0.0;  // applied here only to index targets (mixup smooths its own targets)
  bool bce = false;
  std::optional<double> bce_target_thresh;
  bool bce_sum = false;
};

at::Tensor train_loss(const at::Tensor& logits, const at::Tensor& target, const LossConfig& c);

}  // namespace imgtrain::tasks
