// Checkpoints as safetensors: the model's state dict under "model.", optimizer state under
// "optim.", scalars (epoch, arch, args, metric, ...) in the header's metadata. timm's
// CheckpointSaver policy: last every epoch, checkpoint-<epoch> for the best N, model_best.
#pragma once
#include "io/safetensors.h"

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace imgtrain::engine {

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
