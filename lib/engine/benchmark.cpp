#include "core/batch_norm.h"
#include "core/error.h"
#include "core/log.h"
#include "data/loader.h"
#include "dist/dist.h"
#include "cli/adapters.h"
#include "engine/amp.h"
#include "engine/commands.h"
#include "engine/setup.h"
#include "io/weights.h"
#include "model_zoo/detection/rcnn.h"
#include "model_zoo/registry.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#ifdef IMGTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <string_view>
#include <unordered_set>

namespace imgtrain::engine {
namespace {

using Clock = std::chrono::steady_clock;

double now_s(torch::Device dev) {
  if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

// --profile: every op call's host time, from RecordFunction callbacks on all threads; an op's self
// time is its time less that of the ops it called (on its thread). The phases of a step are user
// scopes named "imgtrain::<phase>".
namespace profile {
struct Frame : at::ObserverContext {
  Clock::time_point t0;
  double children = 0;
  Frame* parent = nullptr;
  const char* name = "";
};
thread_local Frame* current = nullptr;
struct Stat {
  int64_t calls = 0;
  double self = 0, total = 0;
  std::unordered_map<std::string, double> by_caller;  // self time by the op (or scope) that called it
};
std::mutex mu;
std::unordered_map<std::string, Stat> stats;

bool is_wrapper(std::string_view name) {
  static const std::unordered_set<std::string_view> wrappers{
      "aten::clone",       "aten::contiguous", "aten::to",          "aten::_to_copy", "aten::zero_",
      "aten::zeros",       "aten::zeros_like", "aten::empty_like",  "aten::convolution", "aten::_convolution",
      "aten::batch_norm",  "aten::_batch_norm_impl_index",           "aten::reshape",  "aten::copy_",
      "aten::fill_",       "aten::new_zeros",  "aten::full",        "aten::ones_like", "aten::max_pool2d"};
  return wrappers.count(name) > 0;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto f = std::make_unique<Frame>();
  f->parent = current;
  f->name = fn.name();
  current = f.get();
  f->t0 = Clock::now();
  return f;
}
void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  const auto t1 = Clock::now();
  auto* f = static_cast<Frame*>(ctx);
  if (!f) return;
  const double dur = std::chrono::duration<double>(t1 - f->t0).count();
  // the caller, past thin wrappers (clone, contiguous, zero_, ...) that only forward to the op
  const Frame* up = f->parent;
  while (up && is_wrapper(up->name)) up = up->parent;
  const char* caller = up ? up->name : "";
  if (current == f) {  // nested on this thread: the parent is still open
    current = f->parent;
    if (f->parent) f->parent->children += dur;
  }
  std::lock_guard<std::mutex> lock(mu);
  auto& st = stats[fn.name()];
  ++st.calls;
  st.self += dur - f->children;
  st.total += dur;
  st.by_caller[caller] += dur - f->children;
}

// Records while alive.
class Session {
 public:
  Session() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stats.clear();
    }
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end)
                                        .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION,
                                                 at::RecordScope::USER_SCOPE}));
  }
  ~Session() { at::removeCallback(handle_); }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

 private:
  at::CallbackHandle handle_;
};

