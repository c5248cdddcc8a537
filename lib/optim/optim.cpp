#include "optim/optim.h"

#include "core/error.h"
#include "ops/optim_step.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <regex>

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

std::map<std::string, int64_t> layer_ids(const std::vector<std::string>& names, const std::vector<GroupRule>& rules) {
  constexpr double kPrev = 99999;  // timm's MATCH_PREV_GROUP
  std::vector<std::regex> compiled;
  for (auto& r : rules) compiled.emplace_back(r.regex, std::regex::ECMAScript);
  std::map<std::vector<double>, std::vector<std::string>> grouping;  // sorted like Python tuples
  for (auto& n : names) {
    std::vector<double> key{std::numeric_limits<double>::infinity()};
    for (size_t i = 0; i < rules.size(); ++i) {
      std::smatch m;
      if (!std::regex_search(n, m, compiled[i], std::regex_constants::match_continuous)) continue;
      key = {double(rules[i].ordinal)};
      for (size_t g = 1; g < m.size(); ++g)
        if (m[g].matched) key.push_back(std::stod(m[g].str()));
      key.insert(key.end(), rules[i].suffix.begin(), rules[i].suffix.end());
      break;
    }
    grouping[key].push_back(n);
  }
  std::map<std::string, int64_t> out;
  int64_t lid = -1;
  for (auto& [key, members] : grouping) {
    if (lid < 0 || key.back() != kPrev) ++lid;
    for (auto& n : members) out[n] = lid;
  }
  return out;
}

std::vector<ParamGroup> layer_decay_groups(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                           double weight_decay, const std::set<std::string>& skip,
                                           const std::vector<GroupRule>& rules, double layer_decay,
                                           double min_scale) {
  std::vector<std::string> names;
  for (auto& [n, p] : named_params) names.push_back(n);
  auto ids = layer_ids(names, rules);
  int64_t layer_max = 0;
  for (auto& [n, id] : ids) layer_max = std::max(layer_max, id);
  std::vector<ParamGroup> groups;
  std::map<std::pair<int64_t, bool>, size_t> index;
  for (auto& [name, p] : named_params) {
    if (!p.requires_grad()) continue;
    const bool no_decay = p.dim() <= 1 || skip.count(name);
    const int64_t id = ids.count(name) ? ids[name] : layer_max;
    auto [it, fresh] = index.emplace(std::pair{id, no_decay}, groups.size());
    if (fresh) {
      ParamGroup g;
      g.weight_decay = no_decay ? 0.0 : weight_decay;
      g.lr_scale = std::max(min_scale, std::pow(layer_decay, double(layer_max - id)));
      groups.push_back(std::move(g));
    }
    groups[it->second].names.push_back(name);
    groups[it->second].params.push_back(p);
  }
  return groups;
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (!p.grad().defined()) continue;
      if (set_to_none) p.mutable_grad() = at::Tensor();
      else {  // as torch's Optimizer.zero_grad(set_to_none=False)
        auto& grad = p.mutable_grad();
        if (grad.grad_fn()) grad.detach_();
        else grad.requires_grad_(false);
        grad.zero_();
      }
    }
}

double Optimizer::mean_lr() const {
  double s = 0;
  for (auto& g : groups_) s += g.lr;
  return groups_.empty() ? 0.0 : s / double(groups_.size());
}

