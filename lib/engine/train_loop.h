// The one training loop, for every task: per micro-batch the task's loss / A and backward (the
// gradient reducer overlapping the all-reduce, no_sync between updates); per update unscaling,
// clipping, the optimizer step (skipped on a non-finite gradient), the scaler update, EMA, the
// lr step per update, a timm-format log line, recovery checkpoints and the agreed stop check.
// It knows no labels: what a batch means is the Task's.
#pragma once
#include "core/meter.h"
#include "data/loader.h"
#include "dist/dist.h"
#include "engine/amp.h"
#include "engine/ema.h"
#include "engine/task.h"
#include "optim/optim.h"

#include <functional>
#include <optional>

namespace imgtrain::engine {

class EventWriter;

// The epoch's running loss averages by name ("loss" first, then the task's parts), and their text
// form in a recovery checkpoint ("name sum count;..."; parse_loss_meters throws UserError naming
// `what` on malformed text).
using LossMeters = std::vector<std::pair<std::string, AverageMeter>>;
// "H:MM:SS" (hours unbounded), as the ETA is written.
std::string format_duration(double seconds);
std::string format_loss_meters(const LossMeters& m);
LossMeters parse_loss_meters(const std::string& text, const std::string& what);

struct LoopOptions {
  int64_t epoch = 0;
  int64_t accum_steps = 1;  // micro-batches per optimizer update (timm --grad-accum-steps)
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
  int64_t start_update = 0;         // resume inside the epoch (a recovery checkpoint)
  LossMeters start_meters;          // ... with the epoch's loss averages up to there
  int64_t max_updates = 0;          // > 0: the run ends after this many updates (--max-iter), mid-epoch too
  // The ETA on log lines: updates of the epochs after this one, and the time the evaluations still
  // to come will take (after each epoch, measured on the last one; 0 before the first).
  int64_t updates_after_epoch = 0;
  double eval_seconds_left = 0;
  int64_t recovery_interval = 0;    // --recovery-interval: save_recovery after every N updates
  // The meters: "loss" and the task's parts, averaged over the ranks (every rank calls it).
  std::function<void(int64_t update_idx, const LossMeters& meters)> save_recovery;
  // Data parallel: collectives (loss averages for the log) and the gradient reducer; null alone.
  dist::Context* dist = nullptr;
  dist::GradSync* grad_sync = nullptr;
  // Between updates: a SIGINT / SIGTERM (agreed over the ranks) ends the epoch after a recovery
  // checkpoint (save_recovery, when set).
  bool honour_stop = true;
  EventWriter* events = nullptr;  // --log-tensorboard: the log lines' numbers as scalars (rank 0)
};

struct EpochResult {
  double loss = 0;            // average of the unscaled loss
  // The task's named loss parts (detection: loss_classifier, loss_box_reg, ...), epoch averages.
  std::vector<std::pair<std::string, double>> parts;
  int64_t skipped_steps = 0;  // optimizer updates skipped for non-finite gradients
  int stopped_by = 0;         // the signal that stopped the epoch early, or 0
  int64_t stopped_after = -1;  // the last update done before stopping
};

// timm's dispatch_clip_grad: norm (total 2-norm), value, or agc (unit-wise adaptive clipping
// against the parameters' norms, eps 1e-3; the caller leaves out the head as timm does).
// Returns the total norm before clipping for "norm", NaN for the others.
double clip_gradients(std::vector<at::Tensor> params, double value, const std::string& mode);

// One epoch of timm's train_one_epoch. `num_updates` counts optimizer updates across epochs
// (skipped ones included, as timm counts).
EpochResult train_one_epoch(Task& task, torch::nn::Module& model, data::Loader& loader, optim::Optimizer& optimizer,
                            ModelEma* ema, int64_t& num_updates, const LoopOptions& o);

// timm's PrefetchLoader: on CUDA, batch k + 1 is copied from pinned memory and normalised on a
// side stream while batch k trains, and the compute stream waits for it only when it is used. On
// the CPU a batch is converted when it is used.
class Prefetcher {
 public:
  struct Item {
    data::Batch batch;
    at::Tensor x;                 // the model's float input on the device (normalised)
    std::shared_ptr<void> ready;  // CUDA: the side stream's event after the copy
  };
  Prefetcher(data::Loader& loader, torch::Device device, std::vector<double> mean, std::vector<double> std,
             bool channels_last);
  ~Prefetcher();
  std::optional<Item> next();

 private:
  std::optional<Item> load();
  data::Loader& loader_;
  torch::Device device_;
  std::vector<double> mean_, std_;
  bool channels_last_;
  std::optional<Item> pending_;
  bool primed_ = false;
  std::shared_ptr<void> stream_;  // CUDA: the side stream
};

}  // namespace imgtrain::engine