// The phases (ms per step, also into `results` as <prefix><phase>_ms) and the top ops by self time.
void report(int64_t steps, const std::string& prefix, nlohmann::ordered_json& results) {
  std::lock_guard<std::mutex> lock(mu);
  const std::string scope = "imgtrain::";
  std::vector<std::pair<std::string, Stat>> ops, phases;
  double all_self = 0;
  // the phases are the step's three user scopes; imgtrain's own kernels (imgtrain::attention_infer,
  // the optimizer steps) are ops like ATen's
  auto is_phase = [&](const std::string& name) {
    return name == scope + "forward" || name == scope + "backward" || name == scope + "optimizer";
  };
  for (auto& [name, st] : stats) {
    all_self += st.self;
    (is_phase(name) ? phases : ops).emplace_back(name, st);
  }
  const double per = 1000.0 / double(steps);
  std::string line = fmt::format("Profile of {} {} steps (host time per step, with the profiler's own cost):", steps,
                                 prefix.substr(0, prefix.size() - 1));
  for (const char* phase : {"forward", "backward", "optimizer"})
    for (auto& [name, st] : phases)
      if (name == scope + phase) {
        line += fmt::format("  {} {:.1f} ms", phase, st.total * per);
        results[prefix + phase + "_ms"] = std::round(st.total * per * 1000.0) / 1000.0;
      }
  std::printf("%s\n%10s %6s %11s  %s\n", line.c_str(), "self ms", "%", "calls/step", "op");
  std::sort(ops.begin(), ops.end(), [](auto& a, auto& b) { return a.second.self > b.second.self; });
  for (size_t i = 0; i < std::min<size_t>(ops.size(), 20); ++i) {
    auto& [name, st] = ops[i];
    // where a small op's time comes from: its two largest callers, when it is called from elsewhere
    std::vector<std::pair<std::string, double>> callers(st.by_caller.begin(), st.by_caller.end());
    std::sort(callers.begin(), callers.end(), [](auto& a, auto& b) { return a.second > b.second; });
    std::string from;
    for (size_t k = 0; k < std::min<size_t>(callers.size(), 2); ++k)
      if (!callers[k].first.empty() && callers[k].second > 0.05 * st.self)
        from += fmt::format("{}{} {:.0f}%", from.empty() ? "  <- " : ", ", callers[k].first,
                            100.0 * callers[k].second / std::max(st.self, 1e-12));
    std::printf("%10.2f %5.1f%% %11.1f  %s%s\n", st.self * per, 100.0 * st.self / std::max(all_self, 1e-12),
                double(st.calls) / double(steps), name.c_str(), from.c_str());
  }
  std::fflush(stdout);
}
}  // namespace profile

// --cuda-graph (what timm users get from torch.compile's "reduce-overhead"): the step (forward, or
// forward + loss + backward + optimizer step) run eagerly three times on a side stream (cuDNN's
// autotuning, the optimizer's state), then captured once into a CUDA graph with the gradients
// unset, so that backward allocates them from the graph's pool; each timed step is one replay.
// The shapes are static by construction here (one synthetic batch).
#ifdef IMGTRAIN_WITH_CUDA
using Graph = at::cuda::CUDAGraph;
std::unique_ptr<Graph> capture_step(const std::function<void()>& body, optim::Optimizer* opt, torch::Device device) {
  torch::cuda::synchronize(device.index());
  auto side = c10::cuda::getStreamFromPool(false, device.index());
  auto graph = std::make_unique<Graph>();
  {
    c10::cuda::CUDAStreamGuard guard(side);
    for (int i = 0; i < 3; ++i) {
      if (opt) opt->zero_grad(true);
      body();
    }
    if (opt) opt->zero_grad(true);
    // As torch.cuda.graph's advice: no autocast weight-cast cache while capturing
    const bool cache = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_cache_enabled(false);
    graph->capture_begin();
    body();
    graph->capture_end();
    at::autocast::set_autocast_cache_enabled(cache);
  }
  torch::cuda::synchronize(device.index());
  log::info("--cuda-graph: the step is captured; each timed step replays it");
  return graph;
}
void replay(Graph& g) { g.replay(); }
#else
struct Graph {};
std::unique_ptr<Graph> capture_step(const std::function<void()>&, optim::Optimizer*, torch::Device) {
  throw UserError("--cuda-graph: this imgtrain was built without CUDA");
}
void replay(Graph&) {}
#endif

// benchmark.py's optimizer: create_optimizer_v2(model, opt, lr=1e-4), no weight decay, over the
// parameters that train.
std::unique_ptr<optim::Optimizer> bench_optimizer(torch::nn::Module& model, const cli::Config& cfg) {
  optim::OptimizerArgs oa;
  oa.opt = cfg.opt;
  oa.impl = cfg.opt_impl;
  oa.lr = 1e-4;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : model.named_parameters())
    if (p.value().requires_grad()) named.emplace_back(p.key(), p.value());
  return optim::create_optimizer(oa, named);
}

// benchmark.py's timing: --num-warm-iter steps, then --num-bench-iter timed ones (logged five
// times), and its fields under infer_ / train_ (samples/s rounded to `digits`).
// IMGTRAIN_BENCH_SLOWDOWN=F, a test hook of the CI benchmark job (bench/ci_bench.py): every timed
// step is followed by a sleep of F x its time, counted in it, so a regression of F can be staged.
double bench_slowdown() {
  const char* v = std::getenv("IMGTRAIN_BENCH_SLOWDOWN");
  if (!v || !*v) return 0;
  char* end = nullptr;
  const double f = std::strtod(v, &end);
  if (*end || !std::isfinite(f) || f < 0 || f > 100)
    throw UserError(fmt::format("IMGTRAIN_BENCH_SLOWDOWN '{}': expected a number in [0, 100]", v));
  return f;
}

