// The one owner of imgtrain's checkpoint format. A checkpoint is a safetensors file: the model's
// state dict under "model.", the EMA's under "ema.", optimizer state under "optim.", O2 master
// weights under "master.", the loss scaler under "scaler.", the CPU generator as "rng.cpu" (a CUDA
// run's device generator as "rng.cuda"), and everything else (CheckpointMeta) as strings in the
// header's __metadata__. Train's resume, --resume auto, validate --checkpoint and export all read
// through Checkpoint; train writes through write_checkpoint. CheckpointSaver is timm's policy:
// last every epoch, checkpoint-<epoch> for the best N, model_best.
#pragma once
#include "io/safetensors.h"

#include <torch/nn/module.h>
#include <yaml-cpp/node/node.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace imgtrain::engine {

// What a checkpoint's header says. The model part (arch .. crop_pct) is what rebuilding the
// model needs; the rest is the training position. Fields absent from a file stay unset.
// The plateau scheduler's state as a checkpoint keeps it: "<lr> <best metric> <epochs without
// improvement>". nullopt when the text is not that (a finite lr >= 0, a number, an integer >= 0).
struct PlateauMeta {
  double lr = 0, best = 0;
  int64_t num_bad = 0;
};
std::optional<PlateauMeta> parse_plateau(const std::string& text);

struct CheckpointMeta {
  // the model
  std::string arch;
  std::string task = "classification";
  std::optional<int64_t> num_classes, in_chans, img_size;
  std::optional<std::string> global_pool;
  std::optional<double> crop_pct;
  // a detector's widths (--fpn-channels, --box-head-dim, --mask-head-dim, --mask-head-convs)
  std::optional<int64_t> fpn_channels, box_head_dim, mask_head_dim, mask_head_convs;
  std::optional<double> roi_canonical_size;  // and its RoI level mapper (--roi-canonical-size)
  // and its RoIAlign: --box-sampling-ratio, --roi-align-v2 (1: aligned=True)
  std::optional<int64_t> box_sampling_ratio, roi_align_v2;
  // and how its masks map onto their boxes (--mask-convention)
  std::optional<std::string> mask_convention;
  // the training position
  std::optional<int64_t> epoch, num_updates;
  std::optional<int64_t> recovery_update;  // a mid-epoch checkpoint: the last update done
  std::optional<int64_t> epoch_updates;    // and the updates in an epoch of the run that wrote it
  std::optional<double> metric, best_metric;
  std::optional<int64_t> best_epoch;
  std::string plateau;  // the plateau scheduler's "lr best num_bad"
  // A mid-epoch checkpoint: the epoch's running loss averages so far ("name sum count;..."), so the
  // epoch's train_loss after a resume is the average over all of its updates.
  std::string loss_meters;
  std::string args;     // args.yaml of the run
  int64_t version = 2;

  // A top-level value of `args` (the run's args.yaml): a scalar's text, or nullopt; the node itself
  // (undefined when absent or `args` is not YAML).
  std::optional<std::string> arg(const std::string& key) const;
  YAML::Node arg_node(const std::string& key) const;
  std::map<std::string, std::string> to_metadata() const;
  // Throws UserError naming `what` when a field has a malformed value.
  static CheckpointMeta from_metadata(const std::map<std::string, std::string>& md, const std::string& what);
  // A training checkpoint (one `--resume` can continue from): arch, epoch and num_updates set.
  bool is_training() const { return !arch.empty() && epoch && num_updates; }
};

// The tensors of a training checkpoint, borrowed for writing.
struct TrainStateRefs {
  const torch::nn::Module* model = nullptr;
  const torch::nn::Module* ema = nullptr;
  std::vector<std::pair<std::string, at::Tensor>> optim, master, scaler;
  at::Tensor rng_cpu;
  at::Tensor rng_cuda;  // the run's CUDA device generator (CUDA runs only)
};

// Atomic (temporary file + rename): a crash never leaves a broken file.
void write_checkpoint(const std::string& path, const CheckpointMeta& meta, const TrainStateRefs& state);

// A checkpoint or plain weights file (safetensors, or a torch.save file: io::load_weights_file), read whole.
class Checkpoint {
 public:
  static Checkpoint read(const std::string& path);
  // Only the header (checkpoint discovery); the tensors stay unread.
  static CheckpointMeta read_meta(const std::string& path);
  const std::string& path() const { return path_; }
  const CheckpointMeta& meta() const { return meta_; }
  const io::SafeTensors& tensors() const { return st_; }
  // "ema." when present and preferred, else "model.", else "" (a plain state dict).
  std::string weights_prefix(bool prefer_ema) const;
  bool has_ema() const { return weights_prefix(true) == "ema."; }
  // Loads the weights (strict names and shapes) into `m`; UserError names the file otherwise.
  void load_weights(torch::nn::Module& m, bool prefer_ema) const;
  // The tensors under `prefix` exactly ("model.", "ema.", "" for a plain state dict).
  void load_prefixed(torch::nn::Module& m, const std::string& prefix) const;
  // The tensors under `prefix` ("optim.", "scaler."), with the prefix removed.
  std::map<std::string, at::Tensor> section(const std::string& prefix) const;
  const at::Tensor* find(const std::string& name) const { return st_.find(name); }
  // For --resume: UserError unless this is a training checkpoint of `arch`.
  void require_training(const std::string& flag, const std::string& arch) const;

 private:
  std::string path_;
  CheckpointMeta meta_;
  io::SafeTensors st_;
};

// --resume auto: the training checkpoints in `dir`, newest first (the most updates; at a tie the
// end-of-epoch file); empty when there is none yet. Files whose header is unreadable are skipped
// with a warning; the caller falls back to the next one when a file's tensors turn out damaged.
std::vector<std::string> find_checkpoints(const std::string& dir);
// The .safetensors files of `dir` whose header reads, with their metadata (temporary and
// non-regular files left out; both, and unreadable headers, warned when `warn`).
std::vector<std::pair<std::string, CheckpointMeta>> scan_checkpoints(const std::string& dir, bool warn);

class CheckpointSaver {
 public:
  CheckpointSaver(std::string dir, int64_t max_history, bool decreasing)
      : dir_(std::move(dir)), max_history_(max_history), decreasing_(decreasing) {}
  // `write(path)` writes one checkpoint file. Returns true when this epoch is the new best.
  bool save(int64_t epoch, double metric, const std::function<void(const std::string&)>& write);
  // A resumed run: the checkpoint-<epoch> files of epochs before `start_epoch` already in the
  // folder join the kept list (by the metric in their header), and those beyond --checkpoint-hist
  // are removed now, so the limit holds across any number of restarts. Links a killed save did
  // not make (last.safetensors of epoch start_epoch - 1 as checkpoint-<epoch>, model_best) are made.
  void adopt_existing(int64_t start_epoch);
  // Mid-epoch recovery files: after writing `keep` (or, with "", after an epoch's checkpoint,
  // which supersedes them all), every other recovery-*.safetensors of the folder is removed.
  void prune_recovery(const std::string& keep) const;
  std::optional<double> best_metric;
  int64_t best_epoch = -1;
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  bool better(double a, double b) const { return decreasing_ ? a < b : a > b; }

 private:
  std::string dir_;
  int64_t max_history_;
  bool decreasing_;
  std::vector<std::pair<std::string, double>> kept_;  // best first
  // timm's policy for one epoch's file: linked as checkpoint-<epoch> when among the best N.
  void keep(int64_t epoch, double metric, const std::string& last);
};

}  // namespace imgtrain::engine
