// timm's ModelEmaV3: an exponential moving average of a model's whole state dict (float
// tensors lerped towards the model, others copied), updated once per optimizer update.
// decay(step) = 0 for the first update (a copy), then `decay`, or with warmup
// clamp(1 - (1 + s)^(-2/3), 0, decay) where s = step - 1.
#pragma once
#include <torch/nn/module.h>

#include <memory>

namespace imgtrain::engine {

class ModelEma {
 public:
  // `module` is a model of the same architecture; it is set to a copy of `model` now, and
  // follows that same `model` at every update (its tensors are looked up once, here).
  ModelEma(std::shared_ptr<torch::nn::Module> module, const torch::nn::Module& model, double decay, bool warmup,
           torch::Device device);
  double decay_at(int64_t step) const;
  void update(int64_t step);
  torch::nn::Module& module() { return *module_; }
  torch::Device device() const { return device_; }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  double decay_;
  bool warmup_;
  torch::Device device_;
  std::vector<at::Tensor> ema_float_, ema_other_;      // module_'s state tensors, in state-dict order
  std::vector<at::Tensor> model_float_, model_other_;  // the tracked model's, paired with them
};

}  // namespace imgtrain::engine