void time_steps(const std::function<double()>& step_once, const cli::Config& cfg, torch::Device device, bool train,
                int64_t b, int64_t img, int digits, nlohmann::ordered_json& results) {
  const double slowdown = bench_slowdown();
  if (slowdown > 0) log::warn("IMGTRAIN_BENCH_SLOWDOWN={}: every step is made {}x slower (a test hook)", slowdown,
                              1 + slowdown);
  auto step = [&]() -> double {
    const double t = step_once();
    if (slowdown <= 0) return t;
    std::this_thread::sleep_for(std::chrono::duration<double>(slowdown * t));
    return t * (1 + slowdown);
  };
  for (int64_t i = 0; i < cfg.num_warm_iter; ++i) step();
  double total = 0;
  int64_t samples = 0;
  const int64_t log_freq = std::max<int64_t>(1, cfg.num_bench_iter / 5);
  std::optional<profile::Session> prof;
  if (cfg.profile) prof.emplace();
#ifdef IMGTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
  const double start = now_s(device);
  for (int64_t i = 0; i < cfg.num_bench_iter; ++i) {
    total += step();
    samples += b;
    if ((i + 1) % log_freq == 0)
      log::info("{} [{}/{}]. {:.3f} samples/sec. {:.3f} ms/step.", train ? "Train" : "Infer", i + 1,
                cfg.num_bench_iter, double(samples) / total, 1000.0 * total / double(i + 1));
  }
  const double elapsed = now_s(device) - start;
  const std::string prefix = train ? "train_" : "infer_";
  if (prof) {
    prof.reset();
    profile::report(cfg.num_bench_iter, prefix, results);
  }
#ifdef IMGTRAIN_WITH_CUDA
  if (device.is_cuda()) {  // the caching allocator's peaks over the timed steps, as torch.cuda.max_memory_*
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    const auto agg = size_t(c10::CachingAllocator::StatType::AGGREGATE);
    results[prefix + "max_allocated_mb"] = round_to(double(st.allocated_bytes[agg].peak) / (1 << 20), 1);
    results[prefix + "max_reserved_mb"] = round_to(double(st.reserved_bytes[agg].peak) / (1 << 20), 1);
  }
#endif
  results[prefix + "samples_per_sec"] = round_to(double(samples) / elapsed, digits);
  results[prefix + "step_time"] = round_to(1000.0 * total / double(cfg.num_bench_iter), 3);
  results[prefix + "batch_size"] = b;
  results[prefix + "img_size"] = img;
}

