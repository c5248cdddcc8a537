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
        auto it = buf_.find(name);
        if (it == buf_.end()) {
          it = buf_.emplace(name, d.clone()).first;
        } else {
          it->second.mul_(momentum_).add_(d);
        }
        d = nesterov_ ? d.add(it->second, momentum_) : it->second;
      }
      p.add_(d, -g.lr);
    });
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& g : groups_)
      for (auto& n : g.names)
        if (auto it = buf_.find(n); it != buf_.end()) out.emplace_back(n + ".momentum_buffer", it->second);
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& st) override {
    buf_.clear();
    for (auto& g : groups_)
      for (size_t i = 0; i < g.names.size(); ++i)
        if (auto it = st.find(g.names[i] + ".momentum_buffer"); it != st.end())
          buf_[g.names[i]] = it->second.to(g.params[i].device(), g.params[i].scalar_type()).clone();
  }

 private:
  double momentum_;
  bool nesterov_;
  std::map<std::string, at::Tensor> buf_;
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
      auto& s = st_[name];
      if (!s.m.defined()) {
        s.m = torch::zeros_like(p);
        s.v = torch::zeros_like(p);
      }
      s.step += 1;
      auto grad = p.grad();
      if (decoupled_) p.mul_(1.0 - g.lr * g.weight_decay);
      else if (g.weight_decay != 0) grad = grad.add(p, g.weight_decay);
      s.m.lerp_(grad, 1.0 - b1_);
      s.v.mul_(b2_).addcmul_(grad, grad, 1.0 - b2_);
      double bc1 = 1.0 - std::pow(b1_, s.step), bc2 = 1.0 - std::pow(b2_, s.step);
      auto denom = (s.v.sqrt() / std::sqrt(bc2)).add_(eps_);
      p.addcdiv_(s.m, denom, -g.lr / bc1);
    });
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& g : groups_)
      for (auto& n : g.names)
        if (auto it = st_.find(n); it != st_.end() && it->second.m.defined()) {
          out.emplace_back(n + ".exp_avg", it->second.m);
          out.emplace_back(n + ".exp_avg_sq", it->second.v);
          out.emplace_back(n + ".step", torch::tensor(double(it->second.step), torch::kFloat64));
        }
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& st) override {
    st_.clear();
    for (auto& g : groups_)
      for (size_t i = 0; i < g.names.size(); ++i) {
        auto m = st.find(g.names[i] + ".exp_avg"), v = st.find(g.names[i] + ".exp_avg_sq"),
             k = st.find(g.names[i] + ".step");
        if (m == st.end() || v == st.end() || k == st.end()) continue;
        auto& s = st_[g.names[i]];
        auto opts = g.params[i].options();
        s.m = m->second.to(opts).clone();
        s.v = v->second.to(opts).clone();
        s.step = int64_t(k->second.item<double>());
      }
  }

 private:
  struct State {
    at::Tensor m, v;
    int64_t step = 0;
  };
  double b1_, b2_, eps_;
  bool decoupled_;
  std::map<std::string, State> st_;
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
      auto& s = st_[name];
      if (!s.square_avg.defined()) {
        s.square_avg = torch::ones_like(p);
        if (momentum_ > 0) s.buf = torch::zeros_like(p);
      }
      s.step += 1;
      auto grad = p.grad();
      if (g.weight_decay != 0) grad = grad.add(p, g.weight_decay);
      s.square_avg.add_(grad.pow(2) - s.square_avg, 1.0 - alpha_);
      auto avg = s.square_avg.add(eps_).sqrt_();
      if (momentum_ > 0) {
        s.buf.mul_(momentum_).addcdiv_(grad, avg, g.lr);
        p.sub_(s.buf);
      } else {
        p.addcdiv_(grad, avg, -g.lr);
      }
    });
  }
  std::vector<std::pair<std::string, at::Tensor>> state() const override {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (auto& g : groups_)
      for (auto& n : g.names)
        if (auto it = st_.find(n); it != st_.end() && it->second.square_avg.defined()) {
          out.emplace_back(n + ".square_avg", it->second.square_avg);
          if (it->second.buf.defined()) out.emplace_back(n + ".momentum_buffer", it->second.buf);
          out.emplace_back(n + ".step", torch::tensor(double(it->second.step), torch::kFloat64));
        }
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& st) override {
    st_.clear();
    for (auto& g : groups_)
      for (size_t i = 0; i < g.names.size(); ++i) {
        auto sq = st.find(g.names[i] + ".square_avg"), k = st.find(g.names[i] + ".step");
        if (sq == st.end() || k == st.end()) continue;
        auto& s = st_[g.names[i]];
        auto opts = g.params[i].options();
        s.square_avg = sq->second.to(opts).clone();
        if (auto b = st.find(g.names[i] + ".momentum_buffer"); b != st.end()) s.buf = b->second.to(opts).clone();
        else if (momentum_ > 0) s.buf = torch::zeros_like(g.params[i]);
        s.step = int64_t(k->second.item<double>());
      }
  }

 private:
  struct State {
    at::Tensor square_avg, buf;
    int64_t step = 0;
  };
  double alpha_, eps_, momentum_;
  std::map<std::string, State> st_;
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
