#include "engine/trainer.h"

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/loader.h"
#include "data/normalize.h"
#include "dist/launcher.h"
#include "engine/checkpoint.h"
#include "io/weights.h"
#include "model_zoo/registry.h"
#include "optim/optim.h"

#include <torch/torch.h>
#ifdef IMGTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <chrono>
#include <csignal>
#include <cmath>
#include <sstream>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace fs = std::filesystem;

namespace imgtrain::engine {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct AverageMeter {
  double val = 0, sum = 0;
  int64_t count = 0;
  void update(double v, int64_t n = 1) {
    val = v;
    sum += v * double(n);
    count += n;
  }
  double avg() const { return count ? sum / double(count) : 0.0; }
};

// What the model's default config and the flags decide about inputs (timm resolve_data_config).
struct DataConfig {
  int64_t in_chans = 3;
  int64_t img_size = 224;
  double crop_pct = 0.875;
  std::string interpolation = "bilinear";
  std::vector<double> mean, std;
};

DataConfig resolve_data_config(const cli::Config& c, const ModelDefaults& d) {
  DataConfig dc;
  dc.in_chans = c.in_chans.value_or(3);
  dc.img_size = c.img_size.value_or(d.input_size[2]);
  dc.crop_pct = c.crop_pct.value_or(d.crop_pct);
  dc.interpolation = c.interpolation.empty() ? d.interpolation : c.interpolation;
  if (dc.in_chans == 3) {
    dc.mean.assign(d.mean.begin(), d.mean.end());
    dc.std.assign(d.std.begin(), d.std.end());
  } else {
    // Single-channel (and other) inputs: the average of the RGB statistics for every channel.
    double m = (d.mean[0] + d.mean[1] + d.mean[2]) / 3, s = (d.std[0] + d.std[1] + d.std[2]) / 3;
    dc.mean.assign(size_t(dc.in_chans), m);
    dc.std.assign(size_t(dc.in_chans), s);
  }
  return dc;
}

// timm's prefetcher: the uint8 batch goes to the device as is, normalisation happens there.
// uint8 NHWC batch -> the model's float input on `dev` (the one place that does it).
at::Tensor model_input(const at::Tensor& nhwc_u8, torch::Device dev, const std::vector<double>& mean,
                       const std::vector<double>& std, bool channels_last) {
  auto x = data::normalize_nhwc_u8(nhwc_u8.to(dev, /*non_blocking=*/true), mean, std);
  return channels_last ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
}

// timm's RandomErasing on the normalised batch, each sample from its own (seed, epoch, index)
// generator, so the result does not depend on batch composition or thread count.
at::Tensor random_erase(const at::Tensor& x, const at::Tensor& indices, const data::RandomErasingConfig& c,
                        uint64_t seed, int64_t epoch) {
  const auto format = x.is_contiguous(at::MemoryFormat::ChannelsLast) ? at::MemoryFormat::ChannelsLast
                                                                       : at::MemoryFormat::Contiguous;
  auto host = x.to(torch::kCPU).permute({0, 2, 3, 1}).contiguous();  // NHWC float
  const int h = int(host.size(1)), w = int(host.size(2)), ch = int(host.size(3));
  const auto* idx = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < host.size(0); ++i) {
    cv::Mat m(h, w, CV_32FC(ch), host[i].data_ptr<float>());
    auto rng = sample_rng(seed ^ 0x657261736500ull, uint64_t(epoch), uint64_t(idx[i]));
    data::random_erasing(m, c, rng);
  }
  return host.permute({0, 3, 1, 2}).to(x.device()).contiguous(format);
}

// timm's PrefetchLoader: on CUDA, batch k + 1 is copied from pinned memory and normalised on a
// side stream while batch k trains, and the compute stream waits for it only when it is used. On
// the CPU a batch is converted when it is used.
class Prefetcher {
 public:
  struct Item {
    data::Batch batch;
    at::Tensor x;  // the model's float input on the device (normalised)
    std::shared_ptr<void> ready;  // CUDA: the side stream's event after the copy
  };
  Prefetcher(data::Loader& loader, const EpochOptions& o) : loader_(loader), o_(o) {
#ifdef IMGTRAIN_WITH_CUDA
    if (o.device.is_cuda()) stream_ = c10::cuda::getStreamFromPool(false, o.device.index());
#endif
  }
  std::optional<Item> next() {
    if (!primed_) pending_ = load(), primed_ = true;
    std::optional<Item> cur = std::move(pending_);
    if (!cur) return cur;
    pending_ = load();  // its copy overlaps this batch's compute
    if (!cur->x.defined() && cur->batch.images.size(0) > 0) {
      cur->x = model_input(cur->batch.images, o_.device, o_.mean, o_.std, o_.channels_last);
    } else if (cur->ready) {
#ifdef IMGTRAIN_WITH_CUDA
      auto current = c10::cuda::getCurrentCUDAStream(o_.device.index());
      std::static_pointer_cast<at::cuda::CUDAEvent>(cur->ready)->block(current);
      cur->x.record_stream(current);  // its memory belongs to the side stream's allocations
#endif
    }
    return cur;
  }

 private:
  std::optional<Item> load() {
    auto b = loader_.next();
    if (!b) return std::nullopt;
    Item item{std::move(*b), {}, {}};
#ifdef IMGTRAIN_WITH_CUDA
    if (stream_ && item.batch.images.size(0) > 0 && item.batch.images.is_pinned()) {
      c10::cuda::CUDAStreamGuard guard(*stream_);
      item.x = model_input(item.batch.images, o_.device, o_.mean, o_.std, o_.channels_last);
      auto ev = std::make_shared<at::cuda::CUDAEvent>();
      ev->record(*stream_);
      item.ready = ev;
    }
#endif
    return item;
  }

  data::Loader& loader_;
  const EpochOptions& o_;
  std::optional<Item> pending_;
  bool primed_ = false;
#ifdef IMGTRAIN_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> stream_;
#endif
};

struct Normalizer {
  std::vector<double> mean, std;
  bool channels_last;
  Normalizer(const DataConfig& dc, bool channels_last_) : mean(dc.mean), std(dc.std), channels_last(channels_last_) {}
  at::Tensor operator()(const at::Tensor& nhwc_u8, torch::Device dev) const {
    return model_input(nhwc_u8, dev, mean, std, channels_last);
  }
};

