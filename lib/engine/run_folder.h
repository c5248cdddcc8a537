// A training run's output folder, as timm lays it out: <output>/<experiment>/ with args.yaml,
// log.txt, summary.csv (epoch, train_*, eval_* in the evaluator's order, lr) and the checkpoints.
// Only the primary rank writes; the others get the same paths.
#pragma once
#include "engine/task.h"

#include <memory>
#include <string>

namespace imgtrain::engine {

// timm's default experiment name: <YYYYmmdd-HHMMSS>-<model>-<img size>.
std::string default_experiment(const std::string& model, int64_t img_size);

class RunFolder {
 public:
  // Creates <output or ./output/train>/<experiment> and writes args.yaml there (primary only).
  // The primary holds an exclusive lock on the folder (<dir>/.lock, flock) while it lives: a second
  // run into the same folder is refused in one line naming the holder (pid and host); the lock
  // ends with the process, so --resume auto after a kill finds it free. Holding it, the primary
  // removes temporary files (*.tmp.<pid>) that a killed process of an earlier run left behind.
  RunFolder(const std::string& output, const std::string& experiment, const std::string& args_yaml, bool primary);
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Sends the log to <dir>/log.txt as well (primary only).
  void open_log() const;
  // One summary.csv row; the header is written with the first row of a new file.
  void append_summary(int64_t epoch, const NamedValues& train, const NamedValues& eval, double lr) const;
  // A resumed run: drops the rows of epochs >= `from_epoch` (written before a kill, about to be
  // redone), so summary.csv keeps one row per epoch.
  void truncate_summary(int64_t from_epoch) const;

 private:
  std::string dir_;
  bool primary_;
  std::shared_ptr<int> lock_;  // the lock file's descriptor, closed (unlocked) with the last copy
};

}  // namespace imgtrain::engine