void Optimizer::set_lr(double lr) {
  for (auto& g : groups_) g.lr = lr * g.lr_scale;
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
        // every buffer of these optimizers has its parameter's shape; a file that says otherwise,
        // or holds NaN, is damaged or another model's, and is said so by name before any step
        const at::Tensor& t = it->second;
        const std::string what = fmt::format("optimizer state '{}'", it->first);
        if (!t.is_floating_point() && key != "step")
          throw UserError(fmt::format("{} is {}, not floating point", what, c10::toString(t.scalar_type())));
        if (t.is_floating_point() && !at::isfinite(t).all().item<bool>())
          throw UserError(fmt::format("{} holds NaN or infinite values", what));
        if ((key == "exp_avg_sq" || key == "square_avg") && (t < 0).any().item<bool>())
          throw UserError(fmt::format("{} holds negative values (a running average of squares cannot)", what));
        auto& ps = state_[g.names[i]];
        if (key == "step") {
          const double v = t.numel() == 1 ? t.to(at::kDouble).item<double>() : -1.0;
          if (!(v >= 0 && v <= 9.0e15 && v == std::floor(v)))
            throw UserError(fmt::format("{} is not a step count ({} values{})", what, t.numel(),
                                        t.numel() == 1 ? fmt::format(", {}", v) : ""));
          ps.step = int64_t(v);
        } else {
          if (t.sizes() != g.params[i].sizes())
            throw UserError(fmt::format("{} has shape {}, but the parameter '{}' has {} (not this model's optimizer "
                                        "state)",
                                        what, fmt::join(t.sizes(), "x"), g.names[i], fmt::join(g.params[i].sizes(), "x")));
          // in the parameter's layout (a channels-last weight's state comes back from the file
          // contiguous): the fused steps need it, and LAMB's norms sum in memory order, so a
          // resumed run is bitwise the run that saved it only with the saved run's layout
          auto b = at::empty_like(g.params[i]);
          b.copy_(t);
          ps.buf[key] = b;
        }
      }
    }
}

namespace {

// Whether a parameter can go to ATen's fused / multi-tensor kernels: a dense floating-point
// tensor on the CPU or a GPU whose gradient and state tensors (undefined ones aside) have its
// dtype, device, sizes and strides. The fused kernels index every tensor of a parameter with the
// same offsets: a channels-last weight with a contiguous gradient silently gets a wrong update.
bool kernel_ready(const at::Tensor& p, std::initializer_list<at::Tensor> others) {
  if (!p.is_floating_point() || p.layout() != at::kStrided || !p.is_non_overlapping_and_dense() ||
      !(p.device().is_cpu() || p.device().is_cuda()))
    return false;
  for (auto& t : others)
    if (t.defined() && (t.layout() != at::kStrided || t.scalar_type() != p.scalar_type() ||
                        t.device() != p.device() || t.sizes() != p.sizes() || t.strides() != p.strides()))
      return false;
  return true;
}

// Tensors for one kernel call: ATen's multi-tensor kernels take one device and dtype per call.
struct Bucket {
  at::Device device;
  at::ScalarType dtype;
  bool flag;  // a per-call switch (SGD: first step of the momentum buffers)
  std::vector<at::Tensor> params, grads, a, b;
  std::vector<int64_t> steps;
};
Bucket& bucket_for(std::vector<Bucket>& buckets, const at::Tensor& p, bool flag = false) {
  for (auto& b : buckets)
    if (b.device == p.device() && b.dtype == p.scalar_type() && b.flag == flag) return b;
  buckets.push_back(Bucket{p.device(), p.scalar_type(), flag, {}, {}, {}, {}, {}});
  return buckets.back();
}

// A dense tensor's elements in memory order, [begin, end).
at::Tensor flat(const at::Tensor& t, int64_t begin, int64_t end) {
  return t.as_strided({end - begin}, {1}, t.storage_offset() + begin);
}

// torch.optim.SGD with dampening 0: buf = momentum * buf + g (buf = g on the first step);
// nesterov: update = g + momentum * buf, else update = buf. Steps through ATen's _fused_sgd_
// (unless impl is "loop"). Its vectorised body computes exactly the loop's arithmetic, its scalar
// tail does not (an ulp apart on the last elements of a tensor), so each tensor's whole 128-byte
// blocks go to the kernel and the few elements after them take the loop's operations: bitwise
// the loop on the CPU (tested), one pass over memory instead of five.
class Sgd : public Optimizer {
 public:
  Sgd(std::vector<ParamGroup> g, double momentum, bool nesterov, std::string impl)
      : momentum_(momentum), nesterov_(nesterov), impl_(std::move(impl)) {
    groups_ = std::move(g);
  }
  void step() override {
    torch::NoGradGuard ng;
    for (auto& g : groups_) {
      std::vector<Bucket> buckets;
      for (size_t i = 0; i < g.params.size(); ++i) {
        auto& p = g.params[i];
        const auto& grad = p.grad();
        if (!grad.defined()) continue;
        at::Tensor buf;
        if (momentum_ != 0) {
          auto& bufs = state_[g.names[i]].buf;
          if (auto it = bufs.find("momentum_buffer"); it != bufs.end()) buf = it->second;
        }
        if (impl_ == "loop" || !kernel_ready(p, {grad, buf})) {
          loop_step(g, g.names[i], p);
          continue;
        }
        const bool first = momentum_ != 0 && !buf.defined();
        if (first) {
          buf = at::empty_like(p);  // same strides: p is dense; filled below
          if (!kernel_ready(p, {buf})) {
            loop_step(g, g.names[i], p);
            continue;
          }
          state_[g.names[i]].buf["momentum_buffer"] = buf;
        }
        const int64_t n = p.numel(), unit = 128 / int64_t(p.element_size());
        const int64_t whole = impl_ == "fused" ? n : n - n % unit;  // "fused": all of it to the kernel
        if (whole > 0) {
          auto& b = bucket_for(buckets, p, first);
          b.params.push_back(flat(p, 0, whole));
          b.grads.push_back(flat(grad, 0, whole));
          if (momentum_ != 0) b.a.push_back(flat(buf, 0, whole));
        }
        if (whole < n)
          tail_step(flat(p, whole, n), flat(grad, whole, n), momentum_ != 0 ? flat(buf, whole, n) : at::Tensor(), first,
                    g.weight_decay, g.lr);
      }
      for (auto& b : buckets)
        at::_fused_sgd_(b.params, b.grads, b.a, g.weight_decay, momentum_, g.lr, /*dampening=*/0.0, nesterov_,
                        /*maximize=*/false, /*is_first_step=*/b.flag);
    }
  }