// --bench data: the input pipeline alone (decode, RandomResizedCrop + flip, collation into uint8
// batches) with -j threads over the --data-dir training split, no model. --bench data-eval: the
// eval pipeline (exact decode unless --fast-decode, PIL's resize to floor(size / crop_pct), center
// crop) over the same split.
int benchmark_data(const cli::Config& cfg) {
  auto ds = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, data::FolderOptions{cfg.input_key, ""});
  auto tc = cli::train_geometry(cfg, int(cfg.img_size.value_or(224)), int(cfg.in_chans.value_or(3)));
  if (cfg.bench == "data-eval") {
    tc.train = false;
    tc.crop_pct = cfg.crop_pct.value_or(0.875);
    tc.interpolation = cfg.interpolation.empty() ? "bilinear" : cfg.interpolation;
    tc.crop_mode = cfg.crop_mode.empty() ? "center" : cfg.crop_mode;
    tc.fast_decode = cfg.fast_decode;
  }
  const auto lo = cli::loader_options(cfg);
  data::Loader loader(ds, tc, lo);
  if (loader.num_batches() == 0)
    throw UserError(fmt::format("--batch-size {}: the split has only {} images", cfg.batch_size, ds->size()));
  log::info("Running {} benchmark on {} images: {} threads, batch size {}, output {}x{}, interpolation {}.",
            cfg.bench, ds->size(), cfg.workers, cfg.batch_size, tc.size, tc.size, tc.interpolation);
  int64_t epoch = 0, skipped = 0;
  loader.start_epoch(epoch);
  auto next = [&]() {
    auto b = loader.next();
    if (!b) {
      skipped += loader.skipped_this_epoch();
      loader.start_epoch(++epoch);
      b = loader.next();
    }
    return b->images.size(0);
  };
  // The loader makes up to workers x prefetch batches ahead of the consumer: those finished during
  // the warm-up would come out at once and inflate the rate, so they are taken untimed too.
  const int64_t threads = std::max<int64_t>(1, lo.workers);
  for (int64_t i = 0; i < cfg.num_warm_iter + threads * std::max<int64_t>(1, lo.prefetch_per_worker); ++i) next();
  if (cfg.num_bench_iter < 10 * threads)
    log::warn("--num-bench-iter {}: {} threads finish their batches together, so a rate over so few batches can be "
              "off by up to {:.0f}% (give at least {})",
              cfg.num_bench_iter, threads, 100.0 * double(threads) / double(cfg.num_bench_iter), 10 * threads);
  const auto t0 = Clock::now();
  int64_t images = 0;
  const int64_t log_freq = std::max<int64_t>(1, cfg.num_bench_iter / 5);
  for (int64_t i = 0; i < cfg.num_bench_iter; ++i) {
    images += next();
    if ((i + 1) % log_freq == 0)
      log::info("Data [{}/{}]. {:.2f} images/sec.", i + 1, cfg.num_bench_iter,
                double(images) / std::chrono::duration<double>(Clock::now() - t0).count());
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  skipped += loader.skipped_this_epoch();
  nlohmann::ordered_json results;
  results["data_samples_per_sec"] = round_to(double(images) / elapsed, 2);
  results["data_samples_per_sec_per_thread"] = round_to(double(images) / elapsed / double(std::max<int64_t>(1, cfg.workers)), 2);
  results["data_batch_size"] = cfg.batch_size;
  results["data_img_size"] = tc.size;
  results["workers"] = cfg.workers;
  results["images"] = int64_t(ds->size());
  results["skipped_reads"] = skipped;  // failed reads in the batches taken (a bad file once per pass over it)
  results["passes"] = epoch + 1;        // passes over the split started (warm-up included)
  std::printf("--result\n%s\n", results.dump(4).c_str());
  write_results(cfg.results_file, cfg.results_format, results);
  return 0;
}

// Each step's layout: training takes train's per-family default on the CPU (channels-last with the
// fused kernels) unless the flags say; inference NCHW unless --channels-last (measured neutral
// there for the classifiers, docs/performance.md). Logs the choice after "Benchmarking <what>".
std::function<bool(bool)> bench_layouts(const cli::Config& cfg, torch::Device device, const Amp& amp,
                                        const std::string& what) {
  const bool nhwc_fused = nhwc_fused_training_default(cfg.model, device, amp);
  auto nhwc = [nhwc_fused, &cfg](bool train) { return train ? cfg.channels_last_on(nhwc_fused) : cfg.channels_last; };
  log::info("Benchmarking {}in {} precision. {} layout.", what, precision_name(amp),
            nhwc(cfg.bench == "train") ? "NHWC" : "NCHW");
  if (cfg.bench == "both" && nhwc(true) != nhwc(false))
    log::info("The training step in {} layout (this family's CPU default; --channels-last [=false] chooses).",
              nhwc(true) ? "NHWC" : "NCHW");
  return nhwc;
}

// inference: BatchNorm folded into the convolutions unless --fuse-bn=false; training: the fused
// kernels (and frozen BatchNorms folded) with --fuse-bn, and by default where `train` says so
// (train's own per-family default). Recorded as <prefix>_fuse_bn.
void set_fusion(torch::nn::Module& model, const cli::Config& cfg, const Amp& amp, bool train,
                nlohmann::ordered_json& results, bool train_default = false) {
  const bool fuse = cfg.fuse_bn_on(train ? train_default : !amp.enabled);
  set_inference_fusion(model, fuse && !train);
  set_training_fusion(model, fuse && train);
  results[train ? "train_fuse_bn" : "infer_fuse_bn"] = fuse;
}

