// `imgtrain train` and `imgtrain validate`: the classification task end to end, from a validated
// Config to a trained model, timm's logs, summary.csv, args.yaml and checkpoints.
#pragma once
#include "cli/config.h"
#include "data/loader.h"
#include "data/mixup.h"
#include "dist/dist.h"
#include "engine/amp.h"
#include "engine/ema.h"
#include "engine/loss.h"
#include "optim/optim.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <optional>

namespace imgtrain::engine {

struct EpochOptions {
  int64_t epoch = 0;
  int64_t accum_steps = 1;  // micro-batches per optimizer update (timm --grad-accum-steps)
  LossConfig loss;
  data::MixupConfig mixup;    // active() when mixup or cutmix is asked for
  bool mixup_enabled = true;  // false from --mixup-off-epoch on
  uint64_t seed = 42;         // mixup draws come from (seed, epoch, batch index)
  std::optional<double> clip_grad;
  std::string clip_mode = "norm";
  int64_t log_interval = 50;
  std::vector<double> mean, std;  // normalisation, in [0, 1] units
  torch::Device device = torch::kCPU;
  bool amp = false;  // autocast forward and loss to amp_dtype
  at::ScalarType amp_dtype = at::kHalf;
  LossScaler* scaler = nullptr;  // float16: scale the loss, skip non-finite steps
  bool channels_last = false;
  const optim::Scheduler* scheduler = nullptr;
  MasterWeights* master = nullptr;  // O2: the optimizer steps these float32 copies
  std::optional<data::RandomErasingConfig> erase;  // --reprob > 0: after normalisation, per sample
  int64_t start_update = 0;         // resume inside the epoch (a recovery checkpoint)
  int64_t recovery_interval = 0;    // --recovery-interval: save_recovery after every N updates
  std::function<void(int64_t update_idx)> save_recovery;  // stepped per update when it schedules on updates
  // Data parallel: collectives (loss averages for the log) and the gradient reducer; null alone.
  dist::Context* dist = nullptr;
  dist::GradSync* grad_sync = nullptr;
  // Between updates: a SIGINT / SIGTERM (agreed over the ranks) ends the epoch after a recovery
  // checkpoint (save_recovery, when set).
  bool honour_stop = true;
};

struct EpochResult {
  double loss = 0;            // average of the unscaled loss
  int64_t skipped_steps = 0;  // optimizer updates skipped for non-finite gradients
  int stopped_by = 0;         // the signal that stopped the epoch early, or 0
  int64_t stopped_after = -1;  // the last update done before stopping
};

// timm's dispatch_clip_grad: norm (total 2-norm), value, or agc (unit-wise adaptive clipping
// against the parameters' norms, eps 1e-3; the caller leaves out the classifier as timm does).
void clip_gradients(std::vector<at::Tensor> params, double value, const std::string& mode);

// One epoch of timm's train_one_epoch for classification: per micro-batch the loss / A and
// backward; per update clipping, the optimizer step, zero_grad, the EMA update and a log line.
// `num_updates` counts optimizer updates across epochs (skipped ones included, as timm counts).
EpochResult train_one_epoch(ClassifierImpl& model, data::Loader& loader, optim::Optimizer& optimizer, ModelEma* ema,
                       int64_t& num_updates, const EpochOptions& o);

// Each returns the process exit code; user errors are thrown as UserError.
int train(const cli::Config& cfg);
int validate(const cli::Config& cfg);
// timm benchmark.py: synthetic inputs, inference and/or train steps, timm's result fields.
int benchmark(const cli::Config& cfg);

// Joins the job's process group when a launcher started this process (torchrun's / SLURM's
// variables), moving `device` to cuda:LOCAL_RANK; null for a single process. Sets the log rank.
std::shared_ptr<dist::Context> join_process_group(const cli::Config& cfg, torch::Device& device);
// The training input's random geometry (RandomResizedCrop --scale/--ratio, --hflip,
// --train-interpolation) and loader settings (shuffled, drop_last, -j, --seed), shared by
// training and `benchmark --bench data`.
data::TransformConfig train_geometry(const cli::Config& cfg, int size, int channels);
data::LoaderOptions train_loader_options(const cli::Config& cfg);

// --device auto|cpu|cuda|cuda:N, checked against what this machine has.
torch::Device resolve_device(const std::string& device);
struct Amp {
  bool enabled = false;  // autocast (O1)
  bool o2 = false;       // apex O2: half weights, float32 masters (MasterWeights)
  at::ScalarType dtype = at::kHalf;
};
// Python's round(v, digits), as timm rounds its result rows.
double round_to(double v, int digits);
// --channels-last: 4-D weights to NHWC memory layout (inputs follow in the training loop).
void to_channels_last(torch::nn::Module& m);
// --amp / --amp-dtype / --amp-opt-level.
Amp resolve_amp(const cli::Config& cfg);
// --results-file: one result row as csv (header + values) or json; nothing when `path` is empty.
void write_results(const std::string& path, const std::string& format, const nlohmann::ordered_json& row);

}  // namespace imgtrain::engine
