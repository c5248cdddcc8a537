// Optimizers and learning-rate schedules with timm's semantics.
// Optimizers keep their state by parameter name so checkpoints store it as named tensors.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::optim {

struct ParamGroup {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  double weight_decay = 0.0;
  double lr = 0.0;
};

// timm's param_groups_weight_decay: no decay for 1-D parameters (norm weights, biases), names
// ending in ".bias" and the model's own no_weight_decay() names; returns [no_decay, decay]
// groups (empty groups dropped).
std::vector<ParamGroup> weight_decay_groups(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            double weight_decay, const std::set<std::string>& skip = {});

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  void zero_grad();
  std::vector<ParamGroup>& groups() { return groups_; }
  // Named state tensors ("<param>.<buffer>", "<param>.step"), for checkpoints; loading moves
  // them to each parameter's device and dtype.
  std::vector<std::pair<std::string, at::Tensor>> state() const;
  void load_state(const std::map<std::string, at::Tensor>& state);
  double mean_lr() const;
  void set_lr(double lr);

 protected:
  // Per-parameter state, by parameter name: named buffers and the step count (0 = not counted).
  struct ParamState {
    std::map<std::string, at::Tensor> buf;
    int64_t step = 0;
  };
  std::map<std::string, ParamState> state_;
  // Calls f(group, name, param) for every parameter that has a gradient, without autograd.
  template <typename F>
  void each_with_grad(F&& f) {
    torch::NoGradGuard ng;
    for (auto& g : groups_)
      for (size_t i = 0; i < g.params.size(); ++i)
        if (g.params[i].grad().defined()) f(g, g.names[i], g.params[i]);
  }
  std::vector<ParamGroup> groups_;
};

struct OptimizerArgs {
  std::string opt = "sgd";  // sgd (nesterov), momentum, adam, adamw, rmsproptf
  double lr = 0.1;
  double weight_decay = 0.0;
  double momentum = 0.9;
  std::optional<double> eps;  // unset: the optimizer's own default (1e-8 Adam*, 1e-10 RMSpropTF)
  double beta1 = 0.9, beta2 = 0.999;
};

std::unique_ptr<Optimizer> create_optimizer(const OptimizerArgs& a,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const std::set<std::string>& no_weight_decay = {});

// timm's epoch-based schedulers: lr(t) for t = epoch index, with linear warmup from warmup_lr.
struct SchedulerArgs {
  std::string sched = "cosine";  // cosine | step | multistep | poly
  double base_lr = 0.1;
  int64_t epochs = 300;          // cycle length t_initial (cosine, poly)
  int64_t warmup_epochs = 0;
  double warmup_lr = 1e-5;
  bool warmup_prefix = false;    // warmup not counted in `epochs`
  int64_t cooldown_epochs = 0;   // at min_lr after the cycle
  double min_lr = 0.0;
  int64_t decay_epochs = 90;     // step
  std::vector<int64_t> decay_milestones{90, 180, 270};  // multistep
  double decay_rate = 0.1;       // step / multistep factor, poly power
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerArgs a) : a_(std::move(a)) {}
  double lr_at(int64_t epoch) const;
  // Epochs to train, as timm's create_scheduler returns them: the cycle (+ warmup when it is a
  // prefix) + cooldown for cosine and poly, `epochs` for the others.
  int64_t num_epochs() const;

 private:
  SchedulerArgs a_;
};

// timm's --lr unset rule: lr = lr_base * (global_batch / lr_base_size), or its sqrt for
// 'sqrt' scaling; '' scale means sqrt for optimizers whose name contains "ada" or "lamb".
double scaled_lr(double lr_base, int64_t lr_base_size, const std::string& scale, const std::string& opt,
                 int64_t global_batch, std::string* used_scale = nullptr);

}  // namespace imgtrain::optim
