#include "engine/train_loop.h"

#include "core/error.h"
#include "core/log.h"
#include "core/meter.h"
#include "dist/launcher.h"
#include "engine/run_folder.h"
#include "engine/setup.h"

#include <torch/torch.h>

#include <algorithm>
#include <sstream>
#ifdef IMGTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <cmath>
#include <csignal>

namespace imgtrain::engine {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

Prefetcher::Prefetcher(data::Loader& loader, torch::Device device, std::vector<double> mean, std::vector<double> std,
                       bool channels_last)
    : loader_(loader), device_(device), mean_(std::move(mean)), std_(std::move(std)), channels_last_(channels_last) {
#ifdef IMGTRAIN_WITH_CUDA
  if (device.is_cuda())
    stream_ = std::make_shared<c10::cuda::CUDAStream>(c10::cuda::getStreamFromPool(false, device.index()));
#endif
}

Prefetcher::~Prefetcher() = default;

std::optional<Prefetcher::Item> Prefetcher::next() {
  if (!primed_) pending_ = load(), primed_ = true;
  std::optional<Item> cur = std::move(pending_);
  if (!cur) return cur;
  pending_ = load();  // its copy overlaps this batch's compute
  if (!cur->x.defined() && cur->batch.images.size(0) > 0) {
    cur->x = model_input(cur->batch.images, device_, mean_, std_, channels_last_);
  } else if (cur->ready) {
#ifdef IMGTRAIN_WITH_CUDA
    auto current = c10::cuda::getCurrentCUDAStream(device_.index());
    std::static_pointer_cast<at::cuda::CUDAEvent>(cur->ready)->block(current);
    cur->x.record_stream(current);  // its memory belongs to the side stream's allocations
#endif
  }
  return cur;
}

std::optional<Prefetcher::Item> Prefetcher::load() {
  auto b = loader_.next();
  if (!b) return std::nullopt;
  Item item{std::move(*b), {}, {}};
#ifdef IMGTRAIN_WITH_CUDA
  if (stream_ && item.batch.images.size(0) > 0 && item.batch.images.is_pinned()) {
    auto& stream = *std::static_pointer_cast<c10::cuda::CUDAStream>(stream_);
    c10::cuda::CUDAStreamGuard guard(stream);
    item.x = model_input(item.batch.images, device_, mean_, std_, channels_last_);
    auto ev = std::make_shared<at::cuda::CUDAEvent>();
    ev->record(stream);
    item.ready = ev;
  }
#endif
  return item;
}

double clip_gradients(std::vector<at::Tensor> params, double value, const std::string& mode) {
  if (mode == "norm") return torch::nn::utils::clip_grad_norm_(params, value, 2.0);
  if (mode == "value") {
    torch::nn::utils::clip_grad_value_(params, value);
  } else {  // agc: adaptive, unit-wise against the parameter norm (eps 1e-3)
    torch::NoGradGuard ng;
    auto unitwise_norm = [](const at::Tensor& x) {
      if (x.dim() <= 1) return x.norm(2);
      std::vector<int64_t> dims;
      for (int64_t d = 1; d < x.dim(); ++d) dims.push_back(d);
      return x.norm(2, dims, true);
    };
    for (auto& p : params) {
      if (!p.grad().defined()) continue;
      auto g = p.grad().detach();
      auto max_norm = unitwise_norm(p.detach()).clamp_(1e-3).mul_(value);
      auto grad_norm = unitwise_norm(g);
      auto clipped = g * (max_norm / grad_norm.clamp(1e-6));
      g.copy_(at::where(grad_norm < max_norm, g, clipped));
    }
  }
  return std::nan("");
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  const auto s = int64_t(std::llround(std::min(seconds, 1e9)));
  return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

std::string format_loss_meters(const LossMeters& m) {
  std::string out;
  for (const auto& [k, a] : m) out += fmt::format("{}{} {:.17g} {}", out.empty() ? "" : ";", k, a.sum, a.count);
  return out;
}

LossMeters parse_loss_meters(const std::string& text, const std::string& what) {
  LossMeters out;
  std::istringstream all(text);
  std::string item;
  while (std::getline(all, item, ';')) {
    std::istringstream in(item);
    std::string name, rest;
    AverageMeter m;
    if (!(in >> name >> m.sum >> m.count) || (in >> rest) || !std::isfinite(m.sum) || m.count < 0)
      throw UserError(fmt::format("{}: metadata 'loss_meters' has '{}', expected 'name sum count' items", what,
                                  item.substr(0, 80)));
    out.emplace_back(name, m);
  }
  return out;
}

EpochResult train_one_epoch(Task& task, torch::nn::Module& model, data::Loader& loader, optim::Optimizer& optimizer,
                            ModelEma* ema, int64_t& num_updates, const LoopOptions& o) {
  EpochResult res;
  model.train();
  task.start_epoch(o.epoch);
  if (o.dist) o.dist->reset_lagged();  // a stop answer pending from the last epoch: its end checked
  const int64_t n_batches = int64_t(loader.num_batches());
  const int64_t first_batch = std::min(n_batches, o.start_update * o.accum_steps);
  loader.start_epoch(o.epoch, size_t(first_batch));
  const int64_t last_accum = n_batches % o.accum_steps;
  const int64_t updates_per_epoch = (n_batches + o.accum_steps - 1) / o.accum_steps;
  const int64_t last_batch_idx_to_accum = n_batches - last_accum;
  AverageMeter update_time, data_time, losses;
  LossMeters parts;  // the task's named loss parts
  if (first_batch > 0) {  // resumed mid-epoch: the averages carry on from the recovery checkpoint
    for (const auto& [k, m] : o.start_meters) {
      if (k == "loss") losses = m;
      else parts.emplace_back(k, m);
    }
  }
  // Seconds left in the epoch and in the run, from the average update time so far (updates after
  // this epoch's last at the same pace, plus the evaluations still to come). --max-iter can end
  // the run inside this epoch.
  auto estimate = [&](int64_t updates_left_in_epoch) {
    if (o.max_updates > 0) updates_left_in_epoch = std::min(updates_left_in_epoch, o.max_updates - num_updates);
    const double per_update = update_time.avg();
    const double epoch_left = per_update * double(std::max<int64_t>(0, updates_left_in_epoch));
    return std::pair{epoch_left, epoch_left + per_update * double(o.updates_after_epoch) + o.eval_seconds_left};
  };
  // "Train: E [ i/N (p%)]", the start of the log line and of the live terminal line
  auto progress = [&](int64_t update_idx) {
    return fmt::format("Train: {} [{:>4d}/{} ({:>3.0f}%)]", o.epoch, update_idx, updates_per_epoch,
                       100.0 * double(update_idx + 1) / double(updates_per_epoch));
  };
  // A recovery checkpoint's meters: each rank keeps its own averages (timm's); the checkpoint holds
  // their mean, so equal per-rank counts (the sampler's) give the same epoch average after a resume.
  auto recovery_meters = [&] {
    LossMeters all{{"loss", losses}};
    all.insert(all.end(), parts.begin(), parts.end());
    if (o.dist) {
      std::vector<double> v;
      for (auto& [k, m] : all) v.push_back(m.sum), v.push_back(double(m.count));
      v = o.dist->mean(v);
      for (size_t i = 0; i < all.size(); ++i)
        all[i].second.sum = v[2 * i], all[i].second.count = int64_t(std::llround(v[2 * i + 1]));
    }
    return all;
  };
  // Gradient all-reduces this epoch: all of the group's minus the trainer's own.
  const int64_t grad_reduces0 = o.dist ? o.dist->allreduce_calls() - o.dist->own_allreduce_calls() : 0;
  int64_t updates_done = 0, micro_batches = 0;
  auto data_start = Clock::now(), update_start = Clock::now();
  int64_t update_samples = 0;
  // Under DDP the gradients are zeroed in place: they stay views of the reducer's buckets.
  const bool set_to_none = o.grad_sync == nullptr || o.master != nullptr;
  optimizer.zero_grad(set_to_none);
  StepContext step;
  step.epoch = o.epoch;
  step.autocast = o.amp;
  if (o.master) step.input_dtype = o.master->dtype(), step.float32_loss = true;
  Prefetcher prefetcher(loader, o.device, o.mean, o.std, o.channels_last);
  for (int64_t batch_idx = first_batch; batch_idx < n_batches; ++batch_idx) {
    auto item = prefetcher.next();
    if (!item) throw std::logic_error("loader ended before its batch count");
    const data::Batch& b = item->batch;
    data_time.update(seconds_since(data_start));
    const bool last_batch = batch_idx == n_batches - 1;
    ++micro_batches;
    const bool need_update = last_batch || (batch_idx + 1) % o.accum_steps == 0;
    const int64_t update_idx = batch_idx / o.accum_steps;
    // timm: the final partial group divides by its own size.
    const int64_t accum = batch_idx >= last_batch_idx_to_accum ? last_accum : o.accum_steps;
    if (b.images.size(0) > 0) {
      step.batch_idx = batch_idx;
      const int64_t n = item->x.size(0);
      // DDP: micro-steps that do not update keep their gradients local (no_sync).
      if (o.grad_sync) o.grad_sync->before_forward(need_update);
      StepOutput out;
      {
        AutocastScope autocast(o.amp && !o.master, o.device.type(), o.amp_dtype);
        out = task.forward_train(model, item->x, b, step);
      }
      at::Tensor loss = out.loss;
      // Parts beyond the total (a task whose only part is "loss" itself adds nothing to the log)
      for (auto& [k, v] : out.parts) {
        if (k == "loss") continue;
        auto it = std::find_if(parts.begin(), parts.end(), [&](auto& p) { return p.first == k; });
        if (it == parts.end()) it = parts.insert(parts.end(), {k, AverageMeter()});
        it->second.update(v.item<double>(), n);
      }
      if (o.grad_sync) o.grad_sync->after_forward(need_update);
      if (accum > 1) loss = loss / double(accum);
      (o.scaler ? o.scaler->scale(loss) : loss).backward();
      const double loss_v = loss.item<double>() * double(std::max<int64_t>(accum, 1));
      if (!std::isfinite(loss_v))
        throw UserError(fmt::format("training diverged: loss is {} at epoch {} update {} (lower --lr?)", loss_v,
                                    o.epoch, update_idx));
      losses.update(loss_v, n);
      update_samples += n * (o.dist ? o.dist->world() : 1);
    }
    if (!need_update) {
      data_start = Clock::now();
      continue;
    }
    bool finite = true;
    double grad_norm = std::nan("");  // --clip-grad with --clip-mode norm: the total norm before clipping
    if (o.master) o.master->grads_to_masters();
    std::vector<at::Tensor> params;  // what unscaling and clipping see (the masters under O2)
    if (o.scaler || o.clip_grad) params = o.master ? o.master->masters() : model.parameters();
    if (o.scaler) finite = o.scaler->unscale(params);  // before clipping, as GradScaler.unscale_
    if (o.clip_grad) {
      const auto head = size_t(task.agc_exclude_last());  // timm: the head is not clipped by agc
      if (o.clip_mode == "agc" && head && params.size() >= head) params.resize(params.size() - head);
      grad_norm = clip_gradients(params, *o.clip_grad, o.clip_mode);
    }
    if (finite) {
      optimizer.step();
      if (o.master) o.master->masters_to_model();
    } else {
      ++res.skipped_steps;
    }
    if (o.scaler) o.scaler->update();
    optimizer.zero_grad(set_to_none);
    ++num_updates;
    ++updates_done;
    const bool run_ends = o.max_updates > 0 && num_updates >= o.max_updates;  // --max-iter reached
    if (updates_done == 1) dist::mark_work_started();  // from here a stop is honoured with a checkpoint
    if (ema) ema->update(num_updates);
    update_time.update(seconds_since(update_start));
    update_start = Clock::now();
    if (last_batch || run_ends || update_idx % o.log_interval == 0) {
      double loss_now = losses.val, loss_avg = losses.avg();
      std::vector<double> vals{loss_now, loss_avg};
      for (auto& [k, m] : parts) vals.push_back(m.val), vals.push_back(m.avg());
      if (o.dist) vals = o.dist->mean(vals);  // as timm: each rank keeps its own running average; the log shows the mean
      loss_now = vals[0], loss_avg = vals[1];
      std::string part_text;
      for (size_t i = 0; i < parts.size(); ++i)
        part_text += fmt::format("  {}: {:#.3g} ({:#.3g})", parts[i].first, vals[2 + 2 * i], vals[3 + 2 * i]);
      const auto eta = estimate(updates_per_epoch - update_idx - 1);
      log::info("{}  Loss: {:#.3g} ({:#.3g})  Time: {:.3f}s, {:>7.2f}/s  "
                "({:.3f}s, {:>7.2f}/s)  LR: {:.3e}  Data: {:.3f} ({:.3f}){}  ETA epoch {}, run {}",
                progress(update_idx), loss_now, loss_avg, update_time.val, double(update_samples) / update_time.val,
                update_time.avg(), double(update_samples) / update_time.avg(), optimizer.mean_lr(), data_time.val,
                data_time.avg(), part_text, format_duration(eta.first), format_duration(eta.second));
      if (o.events && o.events->enabled()) {  // TensorBoard: the same numbers, at the update count
        o.events->scalar("train/loss", loss_now, num_updates);
        for (size_t i = 0; i < parts.size(); ++i) o.events->scalar("train/" + parts[i].first, vals[2 + 2 * i], num_updates);
        o.events->scalar("train/lr", optimizer.mean_lr(), num_updates);
        o.events->scalar("train/samples_per_sec", double(update_samples) / update_time.val, num_updates);
        o.events->scalar("train/data_time", data_time.val, num_updates);
        if (o.scaler) o.events->scalar("train/loss_scale", o.scaler->value(), num_updates);
        if (std::isfinite(grad_norm)) o.events->scalar("train/grad_norm", grad_norm, num_updates);
        o.events->flush();
      }
    } else if (log::status_enabled()) {  // an interactive terminal: a live line between the log lines
      const auto eta = estimate(updates_per_epoch - update_idx - 1);
      log::status(fmt::format("{}  Loss: {:#.3g}  ETA epoch {}, run {}", progress(update_idx), losses.avg(),
                              format_duration(eta.first), format_duration(eta.second)));
    }
    if (o.save_recovery && o.recovery_interval && (update_idx + 1) % o.recovery_interval == 0 && !last_batch &&
        !run_ends)
      o.save_recovery(update_idx, recovery_meters());
    if (o.scheduler)  // timm's lr_scheduler.step_update(num_updates) after the log line
      if (auto lr = o.scheduler->on_update(num_updates)) optimizer.set_lr(*lr);
    update_samples = 0;
    if (run_ends) break;  // every rank counts the same updates
    if (o.honour_stop && !last_batch) {  // (after the last batch, fit stops after the checkpoint)
      // Every rank stops after the same update: the flag is agreed on (one tiny all-reduce; on a
      // GPU read one update late, so the host never waits for the device here).
      const int sig = dist::stop_signal();
      if (o.dist ? o.dist->any_lagged(sig != 0) : sig != 0) {
        res.stopped_by = sig ? sig : SIGTERM;
        res.stopped_after = update_idx;
        if (o.save_recovery) o.save_recovery(update_idx, recovery_meters());
        break;
      }
    }
    data_start = Clock::now();
  }
  res.loss = losses.avg();
  for (auto& [k, m] : parts) res.parts.emplace_back(k, m.avg());
  if (o.dist && !res.parts.empty()) {
    std::vector<double> v;
    for (auto& [k, x] : res.parts) v.push_back(x);
    v = o.dist->mean(v);
    for (size_t i = 0; i < v.size(); ++i) res.parts[i].second = v[i];
  }
  if (o.dist) {
    log::info("Distributed: {} gradient all-reduce(s) for {} update(s) of {} micro-batch(es); {} bucket(s)",
              o.dist->allreduce_calls() - o.dist->own_allreduce_calls() - grad_reduces0, updates_done, micro_batches,
              o.grad_sync ? o.grad_sync->num_buckets() : 0);
    res.loss = o.dist->mean({res.loss})[0];
  }
  return res;
}

}  // namespace imgtrain::engine
