// The BatchNorm2d every model of the zoo uses: torch's, plus an optional synchronisation hook.
// --sync-bn sets the hook on every instance (dist::convert_sync_batchnorm) and training-mode
// forwards then take their statistics over all ranks (torch.nn.SyncBatchNorm's semantics). The
// type stays a torch::nn::BatchNorm2dImpl, so names, state dicts and `as<>` checks are unchanged,
// and no module needs to be swapped inside its parent (LibTorch holders cannot be re-pointed).
#pragma once
#include <torch/nn/modules/batchnorm.h>

#include <memory>

namespace imgtrain {

class SyncBatchNormHook {
 public:
  virtual ~SyncBatchNormHook() = default;
  // Training-mode forward of `bn` on `x` with statistics from every rank; updates the running
  // statistics as torch's SyncBatchNorm does.
  virtual at::Tensor forward(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x) = 0;
};

class BatchNorm2dImpl : public torch::nn::BatchNorm2dImpl {
 public:
  explicit BatchNorm2dImpl(int64_t num_features) : torch::nn::BatchNorm2dImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit BatchNorm2dImpl(const torch::nn::BatchNormOptions& o) : torch::nn::BatchNorm2dImpl(o) {}
  at::Tensor forward(const at::Tensor& x) {
    if (sync && is_training()) return sync->forward(*this, x);
    return torch::nn::BatchNorm2dImpl::forward(x);
  }
  std::shared_ptr<SyncBatchNormHook> sync;
};
TORCH_MODULE(BatchNorm2d);

}  // namespace imgtrain
