// `imgtrain train`: a validated Config -> the task, model, data, optimizer and schedule, then
// the epoch loop (train, distribute BN, evaluate model and EMA, summary row, lr step, checkpoint).
#include "cli/adapters.h"
#include "core/batch_norm.h"
#include "core/error.h"
#include "core/log.h"
#include "dist/launcher.h"
#include "engine/checkpoint.h"
#include "engine/commands.h"
#include "engine/evaluate.h"
#include "engine/run_folder.h"
#include "engine/setup.h"
#include "engine/train_loop.h"
#include "io/torch_pickle.h"
#include "model_zoo/registry.h"
#include "tasks/tasks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <algorithm>
#include <filesystem>

namespace fs = std::filesystem;

namespace imgtrain::engine {
namespace {

using Clock = std::chrono::steady_clock;

// Everything the epoch loop carries between epochs and into checkpoints.
struct Run {
  tasks::TaskSetup setup;
  std::shared_ptr<torch::nn::Module> model;
  std::unique_ptr<LossScaler> scaler;
  std::unique_ptr<MasterWeights> master;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::unique_ptr<optim::Scheduler> scheduler;
  std::unique_ptr<ModelEma> ema;
  std::string args_yaml;
  int64_t num_updates = 0;
  int64_t updates_per_epoch = 0;  // recorded in mid-epoch checkpoints
  torch::Device device = torch::kCPU;  // a CUDA run also saves and restores that device's generator