 protected:
  void loop_step(const ParamGroup& g, const std::string& name, at::Tensor& p) {
    auto d = p.grad();
    if (g.weight_decay != 0) d = d.add(p, g.weight_decay);
    momentum_step(g, name, p, d);
  }
  // The loop's arithmetic on given tensors (buf: filled on the first step).
  void tail_step(at::Tensor p, const at::Tensor& grad, at::Tensor buf, bool first, double wd, double lr) {
    auto d = wd != 0 ? grad.add(p, wd) : grad;
    if (momentum_ != 0) {
      if (first) buf.copy_(d);
      else buf.mul_(momentum_).add_(d);
      d = nesterov_ ? d.add(buf, momentum_) : buf;
    }
    p.add_(d, -lr);
  }
  // p -= lr * (d through the momentum buffer), the part SGD and LARS share.
  void momentum_step(const ParamGroup& g, const std::string& name, at::Tensor& p, at::Tensor d) {
    if (momentum_ != 0) {
      auto& bufs = state_[name].buf;
      auto it = bufs.find("momentum_buffer");
      if (it == bufs.end()) it = bufs.emplace("momentum_buffer", d.clone()).first;
      else it->second.mul_(momentum_).add_(d);
      d = nesterov_ ? d.add(it->second, momentum_) : it->second;
    }
    p.add_(d, -g.lr);
  }

  double momentum_;
  bool nesterov_;

