// Mixed precision as timm runs it: autocast over forward and loss (torch.autocast), and for
// float16 a loss scaler with torch.amp.GradScaler's semantics (init 2^16, growth 2 every 2000
// finite updates, backoff 0.5 on a non-finite gradient, whose step is skipped), or a static
// scale (--loss-scale N: never changes, non-finite steps still skipped).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::engine {

// RAII: autocast on `device` to `dtype` while alive (no-op when disabled).
class AutocastScope {
 public:
  AutocastScope(bool enabled, c10::DeviceType device, at::ScalarType dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool enabled_;
  c10::DeviceType device_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

class LossScaler {
 public:
  // dynamic: GradScaler; otherwise a static scale of `init_scale`.
  LossScaler(double init_scale, bool dynamic, c10::Device device, double growth = 2.0, double backoff = 0.5,
             int64_t interval = 2000);
  at::Tensor scale(const at::Tensor& loss) const { return loss * scale_; }
  // Unscales the gradients of `params` in place; returns false when any is inf or NaN.
  bool unscale(const std::vector<at::Tensor>& params);
  // After the optimizer step (or its skip): the dynamic scale grows or backs off.
  void update();
  double value() const;
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::map<std::string, at::Tensor>& st);

 private:
  at::Tensor scale_, growth_tracker_, found_inf_;
  bool dynamic_;
  double growth_, backoff_;
  int64_t interval_;
};

// apex O2: the model's weights and buffers in half precision except BatchNorm's (kept float32,
// as apex's keep_batchnorm_fp32), and a float32 master copy of every parameter that the
// optimizer updates: gradients move to the masters (where they are unscaled and clipped), the
// step updates the masters, and the model gets the rounded result.
class MasterWeights {
 public:
  MasterWeights(torch::nn::Module& model, at::ScalarType half);
  // The masters under the model's parameter names (build the optimizer on these).
  const std::vector<std::pair<std::string, at::Tensor>>& named_masters() const { return named_; }
  std::vector<at::Tensor> masters() const;
  void grads_to_masters();  // master.grad = float(model.grad); model grads cleared
  void masters_to_model();  // model = half(master), after a step
  at::ScalarType dtype() const { return half_; }

 private:
  at::ScalarType half_;
  std::vector<at::Tensor> model_params_;
  std::vector<std::pair<std::string, at::Tensor>> named_;
};

}  // namespace imgtrain::engine
