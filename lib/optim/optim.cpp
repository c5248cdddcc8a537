#include "optim/optim.h"

#include <torch/torch.h>

#include <cmath>

namespace imgtrain::optim {

std::vector<ParamGroup> weight_decay_groups(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            double weight_decay, const std::set<std::string>& skip_names) {
  ParamGroup no_decay, decay;
  decay.weight_decay = weight_decay;
  for (auto& [name, p] : named_params) {
    if (!p.requires_grad()) continue;
    bool skip = p.dim() <= 1 || (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) ||
                skip_names.count(name);
    auto& g = skip ? no_decay : decay;
    g.names.push_back(name);
    g.params.push_back(p);
  }
  std::vector<ParamGroup> out;
  if (!no_decay.params.empty()) out.push_back(std::move(no_decay));
  if (!decay.params.empty()) out.push_back(std::move(decay));
  return out;
}

void Optimizer::zero_grad() {
  for (auto& g : groups_)
    for (auto& p : g.params)
      if (p.grad().defined()) p.mutable_grad() = at::Tensor();  // set_to_none, as torch 2.x
}

double Optimizer::mean_lr() const {
  double s = 0;
  for (auto& g : groups_) s += g.lr;
  return groups_.empty() ? 0.0 : s / double(groups_.size());
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.lr = lr;
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& g : groups_)
    for (auto& n : g.names) {
      auto it = state_.find(n);
      if (it == state_.end()) continue;
      for (auto& [k, t] : it->second.buf) out.emplace_back(n + "." + k, t);
      if (it->second.step) out.emplace_back(n + ".step", torch::tensor(double(it->second.step), torch::kFloat64));
    }
  return out;
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& st) {
  state_.clear();
  for (auto& g : groups_)
    for (size_t i = 0; i < g.names.size(); ++i) {
      const std::string prefix = g.names[i] + ".";
      for (auto it = st.lower_bound(prefix); it != st.end() && it->first.rfind(prefix, 0) == 0; ++it) {
        const std::string key = it->first.substr(prefix.size());
        if (key.find('.') != std::string::npos) continue;  // another parameter's ("<param>.x.y")
        auto& ps = state_[g.names[i]];
        if (key == "step") ps.step = int64_t(it->second.item<double>());
        else ps.buf[key] = it->second.to(g.params[i].options()).clone();
      }
    }
}

namespace {

// torch.optim.SGD with dampening 0: buf = momentum * buf + g (buf = g on the first step);
// nesterov: update = g + momentum * buf, else update = buf.
class Sgd : public Optimizer {
 public:
  Sgd(std::vector<ParamGroup> g, double momentum, bool nesterov) : momentum_(momentum), nesterov_(nesterov) {
    groups_ = std::move(g);
  }
  void step() override {
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto d = p.grad();
      if (g.weight_decay != 0) d = d.add(p, g.weight_decay);
      if (momentum_ != 0) {
        auto& bufs = state_[name].buf;
        auto it = bufs.find("momentum_buffer");
        if (it == bufs.end()) it = bufs.emplace("momentum_buffer", d.clone()).first;
        else it->second.mul_(momentum_).add_(d);
        d = nesterov_ ? d.add(it->second, momentum_) : it->second;
      }
      p.add_(d, -g.lr);
    });
  }

 private:
  double momentum_;
  bool nesterov_;
};

// torch.optim.AdamW (decoupled weight decay, bias-corrected moments, amsgrad off); with
// decoupled = false it is torch.optim.Adam (L2 decay added to the gradient).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> g, double b1, double b2, double eps, bool decoupled)
      : b1_(b1), b2_(b2), eps_(eps), decoupled_(decoupled) {
    groups_ = std::move(g);
  }
  void step() override {
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto& s = state_[name];
      auto& m = s.buf["exp_avg"];
      auto& v = s.buf["exp_avg_sq"];
      if (!m.defined()) m = torch::zeros_like(p);
      if (!v.defined()) v = torch::zeros_like(p);
      s.step += 1;
      auto grad = p.grad();
      if (decoupled_) p.mul_(1.0 - g.lr * g.weight_decay);
      else if (g.weight_decay != 0) grad = grad.add(p, g.weight_decay);
      m.lerp_(grad, 1.0 - b1_);
      v.mul_(b2_).addcmul_(grad, grad, 1.0 - b2_);
      double bc1 = 1.0 - std::pow(b1_, s.step), bc2 = 1.0 - std::pow(b2_, s.step);
      auto denom = (v.sqrt() / std::sqrt(bc2)).add_(eps_);
      p.addcdiv_(m, denom, -g.lr / bc1);
    });
  }

 private:
  double b1_, b2_, eps_;
  bool decoupled_;
};