 private:
  std::string impl_;
};

// |w| / |u|-style trust ratio, 1 where either norm is zero (timm's nested torch.where).
at::Tensor trust_or_one(const at::Tensor& ratio, const at::Tensor& w_norm, const at::Tensor& g_norm) {
  auto one = torch::ones_like(w_norm);
  return torch::where(w_norm > 0, torch::where(g_norm > 0, ratio, one), one);
}

// torch.optim.AdamW (decoupled weight decay, bias-corrected moments, amsgrad off); with
// decoupled = false it is torch.optim.Adam (L2 decay added to the gradient). Three ways to step,
// as torch.optim's: a per-parameter loop, multi-tensor _foreach_ ops (the same arithmetic,
// bitwise equal), and ATen's fused kernel (one pass, within a rounding of the others).
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> g, double b1, double b2, double eps, bool decoupled, std::string impl)
      : b1_(b1), b2_(b2), eps_(eps), decoupled_(decoupled), impl_(std::move(impl)) {
    groups_ = std::move(g);
  }
  void step() override {
    torch::NoGradGuard ng;
    for (auto& g : groups_) {
      std::vector<Bucket> buckets;
      for (size_t i = 0; i < g.params.size(); ++i) {
        auto& p = g.params[i];
        const auto& grad = p.grad();
        if (!grad.defined()) continue;
        auto& s = state_[g.names[i]];
        auto& m = s.buf["exp_avg"];
        auto& v = s.buf["exp_avg_sq"];
        if (!m.defined()) m = torch::zeros_like(p);
        if (!v.defined()) v = torch::zeros_like(p);
        s.step += 1;
        const std::string how = impl_ == "auto" ? (p.device().is_cuda() ? "foreach" : "loop") : impl_;
        if (how == "loop" || !kernel_ready(p, {grad, m, v})) {
          loop_step(g, p, m, v, s.step);
          continue;
        }
        auto& b = bucket_for(buckets, p, how == "fused");
        b.params.push_back(p);
        b.grads.push_back(grad);
        b.a.push_back(m);
        b.b.push_back(v);
        b.steps.push_back(s.step);
      }
      for (auto& b : buckets) b.flag ? fused_step(g, b) : foreach_step(g, b);
    }
  }

 private:
  void loop_step(const ParamGroup& g, at::Tensor& p, at::Tensor& m, at::Tensor& v, int64_t step) {
    auto grad = p.grad();
    if (decoupled_) p.mul_(1.0 - g.lr * g.weight_decay);
    else if (g.weight_decay != 0) grad = grad.add(p, g.weight_decay);
    m.lerp_(grad, 1.0 - b1_);
    v.mul_(b2_).addcmul_(grad, grad, 1.0 - b2_);
    double bc1 = 1.0 - std::pow(b1_, step), bc2 = 1.0 - std::pow(b2_, step);
    auto denom = (v.sqrt() / std::sqrt(bc2)).add_(eps_);
    p.addcdiv_(m, denom, -g.lr / bc1);
  }
  // torch.optim's _multi_tensor_adam (not capturable): the loop's operations over the lists.
  void foreach_step(const ParamGroup& g, Bucket& b) {
    std::vector<at::Tensor> grads = b.grads;
    if (decoupled_) at::_foreach_mul_(b.params, 1.0 - g.lr * g.weight_decay);
    else if (g.weight_decay != 0) grads = at::_foreach_add(b.grads, b.params, g.weight_decay);
    at::_foreach_lerp_(b.a, grads, 1.0 - b1_);
    at::_foreach_mul_(b.b, b2_);
    at::_foreach_addcmul_(b.b, grads, grads, 1.0 - b2_);
    std::vector<at::Scalar> step_size, bc2_sqrt;
    for (auto t : b.steps) {
      step_size.emplace_back(-g.lr / (1.0 - std::pow(b1_, double(t))));
      bc2_sqrt.emplace_back(std::sqrt(1.0 - std::pow(b2_, double(t))));
    }
    auto denom = at::_foreach_sqrt(b.b);
    at::_foreach_div_(denom, bc2_sqrt);
    at::_foreach_add_(denom, eps_);
    at::_foreach_addcdiv_(b.params, b.a, denom, step_size);
  }
  // ATen's _fused_adam(w)_: step counts as float32 scalars on the parameters' device (one tensor
  // per distinct count; the kernel only reads them).
  void fused_step(const ParamGroup& g, Bucket& b) {
    std::map<int64_t, at::Tensor> by_count;
    std::vector<at::Tensor> steps;
    for (auto t : b.steps) {
      auto& st = by_count[t];
      if (!st.defined()) st = at::full({}, double(t), at::TensorOptions().dtype(at::kFloat).device(b.device));
      steps.push_back(st);
    }
    if (decoupled_)
      at::_fused_adamw_(b.params, b.grads, b.a, b.b, {}, steps, g.lr, b1_, b2_, g.weight_decay, eps_,
                        /*amsgrad=*/false, /*maximize=*/false);
    else
      at::_fused_adam_(b.params, b.grads, b.a, b.b, {}, steps, g.lr, b1_, b2_, g.weight_decay, eps_,
                       /*amsgrad=*/false, /*maximize=*/false);
  }
  double b1_, b2_, eps_;
  bool decoupled_;
  std::string impl_;
};

