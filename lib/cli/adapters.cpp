#include "cli/adapters.h"

#include <algorithm>

namespace imgtrain::cli {

optim::OptimizerArgs optimizer_options(const Config& cfg, double lr) {
  optim::OptimizerArgs oa;
  oa.opt = cfg.opt;
  oa.impl = cfg.opt_impl;
  oa.lr = lr;
  oa.weight_decay = cfg.weight_decay;
  oa.momentum = cfg.momentum;
  oa.eps = cfg.opt_eps;
  if (cfg.opt_betas.size() == 2) oa.beta1 = cfg.opt_betas[0], oa.beta2 = cfg.opt_betas[1];
  oa.layer_decay = cfg.layer_decay;
  return oa;
}

optim::SchedulerArgs scheduler_options(const Config& cfg, double lr, int64_t updates_per_epoch) {
  optim::SchedulerArgs sa;
  sa.sched = cfg.sched;
  sa.base_lr = lr;
  sa.epochs = cfg.epochs;
  sa.warmup_epochs = cfg.warmup_epochs;
  sa.warmup_lr = cfg.warmup_lr;
  sa.min_lr = cfg.min_lr;
  sa.decay_epochs = cfg.decay_epochs;
  sa.decay_rate = cfg.decay_rate;
  sa.warmup_prefix = cfg.warmup_prefix;
  sa.cooldown_epochs = cfg.cooldown_epochs;
  sa.patience_epochs = cfg.patience_epochs;
  sa.plateau_max = cfg.eval_metric != "loss";
  sa.cycle_mul = cfg.lr_cycle_mul;
  sa.cycle_decay = cfg.lr_cycle_decay;
  sa.cycle_limit = cfg.lr_cycle_limit;
  sa.k_decay = cfg.lr_k_decay;
  sa.on_updates = cfg.sched_on_updates || cfg.max_iter || cfg.warmup_iters;
  sa.updates_per_epoch = updates_per_epoch;
  if (cfg.max_iter) {
    sa.max_updates = *cfg.max_iter;
    sa.warmup_updates = cfg.warmup_iters.value_or(0);  // --warmup-epochs is timm's, in epochs: not used
  } else if (cfg.warmup_iters) {
    sa.warmup_updates = *cfg.warmup_iters;
  }
  if (cfg.warmup_factor) sa.warmup_lr = lr * *cfg.warmup_factor;
  sa.decay_rate = cfg.lr_gamma.value_or(cfg.decay_rate);
  sa.torch_milestones = !cfg.lr_steps.empty();
  sa.decay_milestones.clear();
  for (double m : sa.torch_milestones ? cfg.lr_steps : cfg.decay_milestones) sa.decay_milestones.push_back(int64_t(m));
  std::sort(sa.decay_milestones.begin(), sa.decay_milestones.end());
  return sa;
}

data::LoaderOptions loader_options(const Config& cfg) {
  data::LoaderOptions lo;
  lo.batch_size = cfg.batch_size;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.refill_unreadable = true;  // training; evaluation turns it off
  lo.workers = cfg.workers;
  lo.seed = uint64_t(cfg.seed);
  lo.repeats = cfg.aug_repeats;
  lo.aspect_ratio_group_factor = cfg.aspect_ratio_group_factor;  // datasets with targets only
  lo.two_bucket_grouping = cfg.two_bucket_grouping;
  return lo;
}

data::TransformConfig train_geometry(const Config& cfg, int size, int channels) {
  data::TransformConfig tc;
  tc.train = true;
  tc.size = size;
  tc.channels = channels;
  tc.scale = cfg.scale;
  tc.ratio = cfg.ratio;
  tc.hflip = cfg.hflip;
  tc.interpolation = cfg.train_interpolation;
  return tc;
}

ModelArgs model_args(const Config& cfg, int64_t num_classes, int64_t in_chans, int64_t img_size) {
  ModelArgs margs;
  margs.num_classes = num_classes;
  margs.in_chans = in_chans;
  margs.drop_rate = cfg.drop;
  margs.drop_path_rate = cfg.drop_path.value_or(0.0);
  margs.img_size = img_size;
  margs.global_pool = cfg.gp;
  return margs;
}

}  // namespace imgtrain::cli