// A detector: what GeneralizedRCNN runs after its transform (backbone, RPN, RoI heads), on a
// batch of synthetic normalised --img-size images (512 unless given; torchvision's references have
// no benchmark, bench/torchvision_detection.py times the same calls) with 4 random boxes (and
// masks) per image; train: the loss dict summed, backward and an SGD step (lr 1e-4).
int benchmark_detection(const cli::Config& cfg, torch::Device device) {
  namespace det = model_zoo::detection;
  if (cfg.nproc_per_node > 0 || std::getenv("WORLD_SIZE"))
    throw UserError(fmt::format("--model {}: the detection benchmark runs in one process", cfg.model));
  const Amp amp = resolve_amp(cfg.amp, cfg.amp_dtype, cfg.amp_opt_level);
  warn_cpu_float16(amp, device);
  const int64_t img = cfg.img_size.value_or(512), b = cfg.batch_size;
  const int64_t padded = (img + 31) / 32 * 32;
  det::RCNNOptions o;
  o.num_classes = cfg.num_classes.value_or(91);
  const auto d = det::rcnn_defaults(cfg.model);
  o.rpn_pre_nms_top_n_test = d.rpn_pre_nms_top_n_test;
  o.rpn_post_nms_top_n_test = d.rpn_post_nms_top_n_test;
  o.rpn_score_thresh = d.rpn_score_thresh;
  o.fpn_channels = cfg.fpn_channels;  // the architecture's widths
  o.box_head_dim = cfg.box_head_dim;
  o.mask_head_dim = cfg.mask_head_dim;
  o.mask_head_convs = cfg.mask_head_convs;
  o.roi_canonical_size = cfg.roi_canonical_size;  // flags that say they apply to the benchmark too
  o.mask_rois_per_image = cfg.mask_rois_per_image;
  // --trainable-backbone-layers N: the fine-tuning configuration, a body started from weights
  // (FrozenBatchNorm2d, the layers before the last N frozen), as torchvision builds it with
  // weights_backbone; without it the builder's weights=None one (BatchNorm2d, every layer trained).
  if (cfg.trainable_backbone_layers) {
    o.from_weights = true;
    o.trainable_backbone_layers = *cfg.trainable_backbone_layers;
  }
  torch::manual_seed(uint64_t(cfg.seed));
  det::ImageBatch batch;
  batch.tensors = torch::zeros({b, 3, padded, padded});
  batch.tensors.narrow(2, 0, img).narrow(3, 0, img).normal_();
  std::vector<det::Target> targets;
  const bool masks = det::rcnn_has_mask(cfg.model);
  for (int64_t i = 0; i < b; ++i) {
    batch.sizes.push_back({img, img});
    const int64_t n = 4;
    auto xy = torch::rand({n, 2}) * (0.6 * double(img)), wh = torch::rand({n, 2}) * (0.4 * double(img)) + 8;
    det::Target t{torch::cat({xy, xy + wh}, 1), torch::randint(1, o.num_classes, {n}, torch::kLong), {}};
    if (masks) {
      t.masks = torch::zeros({n, img, img}, torch::kByte);
      for (int64_t k = 0; k < n; ++k) {
        auto bx = t.boxes[k].to(torch::kLong);
        const int64_t x0 = bx[0].item<int64_t>(), y0 = bx[1].item<int64_t>();
        const int64_t x1 = std::min(img, bx[2].item<int64_t>()), y1 = std::min(img, bx[3].item<int64_t>());
        t.masks[k].narrow(0, y0, y1 - y0).narrow(1, x0, x1 - x0).fill_(1);
      }
    }
    targets.push_back({t.boxes.to(device), t.labels.to(device), masks ? t.masks.to(device) : at::Tensor()});
  }
  batch.tensors = batch.tensors.to(device);
  const auto nhwc = bench_layouts(cfg, device, amp, cfg.model + " ");
  nlohmann::ordered_json results;
  results["model"] = cfg.model;
  int64_t params = 0;
  int64_t detections = 0, infer_images_seen = 0;  // the workload of the RoI heads' second half
  auto run = [&](bool train) {
    torch::manual_seed(uint64_t(cfg.seed));
    auto model = det::create_rcnn(cfg.model, o);
    if (!cfg.pretrained_path.empty()) {  // the same weights as another run (e.g. torchvision's, saved)
      const auto file = io::load_weights_file(cfg.pretrained_path);
      log::info("{}", det::load_rcnn_weights(*model, file, io::weights_prefix(file, /*prefer_ema=*/true),
                                             fmt::format("--pretrained-path '{}'", cfg.pretrained_path),
                                             cfg.pretrained_path));
    }
    params = model_zoo::count_params(*model);
    model->to(device);
    det::ImageBatch in = batch;
    if (nhwc(train)) {
      to_channels_last(*model);
      in.tensors = in.tensors.contiguous(at::MemoryFormat::ChannelsLast);
    }
    model->train(train);
    set_fusion(*model, cfg, amp, train, results, fused_training_default(cfg.model, device, amp));
    results[train ? "train_channels_last" : "infer_channels_last"] = nhwc(train);
    auto opt = train ? bench_optimizer(*model, cfg) : nullptr;
    log::info("Running {} benchmark on {} for {} steps w/ input size (3, {}, {}) and batch size {}.",
              train ? "train" : "inference", cfg.model, cfg.num_bench_iter, img, img, b);
    auto step = [&]() -> double {
      if (train) opt->zero_grad(true);
      const double t0 = now_s(device);
      if (train) {
        at::Tensor loss;
        {
          RECORD_USER_SCOPE("imgtrain::forward");
          AutocastScope ac(amp.enabled, device.type(), amp.dtype);
          auto res = model->forward(in, &targets);
          for (auto& [k, v] : res.losses) loss = loss.defined() ? loss + v : v;
        }
        {
          RECORD_USER_SCOPE("imgtrain::backward");
          loss.backward();
        }
        RECORD_USER_SCOPE("imgtrain::optimizer");
        opt->step();
      } else {
        torch::NoGradGuard ng;
        RECORD_USER_SCOPE("imgtrain::forward");
        AutocastScope ac(amp.enabled, device.type(), amp.dtype);
        auto res = model->forward(in);
        for (auto& d : res.detections) detections += d.boxes.size(0);
        ++infer_images_seen;
      }
      return now_s(device) - t0;
    };
    time_steps(step, cfg, device, train, b, img, 3, results);  // a detector is slow: one more digit
  };
  if (cfg.bench != "train") {
    run(false);
    // detections per image after the score threshold: the mask head runs on each
    if (infer_images_seen) results["infer_detections_per_image"] = round_to(double(detections) / double(infer_images_seen * b), 1);
  }
  if (cfg.bench != "inference") run(true);
  results["param_count"] = round_to(double(params) / 1e6, 2);
  std::printf("--result\n%s\n", results.dump(4).c_str());
  write_results(cfg.results_file, cfg.results_format, results);
  return 0;
}

}  // namespace