struct EvalMetrics {
  double loss = 0, top1 = 0, top5 = 0;
  int64_t count = 0;
};

// Percent of rows whose target is within the top-k predictions, for each k.
std::vector<double> accuracy(const at::Tensor& out, const at::Tensor& target, const std::vector<int64_t>& ks) {
  int64_t maxk = std::min<int64_t>(*std::max_element(ks.begin(), ks.end()), out.size(1));
  auto pred = std::get<1>(out.topk(maxk, 1, true, true)).t();
  auto correct = pred.eq(target.view({1, -1}).expand_as(pred));
  std::vector<double> res;
  for (auto k : ks) {
    k = std::min(k, maxk);
    res.push_back(correct.narrow(0, 0, k).reshape(-1).to(torch::kFloat32).sum().item<double>() * 100.0 /
                  double(out.size(0)));
  }
  return res;
}

// timm's validate(): log_suffix "" or " (EMA)" in train.py; validate.py's own line format when
// validate_style is set.
EvalMetrics evaluate(ClassifierImpl& model, data::Loader& loader, const Normalizer& norm, torch::Device dev,
                     int64_t log_interval, const std::string& log_suffix, Amp amp, bool validate_style = false,
                     dist::Context* ctx = nullptr) {
  torch::NoGradGuard ng;
  model.eval();
  const auto in_dtype = model.parameters().front().scalar_type();  // half under O2
  AverageMeter batch_time, losses, top1, top5;
  loader.start_epoch(0);
  const int64_t last_idx = int64_t(loader.num_batches()) - 1;
  auto end = Clock::now();
  int64_t batch_idx = 0;
  while (auto b = loader.next()) {
    if (b->labels.size(0) == 0) {
      ++batch_idx;
      continue;
    }
    auto x = norm(b->images, dev).to(in_dtype);
    auto y = b->labels.to(dev);
    at::Tensor out, loss;
    {
      AutocastScope autocast(amp.enabled, dev.type(), amp.dtype);
      out = model.forward(x);
      if (out.scalar_type() != torch::kFloat32 && !amp.enabled) out = out.to(torch::kFloat32);  // O2
      loss = torch::nn::functional::cross_entropy(out, y);
    }
    out = out.to(torch::kFloat32);
    auto acc = accuracy(out, y, {1, 5});
    int64_t n = x.size(0);
    std::vector<double> v{loss.item<double>(), acc[0], acc[1]};
    if (ctx) v = ctx->mean(v);  // timm's reduce_tensor of loss, acc1, acc5 per batch
    losses.update(v[0], n);
    top1.update(v[1], n);
    top5.update(v[2], n);
    batch_time.update(seconds_since(end));
    end = Clock::now();
    if (batch_idx == last_idx || batch_idx % log_interval == 0) {
      if (validate_style)
        log::info("Test: [{:>4d}/{}]  Time: {:.3f}s ({:.3f}s, {:>7.2f}/s)  Loss: {:>7.4f} ({:>6.4f})  "
                  "Acc@1: {:>7.3f} ({:>7.3f})  Acc@5: {:>7.3f} ({:>7.3f})",
                  batch_idx, loader.num_batches(), batch_time.val, batch_time.avg(),
                  double(n) / std::max(batch_time.avg(), 1e-9), losses.val, losses.avg(), top1.val, top1.avg(),
                  top5.val, top5.avg());
      else
        log::info("Test{}: [{:>4d}/{}]  Time: {:.3f} ({:.3f})  Loss: {:>7.3f} ({:>6.3f})  "
                  "Acc@1: {:>7.3f} ({:>7.3f})  Acc@5: {:>7.3f} ({:>7.3f})",
                  log_suffix, batch_idx, last_idx, batch_time.val, batch_time.avg(), losses.val, losses.avg(), top1.val,
                  top1.avg(), top5.val, top5.avg());
    }
    ++batch_idx;
  }
  if (loader.skipped_this_epoch())
    log::warn("evaluation skipped {} unreadable image(s)", loader.skipped_this_epoch());
  // Images seen by all ranks (timm's OrderedDistributedSampler pads the last ones by wrapping).
  return {losses.avg(), top1.avg(), top5.avg(), losses.count * (ctx ? ctx->world() : 1)};
}

std::string now_stamp() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  return buf;
}

void check_labels(const data::Dataset& ds, int64_t num_classes, const std::string& what) {
  if (ds.num_classes() > num_classes)
    throw UserError(fmt::format("--num-classes {}: the {} split has {} classes", num_classes, what, ds.num_classes()));
}

void require_file(const std::string& path, const char* flag) {
  std::error_code ec;
  if (!path.empty() && !fs::is_regular_file(path, ec))
    throw UserError(fmt::format("{} '{}': cannot open the file", flag, path));
}

// --pretrained-path FILE, or --pretrained from the offline Hugging Face cache.
void load_pretrained_weights(ClassifierImpl& model, const cli::Config& cfg, const ModelDefaults& d) {
  if (!cfg.pretrained && cfg.pretrained_path.empty()) return;
  std::string path = cfg.pretrained_path;
  if (path.empty()) {
    auto [arch, tag] = model_zoo::split_model_name(cfg.model);
    if (tag.empty()) {
      if (d.tags.empty()) throw UserError(fmt::format("--pretrained: timm has no pretrained weights for {}", arch));
      tag = d.tags.front();
    }
    path = io::find_hub_weights(arch, tag);
  }
  auto st = io::load_safetensors(path);
  auto note = io::load_pretrained(model, st, {d.first_conv, d.classifier}, path);
  log::info("Loaded pretrained weights from '{}'{}", path, note.empty() ? "" : " (" + note + ")");
}

}  // namespace

// validate.py / benchmark.py --results-file: one row, csv with a header, or json.
void write_results(const std::string& path, const std::string& format, const nlohmann::ordered_json& row) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (format == "json") {
    f << row.dump(4) << "\n";
  } else {
    std::string head, vals;
    for (auto& [k, v] : row.items()) {
      head += (head.empty() ? "" : ",") + k;
      vals += (vals.empty() ? "" : ",") + (v.is_string() ? v.get<std::string>() : v.dump());
    }
    f << head << "\n" << vals << "\n";
  }
  if (!f) throw UserError(fmt::format("--results-file '{}': cannot write", path));
}

double round_to(double v, int digits) {
  const double s = std::pow(10.0, digits);
  return std::nearbyint(v * s) / s;
}