// timm's RMSpropTF (TensorFlow-style RMSprop): the square average starts at one, eps goes inside
// the square root, and the learning rate is applied inside the momentum buffer.
class RmspropTF : public Optimizer {
 public:
  RmspropTF(std::vector<ParamGroup> g, double alpha, double eps, double momentum)
      : alpha_(alpha), eps_(eps), momentum_(momentum) {
    groups_ = std::move(g);
  }
  void step() override {
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto& s = state_[name];
      auto& square_avg = s.buf["square_avg"];
      if (!square_avg.defined()) square_avg = torch::ones_like(p);  // TF starts at one, torch at zero
      s.step += 1;
      auto grad = p.grad();
      if (g.weight_decay != 0) grad = grad.add(p, g.weight_decay);
      square_avg.add_(grad.pow(2) - square_avg, 1.0 - alpha_);
      auto avg = square_avg.add(eps_).sqrt_();
      if (momentum_ > 0) {
        auto& buf = s.buf["momentum_buffer"];
        if (!buf.defined()) buf = torch::zeros_like(p);
        buf.mul_(momentum_).addcdiv_(grad, avg, g.lr);
        p.sub_(buf);
      } else {
        p.addcdiv_(grad, avg, -g.lr);
      }
    });
  }

 private:
  double alpha_, eps_, momentum_;
};

}  // namespace

std::unique_ptr<Optimizer> create_optimizer(const OptimizerArgs& a,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const std::set<std::string>& no_weight_decay) {
  auto groups = weight_decay_groups(named_params, a.weight_decay, no_weight_decay);
  for (auto& g : groups) g.lr = a.lr;
  if (a.opt == "sgd" || a.opt == "nesterov") return std::make_unique<Sgd>(std::move(groups), a.momentum, true);
  if (a.opt == "momentum") return std::make_unique<Sgd>(std::move(groups), a.momentum, false);
  if (a.opt == "adam" || a.opt == "adamw")
    return std::make_unique<AdamW>(std::move(groups), a.beta1, a.beta2, a.eps.value_or(1e-8), a.opt == "adamw");
  if (a.opt == "rmsproptf")
    return std::make_unique<RmspropTF>(std::move(groups), 0.9, a.eps.value_or(1e-10), a.momentum);
  throw std::invalid_argument("unknown optimizer '" + a.opt + "'");
}

double Scheduler::lr_at(int64_t t) const {
  if (t < a_.warmup_epochs)
    return a_.warmup_lr + double(t) * (a_.base_lr - a_.warmup_lr) / double(a_.warmup_epochs);
  if (a_.warmup_prefix) t -= a_.warmup_epochs;
  if (a_.sched == "step") return a_.base_lr * std::pow(a_.decay_rate, double(t / a_.decay_epochs));
  if (a_.sched == "multistep") {
    // timm's convention: milestone m applies from t == m - 1 (bisect_right(milestones, t + 1)).
    int64_t n = std::upper_bound(a_.decay_milestones.begin(), a_.decay_milestones.end(), t + 1) -
                a_.decay_milestones.begin();
    return a_.base_lr * std::pow(a_.decay_rate, double(n));
  }
  // cosine and poly, one cycle (cycle_mul 1, cycle_limit 1, k_decay 1): lr_min after it ends.
  if (t >= a_.epochs) return a_.min_lr;
  const double frac = double(t) / double(a_.epochs);
  if (a_.sched == "poly") return a_.min_lr + (a_.base_lr - a_.min_lr) * std::pow(1.0 - frac, a_.decay_rate);
  return a_.min_lr + 0.5 * (a_.base_lr - a_.min_lr) * (1.0 + std::cos(M_PI * frac));
}

int64_t Scheduler::num_epochs() const {
  if (a_.sched == "cosine" || a_.sched == "poly")
    return a_.epochs + (a_.warmup_prefix ? a_.warmup_epochs : 0) + a_.cooldown_epochs;
  return a_.epochs;
}

double scaled_lr(double lr_base, int64_t lr_base_size, const std::string& scale, const std::string& opt,
                 int64_t global_batch, std::string* used_scale) {
  std::string s = scale;
  if (s.empty()) s = (opt.find("ada") != std::string::npos || opt.find("lamb") != std::string::npos) ? "sqrt" : "linear";
  if (used_scale) *used_scale = s;
  double ratio = double(global_batch) / double(lr_base_size);
  if (s == "sqrt") ratio = std::sqrt(ratio);
  return lr_base * ratio;
}

}  // namespace imgtrain::optim