// timm's RMSpropTF (TensorFlow-style RMSprop): the square average starts at one, eps goes inside
// the square root, and the learning rate is applied inside the momentum buffer. On the CPU one
// pass per parameter (ops::rmsprop_tf_step, bitwise this loop) unless impl is "loop".
class RmspropTF : public Optimizer {
 public:
  RmspropTF(std::vector<ParamGroup> g, double alpha, double eps, double momentum, std::string impl)
      : alpha_(alpha), eps_(eps), momentum_(momentum), impl_(std::move(impl)) {
    groups_ = std::move(g);
  }
  void step() override {
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto& s = state_[name];
      auto& square_avg = s.buf["square_avg"];
      if (!square_avg.defined()) square_avg = torch::ones_like(p);  // TF starts at one, torch at zero
      s.step += 1;
      auto grad = p.grad();
      if (impl_ != "loop") {
        at::Tensor buf;
        if (momentum_ > 0) {
          auto& b = s.buf["momentum_buffer"];
          if (!b.defined()) b = torch::zeros_like(p);
          buf = b;
        }
        if (ops::optim_step_supported(p, {grad, square_avg, buf})) {
          ops::rmsprop_tf_step(p, grad, square_avg, buf, g.lr, alpha_, eps_, g.weight_decay, momentum_);
          return;
        }
      }
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
  std::string impl_;
};

// timm's Lamb (bias correction, grad averaging, global gradient-norm clipping at max_grad_norm 1):
// Adam's update plus L2 decay, scaled per tensor by the trust ratio |w| / |update| (clipped at
// one for lambc) when the tensor is decayed.
class Lamb : public Optimizer {
 public:
  Lamb(std::vector<ParamGroup> g, double b1, double b2, double eps, bool trust_clip, std::string impl)
      : b1_(b1), b2_(b2), eps_(eps), trust_clip_(trust_clip), impl_(std::move(impl)) {
    groups_ = std::move(g);
  }
  void step() override {
    torch::NoGradGuard ng;
    std::vector<at::Tensor> norms;
    for (auto& g : groups_)
      for (auto& p : g.params)
        if (p.grad().defined()) norms.push_back(p.grad().norm());
    if (norms.empty()) return;
    const auto clip = (torch::stack(norms).norm() / max_grad_norm_).clamp_min_(1.0);
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto& s = state_[name];
      auto& m = s.buf["exp_avg"];
      auto& v = s.buf["exp_avg_sq"];
      if (!m.defined()) m = torch::zeros_like(p);
      if (!v.defined()) v = torch::zeros_like(p);
      s.step += 1;
      const double bc1 = 1.0 - std::pow(b1_, s.step), bc2 = 1.0 - std::pow(b2_, s.step);
      // On the CPU: one pass for the moments and the update, the two norms, one pass to apply it
      // (ops::lamb_moments / lamb_apply, bitwise the ATen ops below; lerp's other formula for a
      // weight of 0.5 or more is left to the loop).
      if (impl_ != "loop" && 1.0 - b1_ < 0.5 && ops::optim_step_supported(p, {p.grad(), m, v})) {
        auto update = at::empty_like(p);
        ops::lamb_moments(p, p.grad(), m, v, update, clip.item<double>(), b1_, b2_, bc1, bc2, eps_, g.weight_decay);
        double trust = 1.0;
        if (g.weight_decay != 0) {
          auto w = p.norm(), u = update.norm();
          auto t = trust_or_one(w / u, w, u);
          if (trust_clip_) t = t.clamp_max(1.0);
          trust = t.item<double>();
        }
        ops::lamb_apply(p, update, g.lr, g.weight_decay != 0, trust);
        return;
      }
      auto grad = p.grad() / clip;
      m.lerp_(grad, 1.0 - b1_);
      v.mul_(b2_).addcmul_(grad, grad, 1.0 - b2_);
      auto update = (m / bc1).div_((v.sqrt() / std::sqrt(bc2)).add_(eps_));
      if (g.weight_decay != 0) {
        update.add_(p, g.weight_decay);
        auto w = p.norm(), u = update.norm();
        auto trust = trust_or_one(w / u, w, u);
        if (trust_clip_) trust = trust.clamp_max(1.0);
        update.mul_(trust);
      }
      p.add_(update, -g.lr);
    });
  }

 private:
  double b1_, b2_, eps_;
  bool trust_clip_;
  std::string impl_;
  double max_grad_norm_ = 1.0;
};

