#include "tasks/classification/loss.h"

#include <torch/torch.h>

namespace imgtrain::tasks {

at::Tensor train_loss(const at::Tensor& logits, const at::Tensor& target, const LossConfig& c) {
  namespace F = torch::nn::functional;
  const bool dense = target.dim() == 2;
  if (c.bce) {
    at::Tensor t = target;
    if (!dense) {  // timm BinaryCrossEntropy: smoothed one-hot
      const int64_t k = logits.size(-1);
      const double off = c.smoothing / double(k), on = 1.0 - c.smoothing + off;
      t = torch::full(logits.sizes(), off, logits.options()).scatter_(1, target.view({-1, 1}), on);
    }
    t = t.to(logits.dtype());
    if (c.bce_target_thresh) t = t.gt(*c.bce_target_thresh).to(logits.dtype());
    if (c.bce_sum)
      return F::binary_cross_entropy_with_logits(logits, t, F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kNone))
          .sum(-1)
          .mean();
    return F::binary_cross_entropy_with_logits(logits, t);
  }
  if (dense) return (-target * torch::log_softmax(logits, -1)).sum(-1).mean();  // SoftTargetCrossEntropy
  return F::cross_entropy(logits, target, F::CrossEntropyFuncOptions().label_smoothing(c.smoothing));
}

}  // namespace imgtrain::tasks
