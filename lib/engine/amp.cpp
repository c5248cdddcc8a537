#include "engine/amp.h"

#include "core/error.h"

#include <ATen/autocast_mode.h>
#include <cmath>
#include <fmt/format.h>
#include <torch/torch.h>

namespace imgtrain::engine {

AutocastScope::AutocastScope(bool enabled, c10::DeviceType device, at::ScalarType dtype)
    : enabled_(enabled), device_(device) {
  if (!enabled_) return;
  prev_enabled_ = at::autocast::is_autocast_enabled(device_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!enabled_) return;
  // As torch.autocast's __exit__: the weight-cast cache lives only for the outermost region.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
}

LossScaler::LossScaler(double init_scale, bool dynamic, c10::Device device, double growth, double backoff,
                       int64_t interval)
    : dynamic_(dynamic), growth_(growth), backoff_(backoff), interval_(interval) {
  auto f = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  scale_ = torch::full({}, init_scale, f);
  growth_tracker_ = torch::zeros({}, f.dtype(torch::kInt32));
  found_inf_ = torch::zeros({}, f);
}

bool LossScaler::unscale(const std::vector<at::Tensor>& params) {
  torch::NoGradGuard ng;
  found_inf_.zero_();
  auto inv = scale_.to(torch::kDouble).reciprocal().to(torch::kFloat32);
  // The fused kernel wants one device and dtype per call; each group flags into its own tensor.
  std::map<std::pair<std::string, int>, std::vector<at::Tensor>> groups;
  for (auto& p : params)
    if (p.grad().defined()) groups[{p.grad().device().str(), int(p.grad().scalar_type())}].push_back(p.grad());
  for (auto& [key, grads] : groups) {
    const auto dev = grads.front().device();
    auto fi = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(dev));
    at::_amp_foreach_non_finite_check_and_unscale_(grads, fi, inv.to(dev));
    found_inf_.add_(fi.to(found_inf_.device()));
  }
  return found_inf_.item<float>() == 0.0f;
}

void LossScaler::update() {
  if (!dynamic_) return;
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, growth_, backoff_, interval_);
}

double LossScaler::value() const { return scale_.item<double>(); }

std::vector<std::pair<std::string, at::Tensor>> LossScaler::state() const {
  return {{"scale", scale_}, {"growth_tracker", growth_tracker_}};
}

void LossScaler::load_state(const std::map<std::string, at::Tensor>& st) {
  torch::NoGradGuard ng;
  auto one_value = [&](const char* key, bool positive) -> const at::Tensor* {
    auto it = st.find(key);
    if (it == st.end()) return nullptr;
    const at::Tensor& t = it->second;
    const double v = t.numel() == 1 ? t.to(at::kDouble).item<double>() : std::nan("");
    if (!std::isfinite(v) || v < 0 || (positive && v == 0))
      throw UserError(fmt::format("loss scaler state 'scaler.{}' is not a {} number ({} values{})", key,
                                  positive ? "positive" : "non-negative", t.numel(),
                                  t.numel() == 1 ? fmt::format(", {}", v) : ""));
    return &t;
  };
  if (auto* t = one_value("scale", true)) scale_.copy_(t->reshape_as(scale_));
  if (auto* t = one_value("growth_tracker", false)) growth_tracker_.copy_(t->reshape_as(growth_tracker_));
}

MasterWeights::MasterWeights(torch::nn::Module& model, at::ScalarType half) : half_(half) {
  torch::NoGradGuard ng;
  for (auto& m : model.modules(/*include_self=*/true)) {
    if (m->as<torch::nn::BatchNorm2dImpl>()) continue;
    for (auto& p : m->parameters(/*recurse=*/false)) p.set_data(p.data().to(half));
    for (auto& b : m->buffers(/*recurse=*/false))
      if (b.is_floating_point()) b.set_data(b.data().to(half));
  }
  for (auto& p : model.named_parameters()) {
    model_params_.push_back(p.value());
    // leaves that "require grad" so that optimizers take them, though autograd never runs on them
    named_.emplace_back(p.key(), p.value().detach().to(torch::kFloat32).clone().requires_grad_(p.value().requires_grad()));
  }
}

std::vector<at::Tensor> MasterWeights::masters() const {
  std::vector<at::Tensor> v;
  for (auto& [n, t] : named_) v.push_back(t);
  return v;
}

void MasterWeights::grads_to_masters() {
  for (size_t i = 0; i < model_params_.size(); ++i) {
    auto& g = model_params_[i].mutable_grad();
    if (!g.defined()) continue;
    named_[i].second.mutable_grad() = g.to(torch::kFloat32);
    g = at::Tensor();
  }
}

void MasterWeights::masters_to_model() {
  torch::NoGradGuard ng;
  for (size_t i = 0; i < model_params_.size(); ++i) model_params_[i].copy_(named_[i].second);
}

}  // namespace imgtrain::engine