// timm's Lars: for decayed tensors the gradient plus L2 decay is scaled by the trust ratio
// trust_coeff * |w| / (|g| + wd |w| + eps) (larc: divided by lr and clipped at one), then SGD
// momentum (nlars: Nesterov).
// On the CPU the step after the two norms is one pass (ops::lars_sgd_step, bitwise the loop)
// unless impl is "loop".
class Lars : public Sgd {
 public:
  Lars(std::vector<ParamGroup> g, double momentum, bool nesterov, bool trust_clip, std::string impl)
      : Sgd(std::move(g), momentum, nesterov, "loop"), trust_clip_(trust_clip), lars_impl_(std::move(impl)) {}
  void step() override {
    each_with_grad([&](ParamGroup& g, const std::string& name, at::Tensor& p) {
      auto d = p.grad();
      at::Tensor trust;
      if (g.weight_decay != 0) {
        auto w = p.norm(), gn = d.norm();
        trust = trust_or_one(trust_coeff_ * w / (gn + w * g.weight_decay + eps_), w, gn);
        if (trust_clip_) trust = (trust / g.lr).clamp_max(1.0);
      }
      if (lars_impl_ != "loop" && ops::optim_step_supported(p, {d})) {
        auto& bufs = state_[name].buf;
        auto it = bufs.find("momentum_buffer");
        const bool first = momentum_ != 0 && it == bufs.end();
        at::Tensor buf = momentum_ == 0 ? at::Tensor() : first ? at::empty_like(p) : it->second;
        if (ops::optim_step_supported(p, {buf})) {
          ops::lars_sgd_step(p, d, buf, first, g.lr, g.weight_decay, trust.defined() ? trust.item<double>() : 1.0,
                             momentum_, nesterov_);
          if (first) bufs.emplace("momentum_buffer", buf);
          return;
        }
      }
      if (trust.defined()) d = d.add(p, g.weight_decay).mul_(trust);
      momentum_step(g, name, p, d);
    });
  }

 private:
  bool trust_clip_;
  std::string lars_impl_;
  double trust_coeff_ = 0.001, eps_ = 1e-8;
};

const std::set<std::string>& optimizer_names() {
  static const std::set<std::string> n = {"sgd",   "nesterov", "momentum",  "adam",     "adamw",
                                          "rmsproptf", "lamb", "lambc", "lars",      "larc",     "nlars",
                                          "nlarc", "fusedsgd", "fusedadam", "fusedadamw"};
  return n;
}

}  // namespace

bool known_optimizer(const std::string& opt) { return optimizer_names().count(opt) > 0; }