  // One checkpoint file: everything --resume needs to continue exactly.
  void write(const std::string& path, int64_t epoch, double metric, double best_metric, int64_t best_epoch,
             std::optional<int64_t> recovery_update, const LossMeters& meters = {}) const {
    CheckpointMeta meta = setup.model_meta;
    meta.epoch = epoch;
    meta.num_updates = num_updates;
    meta.recovery_update = recovery_update;
    if (recovery_update) meta.epoch_updates = updates_per_epoch;
    meta.metric = metric;
    meta.best_metric = best_metric;
    meta.best_epoch = best_epoch;
    const auto p = scheduler->plateau_state();
    meta.plateau = fmt::format("{} {} {}", p.lr, p.best, p.num_bad);
    meta.loss_meters = format_loss_meters(meters);
    meta.args = args_yaml;
    TrainStateRefs s;
    s.model = model.get();
    s.ema = ema ? &ema->module() : nullptr;
    s.optim = optimizer->state();
    if (master) s.master = master->named_masters();
    if (scaler) s.scaler = scaler->state();
    s.rng_cpu = at::detail::getDefaultCPUGenerator().get_state();
    // drop path, random erasing and mixup draw on the device in a CUDA run
    if (device.is_cuda()) s.rng_cuda = at::globalContext().defaultGenerator(device).get_state();
    write_checkpoint(path, meta, s);
  }
};

// timm: lr unset -> lr_base scaled by the global batch size.
double resolve_lr(const cli::Config& cfg, int64_t world) {
  if (cfg.lr) return *cfg.lr;
  const int64_t global_batch = cfg.batch_size * cfg.grad_accum_steps * world;
  std::string how;
  const double lr = optim::scaled_lr(cfg.lr_base, cfg.lr_base_size, cfg.lr_base_scale, cfg.opt, global_batch, &how);
  log::info("Learning rate ({}) calculated from base learning rate ({}) and effective global batch size ({}) "
            "with {} scaling.",
            lr, cfg.lr_base, global_batch, how);
  return lr;
}

// The created model's weights, precision and data parallel.
void build(Run& r, const cli::Config& cfg, torch::Device device, dist::Context* ctx, const Amp& amp) {
  Task& task = *r.setup.task;
  log::info("Model {} created, param count:{}", cfg.model, model_zoo::count_params(*r.model));
  task.load_pretrained(*r.model);
  const std::string how = amp.o2 ? fmt::format("apex O2: {} weights with float32 master weights",
                                                amp.dtype == at::kBFloat16 ? "bfloat16" : "float16")
                                  : std::string("native Torch AMP");
  if (r.scaler)
    log::info("Using {}. Training in mixed precision ({} loss scaling).", how,
              cfg.loss_scale ? fmt::format("static {}", *cfg.loss_scale) : std::string("dynamic"));
  else if (amp.enabled || amp.o2)
    log::info("Using {}. Training in mixed precision (bfloat16, no loss scaling).", how);
  else
    log::info("AMP not enabled. Training in float32.");
  if (!cfg.initial_checkpoint.empty()) {
    Checkpoint::read(cfg.initial_checkpoint).load_weights(*r.model, /*prefer_ema=*/true);
    log::info("Loaded weights from '{}'", cfg.initial_checkpoint);
  }
  r.model->to(device);
  if (cfg.channels_last) to_channels_last(*r.model);
  if (ctx) {
    if (cfg.sync_bn) ctx->convert_sync_batchnorm(*r.model);
    ctx->broadcast_model(*r.model);  // every rank starts from rank 0's weights and buffers
  }
  if (amp.o2) r.master = std::make_unique<MasterWeights>(*r.model, amp.dtype);
}

// The optimizer on the model's parameters (the float32 masters under O2) and the schedule.
void build_optimizer(Run& r, const cli::Config& cfg, int64_t world, int64_t updates_per_epoch) {
  const double lr = resolve_lr(cfg, world);
  std::vector<std::pair<std::string, at::Tensor>> named;
  if (r.master) named = r.master->named_masters();
  else
    for (auto& p : r.model->named_parameters()) named.emplace_back(p.key(), p.value());
  const auto info = r.setup.task->param_info(*r.model);
  if (cfg.layer_decay && info.group_matcher.empty())
    throw UserError(fmt::format("--layer-decay: {} has no layer grouping", cfg.model));
  r.optimizer = optim::create_optimizer(cli::optimizer_options(cfg, lr), named, info.no_weight_decay,
                                        info.group_matcher);
  r.scheduler = std::make_unique<optim::Scheduler>(cli::scheduler_options(cfg, lr, updates_per_epoch));
  if (cfg.sched == "plateau" && cfg.sched_on_updates)
    throw UserError("--sched plateau steps per epoch only (it follows the eval metric); drop --sched-on-updates");
  r.optimizer->set_lr(r.scheduler->initial_lr());
}

// Where a resumed run continues.
struct ResumePoint {
  int64_t start_epoch = 0, start_update = 0;
  at::Tensor rng;       // restored last, after anything that draws
  at::Tensor rng_cuda;  // the CUDA generator's, likewise
  std::string plateau;
  LossMeters meters;  // a mid-epoch point: the epoch's loss averages so far
  int64_t resumed_updates = 0;  // the checkpoint's update count
  std::optional<Checkpoint> checkpoint;  // kept for the EMA, which is created after the model's resume
};

ResumePoint resume(Run& r, const cli::Config& cfg, std::optional<Checkpoint> checkpoint, CheckpointSaver& saver) {
  ResumePoint p;
  if (!checkpoint) return p;
  p.checkpoint = std::move(checkpoint);
  const Checkpoint& ck = *p.checkpoint;
  const std::string& path = ck.path();
  ck.require_training("--resume", cfg.model);
  ck.load_prefixed(*r.model, "model.");
  if (r.master) {  // the float32 masters as saved (the model's half weights are their rounding)
    torch::NoGradGuard ng;
    for (auto& [k, t] : r.master->named_masters()) {
      auto* saved = ck.find("master." + k);
      if (!saved) throw UserError(fmt::format("--resume '{}': no O2 master weights (master.{})", path, k));
      t.copy_(*saved);
    }
  }
  // timm restores the state of the optimizer it builds, whatever the checkpoint's was: said here
  if (const auto opt = ck.meta().arg("opt"); opt && !cfg.no_resume_opt && *opt != cfg.opt)
    log::warn("--resume '{}': the checkpoint's optimizer was --opt {}, this run's is --opt {}: state of the same "
              "name is restored (as timm's load_state_dict does), the rest starts from zero; --no-resume-opt starts "
              "all of it fresh",
              path, *opt, cfg.opt);
  try {  // damaged or foreign training state is the file's fault, said here by name
    if (!cfg.no_resume_opt) r.optimizer->load_state(ck.section("optim."));
    if (r.scaler) r.scaler->load_state(ck.section("scaler."));
  } catch (const UserError& e) {
    throw UserError(fmt::format("--resume '{}': {}", path, e.what()));
  }
  if (auto* rng = ck.find("rng.cpu")) {
    try {  // a generator state of the wrong size or kind is the file's fault, said here by name
      at::make_generator<at::CPUGeneratorImpl>().set_state(*rng);
    } catch (const c10::Error&) {
      throw UserError(fmt::format("--resume '{}': tensor 'rng.cpu' is not a CPU generator state ({} {} values)", path,
                                  rng->numel(), c10::toString(rng->scalar_type())));
    }
    p.rng = *rng;
  }
  if (auto* rng = ck.find("rng.cuda")) p.rng_cuda = *rng;
  const auto& m = ck.meta();
  p.start_epoch = *m.epoch + 1;
  if (m.recovery_update) {
    --p.start_epoch;  // a mid-epoch recovery point: the same epoch, from the next update
    p.start_update = *m.recovery_update + 1;
    p.meters = parse_loss_meters(m.loss_meters, fmt::format("--resume '{}'", path));
  }
  p.plateau = m.plateau;
  r.num_updates = *m.num_updates;
  p.resumed_updates = r.num_updates;
  if (m.best_metric) {
    saver.best_metric = *m.best_metric;
    saver.best_epoch = m.best_epoch.value_or(-1);
  }
  if (m.recovery_update)  // a mid-epoch point: the epoch it continues and the update it resumes after
    log::info("Resumed from checkpoint '{}' (epoch {}, after its update {})", path, p.start_epoch, *m.recovery_update);
  else
    log::info("Resumed from checkpoint '{}' (epoch {})", path, p.start_epoch - 1);
  return p;
}

int fit(const cli::Config& given_cfg, torch::Device device, dist::Context* ctx) {
  const int64_t rank = ctx ? ctx->rank() : 0, world = ctx ? ctx->world() : 1;
  if (!given_cfg.experiment.empty()) checked_experiment(given_cfg.experiment);  // refused before any start-up line
  // with the model's own defaults and what the world size decides (args.yaml: not the latter)
  const cli::Config model_cfg = tasks::with_model_defaults(given_cfg);
  cli::Config cfg = model_cfg;
  if (cfg.ims_per_batch) {
    if (*cfg.ims_per_batch % world)
      throw UserError(fmt::format("--ims-per-batch {}: not a multiple of the {} processes", *cfg.ims_per_batch, world));
    cfg.batch_size = *cfg.ims_per_batch / world;
  }
  const bool primary = rank == 0;  // only rank 0 writes files
  torch::manual_seed(uint64_t(cfg.seed + rank));  // timm's random_seed(seed, rank)
  Run r;
  r.device = device;
  r.setup = tasks::create_train_task(cfg, rank, world);
  Task& task = *r.setup.task;
  const auto names = task.metric_names();
  // timm's default (top1) where the task reports it; otherwise the task's first metric (bbox_AP)
  const std::string eval_metric =
      !cfg.was_given("eval-metric") && std::find(names.begin(), names.end(), cfg.eval_metric) == names.end()
          ? names.front()
          : cfg.eval_metric;
  if (std::find(names.begin(), names.end(), eval_metric) == names.end())
    throw UserError(fmt::format("--eval-metric '{}': expected one of {} (what the {} task reports)", eval_metric,
                                fmt::join(names, ", "), task.name()));
  const DataConfig& dc = r.setup.data;
  const Amp amp = resolve_amp(cfg.amp, cfg.amp_dtype, cfg.amp_opt_level);
  warn_cpu_float16(amp, device);
  if ((amp.enabled || amp.o2) && amp.dtype == at::kHalf)
    r.scaler = std::make_unique<LossScaler>(cfg.loss_scale.value_or(65536.0), !cfg.loss_scale, device);

  // (after the data checks and the model's own checks, so that a user error stays one line)
  r.model = task.create_model();
  // --channels-last and --fuse-bn (BatchNorm + residual add + activation as one kernel; ConvNeXt's
  // MLP on tiles): on by default for the families measured faster with them when training on the
  // CPU in float32 (docs/performance.md); the flags, given either way, decide
  const bool nhwc_fused = nhwc_fused_training_default(cfg.model, device, amp);
  const bool fused = fused_training_default(cfg.model, device, amp);
  cfg.channels_last = cfg.channels_last_on(nhwc_fused);
  const bool fuse_bn = cfg.fuse_bn_on(fused);
  if ((nhwc_fused && !cfg.was_given("channels-last")) || (fused && !cfg.was_given("fuse-bn")))
    log::info("Training layout {}, {}: {} default on the CPU (--channels-last / --fuse-bn [=false] choose)",
              cfg.channels_last ? "channels-last (NHWC)" : "NCHW",
              !fuse_bn ? "torch's modules (no fused kernels)" : model_zoo::cpu_training_fused_kernels(cfg.model),
              cfg.model);
  set_training_fusion(*r.model, fuse_bn);
  if (ctx)
    log::info("Training in distributed mode with multiple processes, 1 device per process. Process {}, total {}, "
              "device {} ({}).",
              rank, world, device.str(), ctx->backend());
  else
    log::info("Training with a single process on 1 device ({}).", device.str());
  build(r, cfg, device, ctx, amp);

  data::LoaderOptions lo = cli::loader_options(cfg);
  lo.pin_memory = cfg.pinned_batches(device.is_cuda());
  lo.cuda_device = device.is_cuda() ? device.index() : -1;
  lo.rank = rank;
  lo.world = world;
  data::Loader train_loader(r.setup.train, r.setup.train_transform, lo);
  data::LoaderOptions elo = lo;
  elo.repeats = 0;  // evaluation: timm's OrderedDistributedSampler
  elo.batch_size = cfg.validation_batch_size.value_or(cfg.batch_size);
  elo.shuffle = false;
  elo.drop_last = false;
  elo.refill_unreadable = false;
  elo.pad_shares = !r.setup.sharded_eval;
  elo.aspect_ratio_group_factor = -1;
  elo.two_bucket_grouping = false;
  data::Loader eval_loader(r.setup.eval, r.setup.eval_transform, elo);

  const int64_t updates_per_epoch =
      int64_t((train_loader.num_batches() + size_t(cfg.grad_accum_steps) - 1) / size_t(cfg.grad_accum_steps));
  build_optimizer(r, cfg, world, updates_per_epoch);
  r.updates_per_epoch = updates_per_epoch;
  optim::Scheduler& scheduler = *r.scheduler;
  const int64_t num_epochs = scheduler.num_epochs();

  r.args_yaml = cli::to_yaml(cli::Command::Train, model_cfg);
  const RunFolder run(cfg.output, cfg.experiment.empty() ? default_experiment(cfg.model, dc.img_size) : cfg.experiment,
                      primary);

  // --resume auto (a restarted or preempted job): the newest checkpoint of this run's folder that
  // reads whole; a damaged newest one (cut short, bad header) falls back to the one before it.
  std::optional<Checkpoint> resume_from;
  if (cfg.resume == "auto") {
    const auto candidates = find_checkpoints(run.dir());
    for (auto& path : candidates) {
      try {
        resume_from = Checkpoint::read(path);
        resume_from->require_training("--resume", cfg.model);
        break;
      } catch (const UserError& e) {
        resume_from.reset();
        log::warn("--resume auto: skipping '{}': {}", path, e.what());
      }
    }
    if (!resume_from)
      log::info("--resume auto: no {}checkpoint in '{}'; starting from scratch", candidates.empty() ? "" : "usable ",
                run.dir());
  } else if (!cfg.resume.empty()) {
    resume_from = Checkpoint::read(cfg.resume);
  }
  CheckpointSaver saver(run.dir(), cfg.checkpoint_hist, /*decreasing=*/eval_metric == "loss");
  const std::string resumed_from = resume_from ? resume_from->path() : "";
  const bool resumed_from_recovery = resume_from && resume_from->meta().recovery_update.has_value();
  // a mid-epoch point counts updates of its run's epoch: with another batch size (accumulation,
  // process count, data) the same count is another place in the epoch, skipping or repeating samples
  if (const auto n = resumed_from_recovery ? resume_from->meta().epoch_updates : std::nullopt;
      n && *n != updates_per_epoch)
    throw UserError(fmt::format("--resume '{}': a mid-epoch recovery point of a run with {} updates per epoch, but an "
                                "epoch here has {} (another batch size, --grad-accum-steps, process count or data); "
                                "resume with that run's settings, or from an end-of-epoch checkpoint",
                                resumed_from, *n, updates_per_epoch));
  ResumePoint rp = resume(r, cfg, std::move(resume_from), saver);
  if (rp.start_update > updates_per_epoch)  // a recovery point past the end of an epoch of this data
    throw UserError(fmt::format("--resume '{}': metadata 'recovery_update' is {}, but an epoch here has {} updates "
                                "(the checkpoint does not belong to this data and batch size)",
                                resumed_from, rp.start_update - 1, updates_per_epoch));
  // The folder's earlier files are this run's only when it resumes from one of them; a run from
  // scratch or from another folder's file moves an earlier run's files aside first. Done once the
  // checkpoint has been read and checked: a refused --resume leaves the folder as it was.
  std::error_code ec;
  const bool continues =
      !resumed_from.empty() && fs::equivalent(fs::absolute(resumed_from).parent_path(), fs::path(run.dir()), ec);
  run.begin(r.args_yaml, continues);
  if (!resumed_from.empty() && !continues) {
    // another folder's checkpoint: its best file is not here, so the best starts afresh (as timm's
    // saver does after a resume) and this folder gets its own model_best
    saver.best_metric.reset();
    saver.best_epoch = -1;
  }
  EventWriter events;  // --log-tensorboard (rank 0)
  if (primary && !cfg.log_tensorboard.empty() && cfg.log_tensorboard != "false") {
    events = EventWriter(cfg.log_tensorboard == "true" ? run.dir() : cfg.log_tensorboard);
    log::info("TensorBoard event file: {}", events.path());
  }
  int64_t start_epoch = rp.start_epoch;
  if (cfg.model_ema) {
    // Created after any resume of the model, as timm does, then given the checkpoint's EMA.
    r.ema = std::make_unique<ModelEma>(task.create_model(), *r.model, cfg.model_ema_decay, cfg.model_ema_warmup,
                                       cfg.model_ema_force_cpu ? torch::kCPU : device);
    if (cfg.channels_last) to_channels_last(r.ema->module());
    if (rp.checkpoint && rp.checkpoint->has_ema()) rp.checkpoint->load_prefixed(r.ema->module(), "ema.");
  }
  rp.checkpoint.reset();  // the tensors are copied; free the file's memory before training
  std::unique_ptr<dist::GradSync> grad_sync;  // created last, on the final parameters (as DDP)
  if (ctx) grad_sync = ctx->grad_sync(*r.model, cfg.bucket_cap_mb, !cfg.no_ddp_bb);
  if (cfg.start_epoch) start_epoch = *cfg.start_epoch;
  if (primary && !resumed_from.empty()) {
    if (continues) {
      // resuming an earlier point of the folder's run: the checkpoints written after it belong to
      // the epochs about to be redone, so they go aside (--resume auto must not continue them)
      std::vector<std::string> later;
      for (auto& [path, m] : scan_checkpoints(run.dir(), /*warn=*/false))
        if (m.num_updates && *m.num_updates > rp.resumed_updates) later.push_back(path);
      std::sort(later.begin(), later.end());
      if (const auto to = run.set_aside(later); !to.empty())
        log::warn("resuming '{}' at update {}: {} later checkpoint file(s) of this folder, from the epochs now redone, "
                  "moved to '{}'",
                  resumed_from, rp.resumed_updates, later.size(), to);
    }
    // a restart keeps the folder's promises: --checkpoint-hist over all the run's checkpoints, one
    // summary.csv row per epoch (rows of epochs about to be redone are dropped; a kill can fall
    // between an epoch's row and its checkpoint), and one recovery file, the one resumed from
    saver.adopt_existing(start_epoch);
    run.truncate_summary(start_epoch);
    saver.prune_recovery(resumed_from_recovery ? resumed_from : "");
  }
  if (cfg.max_iter)
    log::info("Scheduled epochs: {} ({} updates of {} per epoch). LR stepped per update.", num_epochs, *cfg.max_iter,
              updates_per_epoch);
  else
    log::info("Scheduled epochs: {}. LR stepped per {}.", num_epochs, scheduler.on_updates() ? "update" : "epoch");
  // timm's default --warmup-epochs 5 on a short run: the whole run warms up and never reaches --lr
  // (timm does the same, silently); said by rank 0 alone, as every rank has the same schedule
  if (rank == 0 && !cfg.max_iter && !cfg.warmup_iters && !cfg.warmup_prefix && cfg.sched != "none" && cfg.warmup_epochs > 0 &&
      cfg.warmup_epochs >= num_epochs && start_epoch < num_epochs)
    log::warn("--warmup-epochs {} is not shorter than the {} scheduled epoch(s): the whole run is learning-rate "
              "warm-up from --warmup-lr {} and never reaches the learning rate (timm does the same); give "
              "--warmup-epochs 0 or fewer than --epochs",
              cfg.warmup_epochs, num_epochs, cfg.warmup_lr);
  if (start_epoch > 0 && cfg.sched == "plateau" && !rp.plateau.empty()) {
    const auto pm = parse_plateau(rp.plateau).value();  // checked when the checkpoint was read
    optim::Scheduler::PlateauState ps;                   // the metric-driven state as the checkpoint left it
    ps.lr = pm.lr;
    ps.best = pm.best;
    ps.num_bad = pm.num_bad;
    scheduler.set_plateau_state(ps);
    r.optimizer->set_lr(ps.lr);
  } else if (start_epoch > 0) {  // as timm: position the schedule at the resumed epoch
    if (auto s = scheduler.on_updates() ? scheduler.on_update(r.num_updates) : scheduler.on_epoch(start_epoch))
      r.optimizer->set_lr(*s);
  }

  LoopOptions lopt;
  lopt.accum_steps = cfg.grad_accum_steps;
  lopt.clip_grad = cfg.clip_grad;
  lopt.clip_mode = cfg.clip_mode;
  lopt.log_interval = cfg.log_interval;
  lopt.max_updates = cfg.max_iter.value_or(0);
  lopt.mean = dc.mean;
  lopt.std = dc.std;
  lopt.device = device;
  lopt.amp = amp.enabled;
  lopt.amp_dtype = amp.dtype;
  lopt.scaler = r.scaler.get();
  lopt.channels_last = cfg.channels_last;
  lopt.scheduler = &scheduler;
  lopt.master = r.master.get();
  lopt.dist = ctx;
  lopt.grad_sync = grad_sync.get();
  lopt.events = &events;
  // --recovery-interval: mid-epoch checkpoints after every N updates (the previous one removed);
  // resuming from one continues with the next update of the same epoch.
  std::string last_recovery;
  lopt.recovery_interval = cfg.recovery_interval;
  lopt.save_recovery = [&](int64_t update_idx, const LossMeters& meters) {
    if (!primary) return;
    const std::string path = run.path(fmt::format("recovery-{}-{}.safetensors", lopt.epoch, update_idx));
    r.write(path, lopt.epoch, saver.best_metric.value_or(0.0), saver.best_metric.value_or(0.0), saver.best_epoch,
            update_idx, meters);
    saver.prune_recovery(path);  // also those an earlier, killed process of this run left
    last_recovery = path;
  };
  EvalOptions eopt;
  eopt.device = device;
  eopt.mean = dc.mean;
  eopt.std = dc.std;
  eopt.channels_last = cfg.channels_last;
  eopt.amp = amp;
  eopt.log_interval = cfg.log_interval;
  eopt.dist = ctx;
  if (rp.rng.defined()) {
    auto g = at::detail::getDefaultCPUGenerator();
    g.set_state(rp.rng);
  }
  if (device.is_cuda() && rp.rng_cuda.defined()) {
    auto g = at::globalContext().defaultGenerator(device);
    g.set_state(rp.rng_cuda);
  } else if (device.is_cuda()) {
    if (rp.checkpoint)
      log::warn("--resume: the checkpoint has no CUDA generator state (written by a CPU run): the device's random "
                "draws do not continue the interrupted run's");
  }

  const auto fit_start = Clock::now();
  EvalResult last_eval, last_model_eval;  // last_eval is the EMA's when EMA is on (timm's metric)
  double eval_seconds = 0;                // the last epoch's evaluation time (for the ETA)
  for (int64_t epoch = start_epoch; epoch < num_epochs; ++epoch) {
    lopt.start_update = epoch == start_epoch ? rp.start_update : 0;
    lopt.start_meters = epoch == start_epoch ? rp.meters : LossMeters{};
    lopt.updates_after_epoch = (num_epochs - epoch - 1) * updates_per_epoch;
    if (cfg.max_iter)
      lopt.updates_after_epoch = std::clamp<int64_t>(
          *cfg.max_iter - r.num_updates - (updates_per_epoch - lopt.start_update), 0, lopt.updates_after_epoch);
    lopt.eval_seconds_left = eval_seconds * double(num_epochs - epoch);
    lopt.epoch = epoch;
    const auto res = train_one_epoch(task, *r.model, train_loader, *r.optimizer, r.ema.get(), r.num_updates, lopt);
    if (res.stopped_by) {
      log::info("Stopped by signal {} after update {} of epoch {}{}", res.stopped_by, res.stopped_after, epoch,
                last_recovery.empty() ? "" : "; recovery checkpoint " + last_recovery);
      log::set_file("");
      return 128 + res.stopped_by;
    }
    if (ctx && !cfg.sync_bn && !cfg.dist_bn.empty()) {  // timm's distribute_bn
      log::info("Distributing BatchNorm running means and vars");
      ctx->distribute_bn(*r.model, cfg.dist_bn == "reduce");
      if (r.ema && !cfg.model_ema_force_cpu) ctx->distribute_bn(r.ema->module(), cfg.dist_bn == "reduce");
    }
    if (train_loader.skipped_this_epoch())
      log::warn("epoch {}: skipped {} unreadable image(s) in training", epoch, train_loader.skipped_this_epoch());
    if (res.skipped_steps)
      log::warn("epoch {}: skipped {} optimizer step(s) with non-finite gradients (loss scale now {})", epoch,
                res.skipped_steps, r.scaler ? r.scaler->value() : 0.0);
    eopt.log_suffix = "";
    const auto eval_start = Clock::now();
    last_eval = last_model_eval = evaluate(task, *r.model, eval_loader, eopt);
    if (r.ema && !cfg.model_ema_force_cpu) {  // as timm: the EMA's metrics are the epoch's
      eopt.log_suffix = " (EMA)";
      last_eval = evaluate(task, r.ema->module(), eval_loader, eopt);
    }
    eval_seconds = std::chrono::duration<double>(Clock::now() - eval_start).count();
    const double metric = last_eval.get(eval_metric);
    NamedValues train_values{{"loss", res.loss}};
    train_values.insert(train_values.end(), res.parts.begin(), res.parts.end());
    run.append_summary(epoch, train_values, last_eval.metrics, r.optimizer->mean_lr());
    if (events.enabled()) {  // summary.csv's row (the EMA's metrics when EMA is on), then the model's own
      for (auto& [k, v] : train_values) events.scalar("epoch/train_" + k, v, epoch);
      for (auto& [k, v] : last_eval.metrics) events.scalar("epoch/eval_" + k, v, epoch);
      events.scalar("epoch/lr", r.optimizer->mean_lr(), epoch);
      if (r.ema && !cfg.model_ema_force_cpu)
        for (auto& [k, v] : last_model_eval.metrics) events.scalar("epoch/model_eval_" + k, v, epoch);
      events.flush();
    }
    if (primary) {  // curves.png from summary.csv; a picture that cannot be drawn never stops training
      try {
        plot_runs({run.dir()}, run.path("curves.png"));
      } catch (const std::exception& e) {
        log::warn("curves.png not written: {}", e.what());
      }
    }

    // timm's lr_scheduler.step(epoch + 1, metric), before the checkpoint so that it holds the
    // plateau scheduler's state after this epoch's metric.
    if (auto next = scheduler.on_epoch(epoch + 1, metric)) r.optimizer->set_lr(*next);
    const bool new_best = !saver.best_metric || saver.better(metric, *saver.best_metric);
    const double best_metric = new_best ? metric : *saver.best_metric;
    const int64_t best_epoch = new_best ? epoch : saver.best_epoch;
    if (primary) {
      saver.save(epoch, metric, [&](const std::string& path) {
        r.write(path, epoch, metric, best_metric, best_epoch, std::nullopt);
      });
      saver.prune_recovery("");  // last.safetensors supersedes the epoch's recovery points
      last_recovery.clear();
    }
    if (epoch + 1 < num_epochs) {  // a stop request during evaluation: after this epoch's checkpoint
      const int sig = dist::stop_signal();
      if (ctx ? ctx->any(sig != 0) : sig != 0) {
        log::info("Stopped by signal {} after epoch {} (checkpoint written)", sig ? sig : SIGTERM, epoch);
        log::set_file("");
        return 128 + (sig ? sig : SIGTERM);
      }
    }
  }
  if (saver.best_metric) log::info("*** Best metric: {} (epoch {})", *saver.best_metric, saver.best_epoch);
  if (start_epoch >= num_epochs)  // e.g. resumed from a run's end: a timm user raises --epochs to go on
    log::info("Nothing trained: training starts at epoch {} and --epochs is {} (raise --epochs to continue)",
              start_epoch, num_epochs);
  else
    log::info("Training time: {:.1f} min for epochs {}..{}",
              std::chrono::duration<double>(Clock::now() - fit_start).count() / 60.0, start_epoch, num_epochs - 1);
  if (last_eval.count && task.name() == "classification") {  // the README's headline number
    if (r.ema && !cfg.model_ema_force_cpu)
      log::info("Final test accuracy: {:.4f} (EMA; the model itself {:.4f}; top-1 of the last epoch on {} images)",
                last_eval.get("top1") / 100.0, last_model_eval.get("top1") / 100.0, last_eval.count);
    else
      log::info("Final test accuracy: {:.4f} (top-1 of the last epoch on {} images)", last_eval.get("top1") / 100.0,
                last_eval.count);
  } else if (last_eval.count) {
    log::info("Final {}: {:.2f} (the last epoch on {} images)", eval_metric, last_eval.get(eval_metric),
              last_eval.count);
  }
  log::set_file("");
  return 0;
}

}  // namespace

int train(const cli::Config& cfg) {
  if (cfg.resume != "auto") require_file(cfg.resume, "--resume");
  if (cfg.resume == "auto" && cfg.experiment.empty())
    throw UserError("--resume auto finds the run's folder from --experiment; give --experiment NAME");
  require_file(cfg.pretrained_path, "--pretrained-path");
  require_file(cfg.initial_checkpoint, "--initial-checkpoint");
  if (!cfg.resume.empty() && cfg.resume != "auto") {  // before any progress line: the error stays one line
    if (io::is_torch_save_file(cfg.resume)) Checkpoint::read(cfg.resume).require_training("--resume", cfg.model);
    const auto meta = Checkpoint::read_meta(cfg.resume);
    if (!meta.arch.empty() && meta.arch != cfg.model)
      throw UserError(fmt::format("--resume '{}': checkpoint is a {}, but --model is {}", cfg.resume, meta.arch,
                                  cfg.model));
  }
  dist::install_stop_handlers(/*exit_until_work=*/true);
  auto device = resolve_device(cfg.device, cfg.tf32);
  auto ctx = join_process_group(cfg.dist_backend, cfg.dist_timeout, cfg.rdzv_timeout, device);
  try {
    return fit(cfg, device, ctx.get());
  } catch (const UserError&) {
    throw;
  } catch (const dist::PeerLost&) {
    throw;
  } catch (const std::exception& e) {
    if (ctx)
      if (auto lost = ctx->explain(e)) throw *lost;
    throw;
  }
}

}  // namespace imgtrain::engine
