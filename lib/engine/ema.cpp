#include "engine/ema.h"

#include "io/weights.h"

#include <torch/torch.h>

#include <cmath>

namespace imgtrain::engine {

ModelEma::ModelEma(std::shared_ptr<torch::nn::Module> module, const torch::nn::Module& model, double decay, bool warmup,
                   torch::Device device)
    : module_(std::move(module)), decay_(decay), warmup_(warmup), device_(device) {
  module_->to(device_);
  module_->eval();
  for (auto& p : module_->parameters()) p.set_requires_grad(false);
  torch::NoGradGuard ng;
  auto src = io::state_dict(model);
  auto dst = io::state_dict(*module_);
  TORCH_CHECK(src.size() == dst.size(), "EMA module does not match the model");
  for (size_t i = 0; i < dst.size(); ++i) {
    TORCH_CHECK(src[i].first == dst[i].first, "EMA module does not match the model at ", src[i].first);
    dst[i].second.copy_(src[i].second);
    const bool fp = dst[i].second.is_floating_point();
    (fp ? ema_float_ : ema_other_).push_back(dst[i].second);
    (fp ? model_float_ : model_other_).push_back(src[i].second);
  }
}

double ModelEma::decay_at(int64_t step) const {
  const int64_t s = std::max<int64_t>(0, step - 1);
  if (s <= 0) return 0.0;
  if (!warmup_) return decay_;
  const double d = 1.0 - std::pow(1.0 + double(s), -2.0 / 3.0);
  return std::max(std::min(d, decay_), 0.0);
}

void ModelEma::update(int64_t step) {
  torch::NoGradGuard ng;
  const double w = 1.0 - decay_at(step);
  for (size_t i = 0; i < ema_other_.size(); ++i) ema_other_[i].copy_(model_other_[i]);
  if (model_float_.empty()) return;
  const auto& first = model_float_.front();
  if (device_ == first.device() && first.scalar_type() == ema_float_.front().scalar_type()) {
    at::_foreach_lerp_(ema_float_, model_float_, w);
  } else {  // --model-ema-force-cpu, or an O2 model whose half weights the float32 EMA follows
    std::vector<at::Tensor> src;
    for (size_t i = 0; i < model_float_.size(); ++i) src.push_back(model_float_[i].to(device_, ema_float_[i].scalar_type()));
    at::_foreach_lerp_(ema_float_, src, w);
  }
}

}  // namespace imgtrain::engine