std::unique_ptr<Optimizer> create_optimizer(const OptimizerArgs& a,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const std::set<std::string>& no_weight_decay,
                                            const std::vector<GroupRule>& group_rules) {
  auto groups = a.layer_decay ? layer_decay_groups(named_params, a.weight_decay, no_weight_decay, group_rules,
                                                   *a.layer_decay, a.layer_decay_min_scale)
                              : weight_decay_groups(named_params, a.weight_decay, no_weight_decay);
  for (auto& g : groups) g.lr = a.lr * g.lr_scale;
  static const std::set<std::string> impls = {"auto", "loop", "foreach", "fused"};
  if (!impls.count(a.impl)) throw std::invalid_argument("unknown optimizer implementation '" + a.impl + "'");
  // timm's fused* names (apex there): the same optimizers through ATen's fused kernels
  const bool fused_name = a.opt.rfind("fused", 0) == 0;
  const std::string opt = fused_name ? a.opt.substr(5) : a.opt;
  const std::string impl = fused_name ? "fused" : a.impl;
  if (opt == "sgd" || opt == "nesterov") return std::make_unique<Sgd>(std::move(groups), a.momentum, true, impl);
  if (opt == "momentum") return std::make_unique<Sgd>(std::move(groups), a.momentum, false, impl);
  if (opt == "adam" || opt == "adamw")
    return std::make_unique<AdamW>(std::move(groups), a.beta1, a.beta2, a.eps.value_or(1e-8), opt == "adamw", impl);
  if (a.opt == "rmsproptf")
    return std::make_unique<RmspropTF>(std::move(groups), 0.9, a.eps.value_or(1e-10), a.momentum, impl);
  if (a.opt == "lamb" || a.opt == "lambc")
    return std::make_unique<Lamb>(std::move(groups), a.beta1, a.beta2, a.eps.value_or(1e-6), a.opt == "lambc",
                                  impl);
  if (a.opt == "lars" || a.opt == "larc" || a.opt == "nlars" || a.opt == "nlarc")
    return std::make_unique<Lars>(std::move(groups), a.momentum, a.opt[0] == 'n', a.opt.back() == 'c', impl);
  throw std::invalid_argument("unknown optimizer '" + a.opt + "'");
}

Scheduler::Scheduler(SchedulerArgs a) : a_(std::move(a)) {
  if (a_.on_updates && a_.updates_per_epoch <= 0) throw std::invalid_argument("on_updates needs updates_per_epoch");
  if ((a_.max_updates > 0 || a_.warmup_updates >= 0) && !a_.on_updates)
    throw std::invalid_argument("max_updates / warmup_updates need on_updates");
  // Lengths in epochs become updates with on_updates; with max_updates they are updates already.
  const double u = a_.on_updates && a_.max_updates <= 0 ? double(a_.updates_per_epoch) : 1.0;
  t_initial_ = a_.max_updates > 0 ? double(a_.max_updates) : double(a_.epochs) * u;
  warmup_t_ = a_.warmup_updates >= 0 ? double(a_.warmup_updates) : double(a_.warmup_epochs) * u;
  decay_t_ = a_.decay_epochs * u;
  cooldown_t_ = double(a_.cooldown_epochs) * u;
  for (auto m : a_.decay_milestones) milestones_.push_back(double(m) * u);
  std::sort(milestones_.begin(), milestones_.end());
  plateau_.lr = a_.warmup_epochs > 0 ? a_.warmup_lr : a_.base_lr;
  plateau_.best = a_.plateau_max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
}

double Scheduler::lr_at(int64_t step) const {
  double t = double(step);
  if (t < warmup_t_) {
    // timm's tanh schedule warms up to where its curve is at warmup_t, the others to base_lr
    const double target = a_.sched == "tanh" && !a_.warmup_prefix ? after_warmup(warmup_t_) : a_.base_lr;
    return a_.warmup_lr + t * (target - a_.warmup_lr) / warmup_t_;
  }
  return after_warmup(t);
}

