// Optimizers and learning-rate schedules with timm's semantics.
// Optimizers keep their state by parameter name so checkpoints store it as named tensors.
#pragma once
#include "core/model.h"

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
  double lr_scale = 1.0;  // layer-wise lr decay: the group's lr is the schedule's lr times this
};

// timm's param_groups_weight_decay: no decay for 1-D parameters (norm weights, biases), names
// ending in ".bias" and the model's own no_weight_decay() names; returns [no_decay, decay]
// groups (empty groups dropped).
std::vector<ParamGroup> weight_decay_groups(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            double weight_decay, const std::set<std::string>& skip = {});

// timm's group_parameters(model, model.group_matcher(), reverse=True): each parameter's layer id,
// numbered by sorting the (ordinal, captured numbers..., suffix) keys of the rules it matches
// (unmatched parameters sort last; a key ending in 99999 joins the previous layer).
std::map<std::string, int64_t> layer_ids(const std::vector<std::string>& names, const std::vector<GroupRule>& rules);

// timm's param_groups_layer_decay: groups per (layer, decay / no decay) with lr_scale =
// max(min_scale, layer_decay ^ (last layer - layer)), in order of first appearance; parameters
// no rule matches get the last layer (scale 1).
std::vector<ParamGroup> layer_decay_groups(const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                           double weight_decay, const std::set<std::string>& skip,
                                           const std::vector<GroupRule>& rules, double layer_decay,
                                           double min_scale = 0.0);

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // set_to_none (torch 2.x's default) drops the gradients; false zeroes them in place, which keeps
  // DDP's bucket views as the gradients (no copy into the buckets each step).
  void zero_grad(bool set_to_none = true);
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
  // sgd (nesterov), momentum, adam, adamw, rmsproptf, lamb, lambc (trust clipping), lars, larc
  // (trust clipping), nlars / nlarc (Nesterov); timm's apex names fusedsgd, fusedadam, fusedadamw
  // are sgd / adam / adamw with impl "fused" (ATen's kernels, no apex)
  std::string opt = "sgd";
  double lr = 0.1;
  double weight_decay = 0.0;
  double momentum = 0.9;
  std::optional<double> eps;  // unset: the optimizer's own default (1e-8 Adam*, 1e-10 RMSpropTF)
  double beta1 = 0.9, beta2 = 0.999;
  std::optional<double> layer_decay;  // timm's --layer-decay (needs the model's group rules)
  double layer_decay_min_scale = 0.0;
  // How SGD and Adam(W) step: "auto" = ATen's fused SGD kernel (bitwise equal to the loop on
  // CPU), Adam(W) as a per-parameter loop on CPU (torch.optim's CPU default, bitwise timm) and
  // with ATen's multi-tensor (_foreach_) ops on CUDA (torch.optim's CUDA default); "fused" =
  // ATen's _fused_sgd_ / _fused_adam(w)_ (the fused* optimizer names; within a float rounding of
  // the loop); "foreach"; "loop". Parameters whose gradient or state does not share their
  // memory layout always take the loop (the fused kernels assume one).
  std::string impl = "auto";
};

std::unique_ptr<Optimizer> create_optimizer(const OptimizerArgs& a,
                                            const std::vector<std::pair<std::string, at::Tensor>>& named_params,
                                            const std::set<std::string>& no_weight_decay = {},
                                            const std::vector<GroupRule>& group_rules = {});
// Whether `opt` names an optimizer create_optimizer knows.
bool known_optimizer(const std::string& opt);

// timm's schedulers (create_scheduler_v2): lr(t) with t in epochs, or in optimizer updates with
// --sched-on-updates (every length then multiplied by the updates per epoch), linear warmup from
// warmup_lr, cycles (cycle_mul, cycle_decay, cycle_limit) and k-decay for cosine/tanh/poly.
struct SchedulerArgs {
  std::string sched = "cosine";  // cosine | tanh | step | multistep | plateau | poly
  double base_lr = 0.1;
  int64_t epochs = 300;          // cycle length t_initial (cosine, tanh, poly)
  int64_t warmup_epochs = 0;
  double warmup_lr = 1e-5;
  bool warmup_prefix = false;    // warmup not counted in `epochs`
  int64_t cooldown_epochs = 0;   // at min_lr after the cycles
  double min_lr = 0.0;
  double decay_epochs = 90;      // step
  std::vector<int64_t> decay_milestones{90, 180, 270};  // multistep
  double decay_rate = 0.1;       // step / multistep / plateau factor, poly power
  int64_t patience_epochs = 10;  // plateau
  bool plateau_max = true;       // plateau: a larger metric is better (false for --eval-metric loss)
  double cycle_mul = 1.0, cycle_decay = 0.5, k_decay = 1.0;
  int64_t cycle_limit = 1;
  bool on_updates = false;       // --sched-on-updates
  int64_t updates_per_epoch = 0;
  // torch's MultiStepLR convention (torchvision's --lr-steps, Detectron2's SOLVER.STEPS): milestone
  // m applies from t == m; timm's multistep applies it from t == m - 1.
  bool torch_milestones = false;
  int64_t warmup_updates = -1;   // >= 0: the warmup's length in updates (on_updates), not warmup_epochs
  // > 0: Detectron2's MAX_ITER: the schedule is this many updates long (on_updates) and the other
  // lengths (milestones, cooldown) count updates too.
  int64_t max_updates = 0;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerArgs a);
  // The lr at t (epochs, or updates with on_updates); not for plateau, whose lr depends on metrics.
  double lr_at(int64_t t) const;
  // Epochs to train, as timm's create_scheduler_v2 returns them (cycles, warmup prefix, cooldown).
  int64_t num_epochs() const;
  bool on_updates() const { return a_.on_updates; }
  const SchedulerArgs& args() const { return a_; }
  // timm's scheduler.step(epoch, metric) at the start of `epoch` (the previous epoch's metric):
  // the lr to use from now, or nullopt to keep the current one (per-update schedules).
  std::optional<double> on_epoch(int64_t epoch, std::optional<double> metric = std::nullopt);
  // timm's step_update(num_updates): the lr after that many updates, or nullopt (per-epoch schedules).
  std::optional<double> on_update(int64_t num_updates) const;
  // The lr before any step (timm sets warmup_lr at construction when warming up).
  double initial_lr() const;
  // ReduceLROnPlateau's state, saved in checkpoints so a resumed plateau run continues exactly.
  struct PlateauState {
    double lr = 0, best = 0;
    int64_t num_bad = 0;
  };
  PlateauState plateau_state() const { return plateau_; }
  void set_plateau_state(const PlateauState& s) { plateau_ = s; }

 private:
  double after_warmup(double t) const;
  SchedulerArgs a_;
  double t_initial_, warmup_t_, decay_t_, cooldown_t_;
  std::vector<double> milestones_;
  PlateauState plateau_;
};

// timm's --lr unset rule: lr = lr_base * (global_batch / lr_base_size), or its sqrt for
// 'sqrt' scaling; '' scale means sqrt for optimizers whose name contains "ada" or "lamb".
double scaled_lr(double lr_base, int64_t lr_base_size, const std::string& scale, const std::string& opt,
                 int64_t global_batch, std::string* used_scale = nullptr);

}  // namespace imgtrain::optim
