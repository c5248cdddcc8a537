// Checkpoints as safetensors: the model's state dict under "model.", optimizer state under
// "optim.", scalars (epoch, arch, args, metric, ...) in the header's metadata. timm's
// CheckpointSaver policy: last every epoch, checkpoint-<epoch> for the best N, model_best.
#pragma once
#include "io/safetensors.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace imgtrain::engine {

// Parameters and buffers under their module paths: timm's state dict.
std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& m);

// Copies tensors named `prefix + key` into the module's state; every key must match by name and
// shape, otherwise a UserError lists what is missing, unexpected or of the wrong shape.
void load_state_dict(torch::nn::Module& m, const io::SafeTensors& st, const std::string& prefix, const std::string& what);

// The weights of a checkpoint or plain state-dict file: "ema." if present and preferred, else
// "model.", else unprefixed keys.
std::string weights_prefix(const io::SafeTensors& st, bool prefer_ema);

class CheckpointSaver {
 public:
  CheckpointSaver(std::string dir, int64_t max_history, bool decreasing)
      : dir_(std::move(dir)), max_history_(max_history), decreasing_(decreasing) {}
  // `write(path)` writes one checkpoint file. Returns true when this epoch is the new best.
  bool save(int64_t epoch, double metric, const std::function<void(const std::string&)>& write);
  std::optional<double> best_metric;
  int64_t best_epoch = -1;
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  bool better(double a, double b) const { return decreasing_ ? a < b : a > b; }

 private:
  std::string dir_;
  int64_t max_history_;
  bool decreasing_;
  std::vector<std::pair<std::string, double>> kept_;  // best first
};

}  // namespace imgtrain::engine