int benchmark(const cli::Config& cfg) {
  bench_slowdown();  // a malformed test hook is refused before anything runs
  require_writable(cfg.results_file, "--results-file");
  if (cfg.bench == "data" || cfg.bench == "data-eval") return benchmark_data(cfg);
  if (model_zoo::model_task(cfg.model) == "detection") {
    if (cfg.cuda_graph)
      throw UserError("--cuda-graph: a detector's shapes change with every image (proposals, detections), so its "
                      "step cannot be captured; leave --cuda-graph out");
    return benchmark_detection(cfg, resolve_device(cfg.device, cfg.tf32));
  }
  if (!cfg.pretrained_path.empty())  // a classifier's step time does not depend on its weights
    throw UserError(fmt::format("--pretrained-path: the benchmark of a classifier times random weights, as timm's "
                                "benchmark.py; it applies to detectors (--model {} is a classifier)",
                                cfg.model));
  auto device = resolve_device(cfg.device, cfg.tf32);
  if (cfg.cuda_graph && !device.is_cuda())
    throw UserError(fmt::format("--cuda-graph needs a CUDA device (the device is {}); leave it out on the CPU",
                                device.str()));
  // Under a launcher the train benchmark is data parallel: each process steps its own batch and
  // the gradients are all-reduced as in training (the reported step time is rank 0's).
  auto ctx = join_process_group(cfg.dist_backend, cfg.dist_timeout, cfg.rdzv_timeout, device);
  if (cfg.cuda_graph && ctx)
    throw UserError("--cuda-graph: not with a data-parallel benchmark yet (the gradient all-reduce is not "
                    "captured); benchmark one process, or leave --cuda-graph out");
  const Amp amp = resolve_amp(cfg.amp, cfg.amp_dtype, cfg.amp_opt_level);
  warn_cpu_float16(amp, device);
  const auto& d = model_zoo::model_defaults(cfg.model);
  // timm: the test input size unless --img-size or --use-train-size.
  const int64_t img = cfg.img_size.value_or(!cfg.use_train_size && d.test_input_size ? d.test_input_size
                                                                                      : d.input_size[2]);
  ModelArgs margs;
  margs.num_classes = cfg.num_classes.value_or(d.num_classes);
  margs.in_chans = cfg.in_chans.value_or(3);
  margs.img_size = img;
  margs.global_pool = cfg.gp;
  const int64_t b = cfg.batch_size;
  const auto nhwc = bench_layouts(cfg, device, amp, "");

  nlohmann::ordered_json results;
  results["model"] = cfg.model;
  int64_t params = 0;
  int64_t detections = 0, infer_images_seen = 0;  // the workload of the RoI heads' second half
  auto run = [&](bool train) {
    torch::manual_seed(uint64_t(cfg.seed));
    auto model = model_zoo::create_model(cfg.model, margs);
    params = model_zoo::count_params(*model);
    model->to(device);
    if (nhwc(train)) to_channels_last(*model);
    std::unique_ptr<dist::GradSync> sync;
    if (ctx && train) {
      ctx->broadcast_model(*model);
      sync = ctx->grad_sync(*model, cfg.bucket_cap_mb, true);
    }
    auto x = torch::randn({b, margs.in_chans, img, img}, torch::TensorOptions().device(device));
    if (nhwc(train)) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    model->train(train);
    set_fusion(*model, cfg, amp, train, results, fused_training_default(cfg.model, device, amp));
    results[train ? "train_channels_last" : "infer_channels_last"] = nhwc(train);
    auto opt = train ? bench_optimizer(*model, cfg) : nullptr;
    const char* what = train ? "train" : "inference";
    log::info("Running {} benchmark on {} for {} steps w/ input size ({}, {}, {}) and batch size {}.", what,
              cfg.model, cfg.num_bench_iter, margs.in_chans, img, img, b);
    auto body = [&]() {
      if (train) {
        at::Tensor loss;
        {
          RECORD_USER_SCOPE("imgtrain::forward");
          AutocastScope ac(amp.enabled, device.type(), amp.dtype);
          if (sync) sync->before_forward(true);
          auto out = model->forward(x);
          if (sync) sync->after_forward(true);
          auto target = torch::empty({out.size(0)}, torch::TensorOptions().dtype(torch::kLong).device(device))
                            .random_(margs.num_classes);
          loss = torch::nn::functional::cross_entropy(out, target);
        }
        {
          RECORD_USER_SCOPE("imgtrain::backward");
          loss.backward();
        }
        RECORD_USER_SCOPE("imgtrain::optimizer");
        opt->step();
      } else {
        torch::NoGradGuard ng;
        RECORD_USER_SCOPE("imgtrain::forward");
        AutocastScope ac(amp.enabled, device.type(), amp.dtype);
        model->forward(x);
      }
    };
    auto graph = cfg.cuda_graph ? capture_step(body, train ? opt.get() : nullptr, device) : nullptr;
    auto step = [&]() -> double {
      if (train && !graph) opt->zero_grad(/*set_to_none=*/!sync);  // DDP: keep the bucket views
      const double t0 = now_s(device);
      if (graph) replay(*graph);
      else body();
      return now_s(device) - t0;
    };
    time_steps(step, cfg, device, train, b, img, 2, results);
    if (sync) {
      // The same bytes as the gradients in one plain all-reduce, for comparison with the step's
      // exposed communication time (median of 5).
      int64_t n = 0;
      for (auto& p : model->parameters()) n += p.numel();
      auto flat = torch::zeros({n}, model->parameters().front().options());
      std::vector<double> times;
      for (int i = 0; i < 6; ++i) {
        ctx->barrier();
        const double t0 = now_s(device);
        ctx->all_reduce_sum_(flat);
        if (i) times.push_back(now_s(device) - t0);
      }
      std::sort(times.begin(), times.end());
      results["world_size"] = ctx->world();
      results["grad_buckets"] = sync->num_buckets();
      results["allreduce_bytes"] = n * int64_t(flat.element_size());
      results["allreduce_ms"] = round_to(1000.0 * times[times.size() / 2], 3);
    }
  };
  if (cfg.bench != "train") {
    run(false);
    // detections per image after the score threshold: the mask head runs on each
    if (infer_images_seen) results["infer_detections_per_image"] = round_to(double(detections) / double(infer_images_seen * b), 1);
  }
  if (cfg.bench != "inference") run(true);
  results["param_count"] = round_to(double(params) / 1e6, 2);
  if (ctx && ctx->rank() != 0) return 0;
  std::printf("--result\n%s\n", results.dump(4).c_str());
  write_results(cfg.results_file, cfg.results_format, results);
  return 0;
}

}  // namespace imgtrain::engine