void to_channels_last(torch::nn::Module& m) {
  torch::NoGradGuard ng;
  for (auto& p : m.parameters())
    if (p.dim() == 4) p.set_data(p.contiguous(at::MemoryFormat::ChannelsLast));
}

torch::Device resolve_device(const std::string& d) {
  if (d == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (d == "cpu") return torch::kCPU;
  if (!torch::cuda::is_available())
    throw UserError(fmt::format("--device '{}': no CUDA device is available here (use --device cpu)", d));
  int idx = d == "cuda" ? 0 : std::stoi(d.substr(5));
  if (idx >= int(torch::cuda::device_count()))
    throw UserError(fmt::format("--device '{}': only {} CUDA device(s) present", d, torch::cuda::device_count()));
  return torch::Device(torch::kCUDA, c10::DeviceIndex(idx));
}

Amp resolve_amp(const cli::Config& cfg) {
  Amp a;
  a.o2 = cfg.amp_opt_level == "O2";
  a.enabled = cfg.amp_opt_level == "O1" || (cfg.amp && cfg.amp_opt_level != "O0" && !a.o2);
  a.dtype = cfg.amp_dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  return a;
}

void clip_gradients(std::vector<at::Tensor> params, double value, const std::string& mode) {
  if (mode == "norm") {
    torch::nn::utils::clip_grad_norm_(params, value, 2.0);
  } else if (mode == "value") {
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
}

EpochResult train_one_epoch(ClassifierImpl& model, data::Loader& loader, optim::Optimizer& optimizer, ModelEma* ema,
                            int64_t& num_updates, const EpochOptions& o) {
  EpochResult res;
  model.train();
  const int64_t n_batches = int64_t(loader.num_batches());
  const int64_t first_batch = std::min(n_batches, o.start_update * o.accum_steps);
  loader.start_epoch(o.epoch, size_t(first_batch));
  const int64_t last_accum = n_batches % o.accum_steps;
  const int64_t updates_per_epoch = (n_batches + o.accum_steps - 1) / o.accum_steps;
  const int64_t last_batch_idx_to_accum = n_batches - last_accum;
  AverageMeter update_time, data_time, losses;
  // Gradient all-reduces this epoch: all of the group's minus the trainer's own.
  const int64_t grad_reduces0 = o.dist ? o.dist->allreduce_calls() - o.dist->own_allreduce_calls() : 0;
  int64_t updates_done = 0, micro_batches = 0;
  auto data_start = Clock::now(), update_start = Clock::now();
  int64_t update_samples = 0;
  // Under DDP the gradients are zeroed in place: they stay views of the reducer's buckets.
  const bool set_to_none = o.grad_sync == nullptr || o.master != nullptr;
  optimizer.zero_grad(set_to_none);
  Prefetcher prefetcher(loader, o);
  for (int64_t batch_idx = first_batch; batch_idx < n_batches; ++batch_idx) {
    auto item = prefetcher.next();
    if (!item) throw std::logic_error("loader ended before its batch count");
    data::Batch* b = &item->batch;
    data_time.update(seconds_since(data_start));
    const bool last_batch = batch_idx == n_batches - 1;
    ++micro_batches;
    const bool need_update = last_batch || (batch_idx + 1) % o.accum_steps == 0;
    const int64_t update_idx = batch_idx / o.accum_steps;
    // timm: the final partial group divides by its own size.
    const int64_t accum = batch_idx >= last_batch_idx_to_accum ? last_accum : o.accum_steps;
    if (b->labels.size(0) > 0) {
      auto x = item->x;
      if (o.erase) x = random_erase(x, b->indices, *o.erase, o.seed, o.epoch);
      at::Tensor y = b->labels.to(o.device);
      if (o.mixup.active() && o.mixup_enabled && x.size(0) % 2 == 0) {
        // Each rank mixes with its own draws (timm seeds each rank's mixup with seed + rank).
        const uint64_t rank = o.dist ? uint64_t(o.dist->rank()) : 0;
        auto rng = sample_rng((o.seed + rank) ^ 0x6d69787570ull, uint64_t(o.epoch), uint64_t(batch_idx));
        y = data::apply_mixup(x, y, o.mixup, rng);
      }
      at::Tensor loss;
      // DDP: micro-steps that do not update keep their gradients local (no_sync).
      if (o.grad_sync) o.grad_sync->before_forward(need_update);
      if (o.master) {  // O2: half inputs through the half model, the loss in float32
        loss = train_loss(model.forward(x.to(o.master->dtype())).to(torch::kFloat32), y, o.loss);
      } else {
        AutocastScope autocast(o.amp, o.device.type(), o.amp_dtype);
        loss = train_loss(model.forward(x), y, o.loss);
      }
      if (o.grad_sync) o.grad_sync->after_forward(need_update);
      if (accum > 1) loss = loss / double(accum);
      (o.scaler ? o.scaler->scale(loss) : loss).backward();
      const double loss_v = loss.item<double>() * double(std::max<int64_t>(accum, 1));
      if (!std::isfinite(loss_v))
        throw UserError(fmt::format("training diverged: loss is {} at epoch {} update {} (lower --lr?)", loss_v,
                                    o.epoch, update_idx));
      losses.update(loss_v, x.size(0));
      update_samples += x.size(0) * (o.dist ? o.dist->world() : 1);
    }
    if (!need_update) {
      data_start = Clock::now();
      continue;
    }
    bool finite = true;
    if (o.master) o.master->grads_to_masters();
    std::vector<at::Tensor> params;  // what unscaling and clipping see (the masters under O2)
    if (o.scaler || o.clip_grad) params = o.master ? o.master->masters() : model.parameters();
    if (o.scaler) finite = o.scaler->unscale(params);  // before clipping, as GradScaler.unscale_
    if (o.clip_grad) {
      if (o.clip_mode == "agc" && params.size() >= 2) params.resize(params.size() - 2);  // timm: head excluded
      clip_gradients(params, *o.clip_grad, o.clip_mode);
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
    if (ema) ema->update(num_updates);
    update_time.update(seconds_since(update_start));
    update_start = Clock::now();
    if (last_batch || update_idx % o.log_interval == 0) {
      double loss_now = losses.val, loss_avg = losses.avg();
      if (o.dist) {  // as timm: each rank keeps its own running average; the log shows the mean
        auto m = o.dist->mean({loss_now, loss_avg});
        loss_now = m[0], loss_avg = m[1];
      }
      log::info("Train: {} [{:>4d}/{} ({:>3.0f}%)]  Loss: {:#.3g} ({:#.3g})  Time: {:.3f}s, {:>7.2f}/s  "
                "({:.3f}s, {:>7.2f}/s)  LR: {:.3e}  Data: {:.3f} ({:.3f})",
                o.epoch, update_idx, updates_per_epoch, 100.0 * double(update_idx + 1) / double(updates_per_epoch),
                loss_now, loss_avg, update_time.val, double(update_samples) / update_time.val,
                update_time.avg(), double(update_samples) / update_time.avg(), optimizer.mean_lr(), data_time.val,
                data_time.avg());
    }
    if (o.save_recovery && o.recovery_interval && (update_idx + 1) % o.recovery_interval == 0 && !last_batch)
      o.save_recovery(update_idx);
    if (o.scheduler)  // timm's lr_scheduler.step_update(num_updates) after the log line
      if (auto lr = o.scheduler->on_update(num_updates)) optimizer.set_lr(*lr);
    update_samples = 0;
    if (o.honour_stop && !last_batch) {  // (after the last batch, train() stops after the checkpoint)
      // Every rank stops after the same update: the flag is agreed on (one tiny all-reduce).
      const int sig = dist::stop_signal();
      if (o.dist ? o.dist->any(sig != 0) : sig != 0) {
        res.stopped_by = sig ? sig : SIGTERM;
        res.stopped_after = update_idx;
        if (o.save_recovery) o.save_recovery(update_idx);
        break;
      }
    }
    data_start = Clock::now();
  }
  res.loss = losses.avg();
  if (o.dist) {
    log::info("Distributed: {} gradient all-reduce(s) for {} update(s) of {} micro-batch(es); {} bucket(s)",
              o.dist->allreduce_calls() - o.dist->own_allreduce_calls() - grad_reduces0, updates_done, micro_batches,
              o.grad_sync ? o.grad_sync->num_buckets() : 0);
    res.loss = o.dist->mean({res.loss})[0];
  }
  return res;
}

namespace {
// timm's --bn-momentum / --bn-eps (which timm passes to the model factory, so only families that
// take them honour it); here they apply to every BatchNorm of any model.
void apply_bn_args(torch::nn::Module& m, const cli::Config& cfg) {
  if (!cfg.bn_momentum && !cfg.bn_eps) return;
  for (auto& mod : m.modules(/*include_self=*/false))
    if (auto* bn = mod->as<torch::nn::BatchNorm2dImpl>()) {
      if (cfg.bn_momentum) bn->options.momentum(*cfg.bn_momentum);
      if (cfg.bn_eps) bn->options.eps(*cfg.bn_eps);
    }
}
}  // namespace

namespace {
// --resume auto: the newest training checkpoint in the run's folder (the one with the most
// updates; at a tie the end-of-epoch file), or "" when there is none yet.
std::string find_latest_checkpoint(const std::string& dir) {
  std::error_code ec;
  std::string best;
  std::pair<int64_t, int> best_key{-1, 0};
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (e.path().extension() != ".safetensors" || name.find(".tmp") != std::string::npos) continue;
    std::map<std::string, std::string> md;
    try {
      md = io::load_safetensors_metadata(e.path().string());
    } catch (const UserError&) {
      log::warn("--resume auto: ignoring unreadable file '{}'", e.path().string());
      continue;
    }
    if (!md.count("num_updates") || !md.count("epoch")) continue;
    const std::pair<int64_t, int> key{std::stoll(md["num_updates"]), md.count("recovery_update") ? 0 : 1};
    if (key > best_key) best_key = key, best = e.path().string();
  }
  return best;
}

int fit(const cli::Config& cfg, torch::Device device, dist::Context* ctx);
}  // namespace

std::shared_ptr<dist::Context> join_process_group(const cli::Config& cfg, torch::Device& device) {
  const auto denv = dist::read_env();
  log::set_rank(int(denv.rank));
  if (!denv.distributed()) return nullptr;
  if (device.is_cuda()) {  // one device per process: the local rank's
    if (denv.local_rank >= int64_t(torch::cuda::device_count()))
      throw UserError(fmt::format("LOCAL_RANK {}: only {} CUDA device(s) on this host", denv.local_rank,
                                  torch::cuda::device_count()));
    device = torch::Device(torch::kCUDA, c10::DeviceIndex(denv.local_rank));
  }
  dist::InitOptions io;
  io.backend = cfg.dist_backend;
  io.timeout = std::chrono::seconds(cfg.dist_timeout);
  io.device = device;
  return dist::Context::init(denv, io);
}

data::TransformConfig train_geometry(const cli::Config& cfg, int size, int channels) {
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

data::LoaderOptions train_loader_options(const cli::Config& cfg) {
  data::LoaderOptions lo;
  lo.batch_size = cfg.batch_size;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.workers = cfg.workers;
  lo.seed = uint64_t(cfg.seed);
  return lo;
}

int train(const cli::Config& cfg) {
  if (cfg.resume != "auto") require_file(cfg.resume, "--resume");
  if (cfg.resume == "auto" && cfg.experiment.empty())
    throw UserError("--resume auto finds the run's folder from --experiment; give --experiment NAME");
  require_file(cfg.pretrained_path, "--pretrained-path");
  require_file(cfg.initial_checkpoint, "--initial-checkpoint");
  dist::install_stop_handlers();
  auto device = resolve_device(cfg.device);
  auto ctx = join_process_group(cfg, device);
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

namespace {
int fit(const cli::Config& cfg, torch::Device device, dist::Context* ctx) {
  const int64_t rank = ctx ? ctx->rank() : 0, world = ctx ? ctx->world() : 1;
  const bool primary = rank == 0;  // only rank 0 writes files
  torch::manual_seed(uint64_t(cfg.seed + rank));  // timm's random_seed(seed, rank)
  const auto& defaults = model_zoo::model_defaults(cfg.model);  // unknown model fails before data loading
  const DataConfig dc = resolve_data_config(cfg, defaults);
  const Amp amp = resolve_amp(cfg);
  std::unique_ptr<LossScaler> scaler;
  if ((amp.enabled || amp.o2) && amp.dtype == at::kHalf)
    scaler = std::make_unique<LossScaler>(cfg.loss_scale.value_or(65536.0), !cfg.loss_scale, device);

  auto train_ds = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.train_split);
  auto eval_ds = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.val_split);
  const int64_t num_classes = cfg.num_classes.value_or(train_ds->num_classes());
  check_labels(*train_ds, num_classes, "train");
  check_labels(*eval_ds, num_classes, "validation");
  if ((cfg.mixup > 0 || cfg.cutmix > 0 || !cfg.cutmix_minmax.empty()) && cfg.batch_size % 2)
    throw UserError(fmt::format("--batch-size {}: mixup/cutmix mixes each sample with its mirror and needs an even "
                                "batch size", cfg.batch_size));
  if (int64_t(train_ds->size()) / world < cfg.batch_size)
    throw UserError(fmt::format("--batch-size {}: the train split has only {} images for {} process(es) (batches "
                                "drop the remainder)", cfg.batch_size, train_ds->size(), world));

  // (after the data checks, so that a user error stays one line)
  if (ctx)
    log::info("Training in distributed mode with multiple processes, 1 device per process. Process {}, total {}, "
              "device {} ({}).",
              rank, world, device.str(), ctx->backend());
  else
    log::info("Training with a single process on 1 device ({}).", device.str());
  ModelArgs margs;
  margs.num_classes = num_classes;
  margs.in_chans = dc.in_chans;
  margs.drop_rate = cfg.drop;
  margs.drop_path_rate = cfg.drop_path.value_or(0.0);
  margs.img_size = dc.img_size;
  margs.global_pool = cfg.gp;
  auto model = model_zoo::create_model(cfg.model, margs);
  apply_bn_args(*model, cfg);
  log::info("Model {} created, param count:{}", cfg.model, model_zoo::count_params(*model));
  load_pretrained_weights(*model, cfg, defaults);
  if (scaler)
    log::info("Using {}. Training in mixed precision ({} loss scaling).",
              amp.o2 ? "O2: half-precision weights with float32 master weights" : "native Torch AMP",
              cfg.loss_scale ? fmt::format("static {}", *cfg.loss_scale) : std::string("dynamic"));
  else if (amp.enabled || amp.o2)
    log::info("Using native Torch AMP. Training in mixed precision (bfloat16, no loss scaling).");
  else
    log::info("AMP not enabled. Training in float32.");

  if (!cfg.initial_checkpoint.empty()) {
    auto st = io::load_safetensors(cfg.initial_checkpoint);
    io::load_state_dict(*model, st, io::weights_prefix(st, true), cfg.initial_checkpoint);
    log::info("Loaded weights from '{}'", cfg.initial_checkpoint);
  }
  model->to(device);
  if (cfg.channels_last) to_channels_last(*model);
  if (ctx) {
    if (cfg.sync_bn) ctx->convert_sync_batchnorm(*model);
    ctx->broadcast_model(*model);  // every rank starts from rank 0's weights and buffers
  }
  std::unique_ptr<MasterWeights> master;
  if (amp.o2) master = std::make_unique<MasterWeights>(*model, amp.dtype);

  data::TransformConfig train_tc = train_geometry(cfg, int(dc.img_size), int(dc.in_chans));
  train_tc.no_aug = cfg.no_aug;
  train_tc.vflip = cfg.vflip;
  if (!cfg.aa.empty() && !cfg.no_aug) {
    std::vector<double> mean(dc.mean.begin(), dc.mean.end());
    auto hp = data::timm_aa_hparams(cfg.aa, int(dc.img_size), mean, cfg.train_interpolation);
    train_tc.auto_augment = std::make_shared<const data::AugmentPolicy>(data::parse_augment(cfg.aa, hp));
  }
  // timm: colour jitter only without an --aa policy (or with a '3a' one)
  train_tc.color_jitter = cfg.aa.empty() || cfg.aa.find("3a") != std::string::npos ? cfg.color_jitter : 0.0;
  data::TransformConfig eval_tc = train_tc;
  eval_tc.train = false;
  eval_tc.crop_pct = dc.crop_pct;
  eval_tc.interpolation = dc.interpolation;

  data::LoaderOptions lo = train_loader_options(cfg);
  lo.pin_memory = cfg.pin_mem && device.is_cuda();
  lo.rank = rank;
  lo.world = world;
  lo.repeats = cfg.aug_repeats;
  data::Loader train_loader(train_ds, train_tc, lo);
  data::LoaderOptions elo = lo;
  elo.repeats = 0;  // evaluation: timm's OrderedDistributedSampler
  elo.batch_size = cfg.validation_batch_size.value_or(cfg.batch_size);
  elo.shuffle = false;
  elo.drop_last = false;
  data::Loader eval_loader(eval_ds, eval_tc, elo);
  const Normalizer norm(dc, cfg.channels_last);

  // timm: lr unset -> lr_base scaled by the global batch size.
  double lr;
  if (cfg.lr) {
    lr = *cfg.lr;
  } else {
    const int64_t global_batch = cfg.batch_size * cfg.grad_accum_steps * world;
    std::string how;
    lr = optim::scaled_lr(cfg.lr_base, cfg.lr_base_size, cfg.lr_base_scale, cfg.opt, global_batch, &how);
    log::info("Learning rate ({}) calculated from base learning rate ({}) and effective global batch size ({}) "
              "with {} scaling.",
              lr, cfg.lr_base, global_batch, how);
  }
  optim::OptimizerArgs oa;
  oa.opt = cfg.opt;
  oa.lr = lr;
  oa.weight_decay = cfg.weight_decay;
  oa.momentum = cfg.momentum;
  oa.eps = cfg.opt_eps;
  if (cfg.opt_betas.size() == 2) oa.beta1 = cfg.opt_betas[0], oa.beta2 = cfg.opt_betas[1];
  std::vector<std::pair<std::string, at::Tensor>> named;
  if (master) named = master->named_masters();
  else
    for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  oa.layer_decay = cfg.layer_decay;
  if (cfg.layer_decay && model->group_matcher().empty())
    throw UserError(fmt::format("--layer-decay: {} has no layer grouping", cfg.model));
  auto optimizer = optim::create_optimizer(oa, named, model->no_weight_decay(), model->group_matcher());
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
  sa.on_updates = cfg.sched_on_updates;
  sa.updates_per_epoch = int64_t((train_loader.num_batches() + size_t(cfg.grad_accum_steps) - 1) /
                                 size_t(cfg.grad_accum_steps));
  sa.decay_milestones.clear();
  for (double m : cfg.decay_milestones) sa.decay_milestones.push_back(int64_t(m));
  std::sort(sa.decay_milestones.begin(), sa.decay_milestones.end());
  optim::Scheduler scheduler(sa);
  if (cfg.sched == "plateau" && cfg.sched_on_updates)
    throw UserError("--sched plateau steps per epoch only (it follows the eval metric); drop --sched-on-updates");
  optimizer->set_lr(scheduler.initial_lr());
  const int64_t num_epochs = scheduler.num_epochs();

  // Output folder, args.yaml, log.
  const std::string exp = !cfg.experiment.empty()
                              ? cfg.experiment
                              : fmt::format("{}-{}-{}", now_stamp(), cfg.model, dc.img_size);
  const std::string out_dir = (fs::path(cfg.output.empty() ? "./output/train" : cfg.output) / exp).string();
  std::error_code ec;
  if (primary) fs::create_directories(out_dir, ec);
  if (ec) throw UserError(fmt::format("--output '{}': cannot create the folder ({})", out_dir, ec.message()));
  const std::string args_yaml = cli::to_yaml(cli::Command::Train, cfg);
  if (primary) {
    std::ofstream f(out_dir + "/args.yaml");
    f << args_yaml;
    if (!f) throw UserError(fmt::format("cannot write '{}/args.yaml'", out_dir));
  }
  if (primary) log::set_file(out_dir + "/log.txt");

  // --resume auto (a restarted or preempted job): the newest checkpoint of this run's folder.
  std::string resume_path = cfg.resume;
  if (cfg.resume == "auto") {
    resume_path = find_latest_checkpoint(out_dir);
    if (resume_path.empty()) log::info("--resume auto: no checkpoint in '{}' yet; starting from scratch", out_dir);
  }

  const bool decreasing = cfg.eval_metric == "loss";
  CheckpointSaver saver(out_dir, cfg.checkpoint_hist, decreasing);
  int64_t start_epoch = 0, num_updates = 0, start_update = 0;
  at::Tensor resume_rng;
  std::string resume_plateau;
  if (!resume_path.empty()) {
    auto st = io::load_safetensors(resume_path);
    auto meta = [&](const std::string& k) -> std::string {
      auto it = st.metadata.find(k);
      if (it == st.metadata.end())
        throw UserError(fmt::format("--resume '{}': not an imgtrain training checkpoint (no '{}')", resume_path, k));
      return it->second;
    };
    if (meta("arch") != cfg.model)
      throw UserError(fmt::format("--resume '{}': checkpoint is a {}, but --model is {}", resume_path, meta("arch"),
                                  cfg.model));
    io::load_state_dict(*model, st, "model.", resume_path);
    if (master) {  // the float32 masters as saved (the model's half weights are their rounding)
      torch::NoGradGuard ng;
      for (auto& [k, t] : master->named_masters()) {
        auto* saved = st.find("master." + k);
        if (!saved) throw UserError(fmt::format("--resume '{}': no O2 master weights (master.{})", resume_path, k));
        t.copy_(*saved);
      }
    }
    if (!cfg.no_resume_opt) {
      std::map<std::string, at::Tensor> ost;
      for (auto& [k, v] : st.tensors)
        if (k.rfind("optim.", 0) == 0) ost[k.substr(6)] = v;
      optimizer->load_state(ost);
    }
    if (scaler) {
      std::map<std::string, at::Tensor> sst;
      for (auto& [k, v] : st.tensors)
        if (k.rfind("scaler.", 0) == 0) sst[k.substr(7)] = v;
      scaler->load_state(sst);
    }
    if (auto* rng = st.find("rng.cpu")) resume_rng = *rng;  // restored last, after anything that draws
    start_epoch = std::stoll(meta("epoch")) + 1;
    if (auto it = st.metadata.find("recovery_update"); it != st.metadata.end()) {
      --start_epoch;  // a mid-epoch recovery point: the same epoch, from the next update
      start_update = std::stoll(it->second) + 1;
    }
    if (auto it = st.metadata.find("plateau"); it != st.metadata.end()) resume_plateau = it->second;
    num_updates = std::stoll(meta("num_updates"));
    if (st.metadata.count("best_metric")) {
      saver.best_metric = std::stod(st.metadata["best_metric"]);
      saver.best_epoch = std::stoll(st.metadata["best_epoch"]);
    }
    log::info("Resumed from checkpoint '{}' (epoch {})", resume_path, start_epoch - 1);
  }
  std::unique_ptr<ModelEma> ema;
  if (cfg.model_ema) {
    // Created after any resume of the model, as timm does, then given the checkpoint's EMA.
    auto ema_model = model_zoo::create_model(cfg.model, margs);
    apply_bn_args(*ema_model, cfg);
    ema = std::make_unique<ModelEma>(ema_model, *model, cfg.model_ema_decay,
                                     cfg.model_ema_warmup, cfg.model_ema_force_cpu ? torch::kCPU : device);
    if (cfg.channels_last) to_channels_last(ema->module());
    if (!resume_path.empty()) {
      auto st = io::load_safetensors(resume_path);
      if (io::weights_prefix(st, true) == "ema.") io::load_state_dict(ema->module(), st, "ema.", resume_path);
    }
  }
  std::unique_ptr<dist::GradSync> grad_sync;  // created last, on the final parameters (as DDP)
  if (ctx) grad_sync = ctx->grad_sync(*model, cfg.bucket_cap_mb, !cfg.no_ddp_bb);
  if (cfg.start_epoch) start_epoch = *cfg.start_epoch;
  log::info("Scheduled epochs: {}. LR stepped per {}.", num_epochs, cfg.sched_on_updates ? "update" : "epoch");
  if (start_epoch > 0 && cfg.sched == "plateau" && !resume_plateau.empty()) {
    optim::Scheduler::PlateauState ps;  // the metric-driven state as the checkpoint left it
    std::istringstream in(resume_plateau);
    in >> ps.lr >> ps.best >> ps.num_bad;
    scheduler.set_plateau_state(ps);
    optimizer->set_lr(ps.lr);
  } else if (start_epoch > 0) {  // as timm: position the schedule at the resumed epoch
    if (auto s = cfg.sched_on_updates ? scheduler.on_update(num_updates)
                                      : scheduler.on_epoch(start_epoch))
      optimizer->set_lr(*s);
  }

  const auto fit_start = Clock::now();
  EvalMetrics last_eval, last_model_eval;  // last_eval is the EMA's when EMA is on (timm's metric)
  EpochOptions eo;
  eo.accum_steps = cfg.grad_accum_steps;
  eo.seed = uint64_t(cfg.seed);
  eo.loss.smoothing = cfg.smoothing;
  eo.loss.bce = cfg.bce_loss;
  eo.loss.bce_target_thresh = cfg.bce_target_thresh;
  eo.loss.bce_sum = cfg.bce_sum;
  eo.mixup.mixup_alpha = cfg.mixup;
  eo.mixup.cutmix_alpha = cfg.cutmix;
  eo.mixup.cutmix_minmax = cfg.cutmix_minmax;
  eo.mixup.prob = cfg.mixup_prob;
  eo.mixup.switch_prob = cfg.mixup_switch_prob;
  eo.mixup.mode = cfg.mixup_mode;
  eo.mixup.label_smoothing = cfg.smoothing;
  eo.mixup.num_classes = num_classes;
  eo.clip_grad = cfg.clip_grad;
  eo.clip_mode = cfg.clip_mode;
  eo.log_interval = cfg.log_interval;
  eo.mean = dc.mean;
  eo.std = dc.std;
  eo.device = device;
  eo.amp = amp.enabled;
  eo.amp_dtype = amp.dtype;
  eo.scaler = scaler.get();
  eo.channels_last = cfg.channels_last;
  // One checkpoint file (atomic, safetensors): everything --resume needs to continue exactly.
  auto write_checkpoint = [&](const std::string& path, int64_t epoch, double metric, double best_metric,
                              int64_t best_epoch, const optim::Scheduler::PlateauState& plateau,
                              const std::map<std::string, std::string>& extra) {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (auto& [k, v] : io::state_dict(*model)) tensors.emplace_back("model." + k, v);
    if (ema)
      for (auto& [k, v] : io::state_dict(ema->module())) tensors.emplace_back("ema." + k, v);
    for (auto& [k, v] : optimizer->state()) tensors.emplace_back("optim." + k, v);
    if (master)
      for (auto& [k, v] : master->named_masters()) tensors.emplace_back("master." + k, v);
    if (scaler)
      for (auto& [k, v] : scaler->state()) tensors.emplace_back("scaler." + k, v);
    tensors.emplace_back("rng.cpu", at::detail::getDefaultCPUGenerator().get_state());
    std::map<std::string, std::string> md{{"epoch", std::to_string(epoch)},
                                          {"arch", cfg.model},
                                          {"args", args_yaml},
                                          {"metric", fmt::format("{}", metric)},
                                          {"best_metric", fmt::format("{}", best_metric)},
                                          {"best_epoch", std::to_string(best_epoch)},
                                          {"num_updates", std::to_string(num_updates)},
                                          {"num_classes", std::to_string(num_classes)},
                                          {"in_chans", std::to_string(dc.in_chans)},
                                          {"global_pool", cfg.gp},
                                          {"img_size", std::to_string(dc.img_size)},
                                          {"crop_pct", fmt::format("{}", dc.crop_pct)},
                                          {"plateau", fmt::format("{} {} {}", plateau.lr, plateau.best,
                                                                  plateau.num_bad)},
                                          {"version", "2"}};
    for (auto& [k, v] : extra) md[k] = v;
    io::save_safetensors(path, tensors, md);
  };
  // --recovery-interval: mid-epoch checkpoints after every N updates (the previous one removed);
  // resuming from one continues with the next update of the same epoch.
  std::string last_recovery;
  eo.recovery_interval = cfg.recovery_interval;
  eo.save_recovery = [&](int64_t update_idx) {
    if (!primary) return;
    const std::string path = fmt::format("{}/recovery-{}-{}.safetensors", out_dir, eo.epoch, update_idx);
    write_checkpoint(path, eo.epoch, saver.best_metric.value_or(0.0), saver.best_metric.value_or(0.0),
                     saver.best_epoch, scheduler.plateau_state(), {{"recovery_update", std::to_string(update_idx)}});
    if (!last_recovery.empty() && last_recovery != path) fs::remove(last_recovery, ec);
    last_recovery = path;
  };
  if (cfg.reprob > 0 && !cfg.no_aug) {
    data::RandomErasingConfig re;
    re.probability = cfg.reprob;
    re.mode = data::parse_erase_mode(cfg.remode);
    re.max_count = int(cfg.recount);
    eo.erase = re;
  }
  eo.scheduler = &scheduler;
  eo.master = master.get();
  eo.dist = ctx;
  eo.grad_sync = grad_sync.get();
  if (resume_rng.defined()) {
    auto g = at::detail::getDefaultCPUGenerator();
    g.set_state(resume_rng);
  }
  for (int64_t epoch = start_epoch; epoch < num_epochs; ++epoch) {
    eo.start_update = epoch == start_epoch ? start_update : 0;
    eo.epoch = epoch;
    eo.mixup_enabled = !(cfg.mixup_off_epoch && epoch >= cfg.mixup_off_epoch);
    const auto res = train_one_epoch(*model, train_loader, *optimizer, ema.get(), num_updates, eo);
    if (res.stopped_by) {
      log::info("Stopped by signal {} after update {} of epoch {}{}", res.stopped_by, res.stopped_after, epoch,
                last_recovery.empty() ? "" : "; recovery checkpoint " + last_recovery);
      log::set_file("");
      return 128 + res.stopped_by;
    }
    const double train_loss = res.loss;
    if (ctx && !cfg.sync_bn && !cfg.dist_bn.empty()) {  // timm's distribute_bn
      log::info("Distributing BatchNorm running means and vars");
      ctx->distribute_bn(*model, cfg.dist_bn == "reduce");
      if (ema && !cfg.model_ema_force_cpu) ctx->distribute_bn(ema->module(), cfg.dist_bn == "reduce");
    }
    if (train_loader.skipped_this_epoch())
      log::warn("epoch {}: skipped {} unreadable image(s) in training", epoch, train_loader.skipped_this_epoch());

    if (res.skipped_steps)
      log::warn("epoch {}: skipped {} optimizer step(s) with non-finite gradients (loss scale now {})", epoch,
                res.skipped_steps, scaler ? scaler->value() : 0.0);
    last_eval = last_model_eval = evaluate(*model, eval_loader, norm, device, cfg.log_interval, "", amp, false, ctx);
    if (ema && !cfg.model_ema_force_cpu)  // as timm: the EMA's metrics are the epoch's
      last_eval = evaluate(ema->module(), eval_loader, norm, device, cfg.log_interval, " (EMA)", amp, false, ctx);
    const double metric = cfg.eval_metric == "top5" ? last_eval.top5 : cfg.eval_metric == "loss" ? last_eval.loss : last_eval.top1;

    // summary.csv with timm's columns.
    const std::string summary = out_dir + "/summary.csv";
    const bool header = !fs::exists(summary);
    if (primary) {
      std::ofstream f(summary, std::ios::app);
      if (header) f << "epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\n";
      f << fmt::format("{},{},{},{},{},{}\n", epoch, train_loss, last_eval.loss, last_eval.top1, last_eval.top5,
                       optimizer->mean_lr());
    }

    // timm's lr_scheduler.step(epoch + 1, metric), before the checkpoint so that it holds the
    // plateau scheduler's state after this epoch's metric.
    if (auto next = scheduler.on_epoch(epoch + 1, metric)) optimizer->set_lr(*next);
    const auto plateau = scheduler.plateau_state();

    const bool new_best = !saver.best_metric || saver.better(metric, *saver.best_metric);
    const double best_metric = new_best ? metric : *saver.best_metric;
    const int64_t best_epoch = new_best ? epoch : saver.best_epoch;
    if (primary)
      saver.save(epoch, metric, [&](const std::string& path) {
        write_checkpoint(path, epoch, metric, best_metric, best_epoch, plateau, {});
      });
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
  log::info("Training time: {:.1f} min for epochs {}..{}", seconds_since(fit_start) / 60.0, start_epoch,
            num_epochs - 1);
  if (last_eval.count && ema && !cfg.model_ema_force_cpu)
    log::info("Final test accuracy: {:.4f} (EMA; the model itself {:.4f}; top-1 of the last epoch on {} images)",
              last_eval.top1 / 100.0, last_model_eval.top1 / 100.0, last_eval.count);
  else if (last_eval.count)
    log::info("Final test accuracy: {:.4f} (top-1 of the last epoch on {} images)", last_eval.top1 / 100.0,
              last_eval.count);
  log::set_file("");
  return 0;
}
}  // namespace

int validate(const cli::Config& cfg) {
  if (cfg.checkpoint.empty() && !cfg.pretrained && cfg.pretrained_path.empty())
    throw UserError("validate needs --checkpoint FILE, --pretrained or --pretrained-path FILE");
  require_file(cfg.checkpoint, "--checkpoint");
  require_file(cfg.pretrained_path, "--pretrained-path");
  const auto device = resolve_device(cfg.device);
  io::SafeTensors st;
  if (!cfg.checkpoint.empty()) st = io::load_safetensors(cfg.checkpoint);
  auto meta_int = [&](const char* k) -> std::optional<int64_t> {
    auto it = st.metadata.find(k);
    if (it == st.metadata.end()) return std::nullopt;
    return std::stoll(it->second);
  };
  std::string arch = cfg.model;
  if (auto it = st.metadata.find("arch"); it != st.metadata.end() && cfg.model == cli::Config{}.model)
    arch = it->second;  // --model left at its default: take the checkpoint's
  const auto& defaults = model_zoo::model_defaults(arch);
  cli::Config c = cfg;
  if (!c.in_chans) c.in_chans = meta_int("in_chans");
  if (auto it = st.metadata.find("global_pool"); c.gp.empty() && it != st.metadata.end()) c.gp = it->second;
  if (!c.img_size) {
    c.img_size = meta_int("img_size");  // a checkpoint's own training size and eval crop
    if (auto it = st.metadata.find("crop_pct"); c.img_size && !c.crop_pct && it != st.metadata.end())
      c.crop_pct = std::stod(it->second);
  }
  if (!c.img_size && !cfg.use_train_size && defaults.test_input_size) {  // timm: the test size by default
    c.img_size = defaults.test_input_size;
    if (!c.crop_pct && defaults.test_crop_pct > 0) c.crop_pct = defaults.test_crop_pct;
  }
  const DataConfig dc = resolve_data_config(c, defaults);
  auto ds = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.split);
  const int64_t num_classes = cfg.num_classes.value_or(meta_int("num_classes").value_or(ds->num_classes()));
  check_labels(*ds, num_classes, cfg.split);

  ModelArgs margs;
  margs.num_classes = num_classes;
  margs.in_chans = dc.in_chans;
  margs.img_size = dc.img_size;
  margs.global_pool = c.gp;
  auto model = model_zoo::create_model(arch, margs);
  if (!cfg.checkpoint.empty())
    io::load_state_dict(*model, st, io::weights_prefix(st, cfg.use_ema), cfg.checkpoint);
  else
    load_pretrained_weights(*model, c, defaults);
  model->to(device);
  if (cfg.channels_last) to_channels_last(*model);
  const int64_t params = model_zoo::count_params(*model);
  log::info("Model {} created, param count: {}", arch, params);

  data::TransformConfig tc;
  tc.size = int(dc.img_size);
  tc.channels = int(dc.in_chans);
  tc.crop_pct = dc.crop_pct;
  tc.interpolation = dc.interpolation;
  data::LoaderOptions lo;
  lo.batch_size = cfg.batch_size;
  lo.workers = cfg.workers;
  lo.pin_memory = cfg.pin_mem && device.is_cuda();
  data::Loader loader(ds, tc, lo);
  auto m = evaluate(*model, loader, Normalizer(dc, cfg.channels_last), device, cfg.log_interval, "", resolve_amp(cfg), true);
  log::info(" * Acc@1 {:.3f} ({:.3f}) Acc@5 {:.3f} ({:.3f})", m.top1, 100 - m.top1, m.top5, 100 - m.top5);

  nlohmann::ordered_json r;
  r["model"] = arch;
  r["top1"] = round_to(m.top1, 4);
  r["top1_err"] = round_to(100 - m.top1, 4);
  r["top5"] = round_to(m.top5, 4);
  r["top5_err"] = round_to(100 - m.top5, 4);
  r["param_count"] = round_to(double(params) / 1e6, 2);
  r["img_size"] = dc.img_size;
  r["crop_pct"] = dc.crop_pct;
  r["interpolation"] = dc.interpolation;
  std::printf("--result\n%s\n", r.dump(4).c_str());
  write_results(cfg.results_file, cfg.results_format, r);
  return 0;
}

}  // namespace imgtrain::engine