double Scheduler::after_warmup(double t) const {
  if (a_.warmup_prefix) t -= warmup_t_;
  if (a_.sched == "step") return a_.base_lr * std::pow(a_.decay_rate, std::floor(t / decay_t_));
  if (a_.sched == "multistep") {
    // timm's convention: milestone m applies from t == m - 1 (bisect_right(milestones, t + 1));
    // torch's MultiStepLR from t == m (bisect_right(milestones, t)).
    const double at = a_.torch_milestones ? t : t + 1;
    auto n = std::upper_bound(milestones_.begin(), milestones_.end(), at) - milestones_.begin();
    return a_.base_lr * std::pow(a_.decay_rate, double(n));
  }
  // cosine, tanh, poly: cycles of t_initial * cycle_mul^i, peak decayed by cycle_decay^i.
  double i, t_i, t_curr;
  if (a_.cycle_mul != 1.0) {
    i = std::floor(std::log(1 - t / t_initial_ * (1 - a_.cycle_mul)) / std::log(a_.cycle_mul));
    t_i = std::pow(a_.cycle_mul, i) * t_initial_;
    t_curr = t - (1 - std::pow(a_.cycle_mul, i)) / (1 - a_.cycle_mul) * t_initial_;
  } else {
    i = std::floor(t / t_initial_);
    t_i = t_initial_;
    t_curr = t - t_initial_ * i;
  }
  if (i >= double(a_.cycle_limit)) return a_.min_lr;
  const double lr_max = a_.base_lr * std::pow(a_.cycle_decay, i);
  const double k = a_.k_decay;
  if (a_.sched == "poly")
    return a_.min_lr + (lr_max - a_.min_lr) * std::pow(1 - std::pow(t_curr, k) / std::pow(t_i, k), a_.decay_rate);
  if (a_.sched == "tanh") {  // timm's defaults lb -7, ub 3
    const double tr = t_curr / t_i;
    return a_.min_lr + 0.5 * (lr_max - a_.min_lr) * (1 - std::tanh(-7.0 * (1.0 - tr) + 3.0 * tr));
  }
  return a_.min_lr + 0.5 * (lr_max - a_.min_lr) * (1 + std::cos(M_PI * std::pow(t_curr, k) / std::pow(t_i, k)));
}

int64_t Scheduler::num_epochs() const {
  if (a_.max_updates > 0) return (a_.max_updates + a_.updates_per_epoch - 1) / a_.updates_per_epoch;
  if (a_.sched == "cosine" || a_.sched == "tanh" || a_.sched == "poly") {
    const double cycles = double(std::max<int64_t>(1, a_.cycle_limit));
    double t = a_.cycle_mul == 1.0 ? t_initial_ * cycles
                                   : std::floor(-t_initial_ * (std::pow(a_.cycle_mul, cycles) - 1) / (1 - a_.cycle_mul));
    if (a_.warmup_prefix) t += warmup_t_;
    t += cooldown_t_;
    return a_.on_updates ? int64_t(t) / a_.updates_per_epoch : int64_t(t);
  }
  return a_.epochs + (a_.warmup_prefix ? a_.warmup_epochs : 0);
}

double Scheduler::initial_lr() const { return a_.sched == "plateau" ? plateau_.lr : lr_at(0); }

std::optional<double> Scheduler::on_epoch(int64_t epoch, std::optional<double> metric) {
  if (a_.sched == "plateau") {  // timm's PlateauLRScheduler around torch's ReduceLROnPlateau
    if (epoch <= a_.warmup_epochs) {
      if (a_.warmup_epochs > 0) plateau_.lr = a_.warmup_lr + double(epoch) * (a_.base_lr - a_.warmup_lr) / double(a_.warmup_epochs);
      return plateau_.lr;
    }
    if (metric) {
      constexpr double threshold = 1e-4;  // relative
      const bool better = a_.plateau_max ? *metric > plateau_.best * (1 + threshold)
                                         : *metric < plateau_.best * (1 - threshold);
      if (better) {
        plateau_.best = *metric;
        plateau_.num_bad = 0;
      } else {
        ++plateau_.num_bad;
      }
      if (plateau_.num_bad > a_.patience_epochs) {
        const double lr = std::max(plateau_.lr * a_.decay_rate, a_.min_lr);
        if (plateau_.lr - lr > 1e-8) plateau_.lr = lr;
        plateau_.num_bad = 0;
      }
    }
    return plateau_.lr;
  }
  if (a_.on_updates) return std::nullopt;
  return lr_at(epoch);
}

std::optional<double> Scheduler::on_update(int64_t num_updates) const {
  if (!a_.on_updates) return std::nullopt;
  return lr_at(num_updates);
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
