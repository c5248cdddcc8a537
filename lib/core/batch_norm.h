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

// A module with a fused training path (one kernel or autograd function in place of several
// modules), switched on and off for a whole model by set_training_fusion.
struct TrainingFusion {
  virtual ~TrainingFusion() = default;
  bool fuse_train = false;
};

// A module with a fused inference path (oneDNN post-ops in place of separate ops), switched on and
// off for a whole model by set_inference_fusion; used only in eval mode without autograd.
struct InferenceFusion {
  virtual ~InferenceFusion() = default;
  bool fuse_infer = false;
};

class BatchNorm2dImpl : public torch::nn::BatchNorm2dImpl, public TrainingFusion {
 public:
  explicit BatchNorm2dImpl(int64_t num_features) : torch::nn::BatchNorm2dImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit BatchNorm2dImpl(const torch::nn::BatchNormOptions& o) : torch::nn::BatchNorm2dImpl(o) {}
  at::Tensor forward(const at::Tensor& x) {
    if (frozen) return frozen_forward(x);
    if (sync && is_training()) return sync->forward(*this, x);
    return torch::nn::BatchNorm2dImpl::forward(x);
  }
  // torchvision's FrozenBatchNorm2d (detection backbones started from weights): the statistics and
  // affine are constants, applied as x * scale + shift with scale = w * rsqrt(var + eps), in
  // training too. Set with freeze(), which also stops the weight and bias from being trained.
  void freeze(double eps) {
    frozen = true;
    frozen_eps = eps;
    if (weight.defined()) weight.requires_grad_(false);
    if (bias.defined()) bias.requires_grad_(false);
  }
  at::Tensor frozen_forward(const at::Tensor& x) const {
    auto scale = weight.reshape({1, -1, 1, 1}) * (running_var.reshape({1, -1, 1, 1}) + frozen_eps).rsqrt();
    auto shift = bias.reshape({1, -1, 1, 1}) - running_mean.reshape({1, -1, 1, 1}) * scale;
    return x * scale + shift;
  }
  std::shared_ptr<SyncBatchNormHook> sync;
  bool frozen = false;
  double frozen_eps = 1e-5;
  // Inference fusion (set_inference_fusion): eval-mode forwards without autograd that go through
  // model_zoo's conv_bn_act fold this BatchNorm into the convolution before it. The folded
  // convolution weights are cached here on first use and dropped by set_inference_fusion, so the
  // model's weights must not change while it is on.
  bool fuse_inference = false;
  at::Tensor folded_weight, folded_bias;
  at::Tensor winograd_weight;  // the folded weight as Winograd's U (ops/winograd.h), where the conv takes it
  // Training fusion (fuse_train, set_training_fusion): training-mode forwards through conv_bn_act
  // run this BatchNorm, the residual add and the activation after it as one kernel
  // (ops::batch_norm_act_train; float32 CPU; other inputs take the modules).
};
TORCH_MODULE(BatchNorm2d);

// Turns inference fusion on or off for every BatchNorm2d of `model` and drops the folded caches
// (validate --fuse-bn, benchmark's inference). Training-mode forwards and forwards that record
// autograd never fuse, so a model can be trained after this without effect on the gradients.
inline void set_inference_fusion(torch::nn::Module& model, bool on) {
  for (auto& m : model.modules(/*include_self=*/true)) {
    if (auto* bn = dynamic_cast<BatchNorm2dImpl*>(m.get())) {
      bn->fuse_inference = on;
      bn->folded_weight = at::Tensor();
      bn->folded_bias = at::Tensor();
      bn->winograd_weight = at::Tensor();
    }
    if (auto* f = dynamic_cast<InferenceFusion*>(m.get())) f->fuse_infer = on;
  }
}

// Turns training fusion on or off for every module of `model` that has one (BatchNorm2d with its
// activation, squeeze-and-excite; train and benchmark --bench train with --fuse-bn). A frozen
// BatchNorm is folded into the convolution before it instead (model_zoo's conv_bn_act); synchronised
// BatchNorms never fuse.
inline void set_training_fusion(torch::nn::Module& model, bool on) {
  for (auto& m : model.modules(/*include_self=*/true))
    if (auto* f = dynamic_cast<TrainingFusion*>(m.get())) f->fuse_train = on;
}

}  // namespace imgtrain
