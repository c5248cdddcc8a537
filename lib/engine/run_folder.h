// A training run's output folder, as timm lays it out: <output>/<experiment>/ with args.yaml,
// log.txt, summary.csv (epoch, train_*, eval_* in the evaluator's order, lr) and the checkpoints.
// Only the primary rank writes; the others get the same paths.
#pragma once
#include "engine/task.h"

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace imgtrain::engine {

// timm's default experiment name: <YYYYmmdd-HHMMSS>-<model>-<img size>.
std::string default_experiment(const std::string& model, int64_t img_size);
// `experiment` itself, or UserError where it is not a folder name under --output ("../x", "/abs").
const std::string& checked_experiment(const std::string& experiment);

class RunFolder {
 public:
  // Creates <output or ./output/train>/<experiment> (primary only). The primary holds an exclusive
  // lock on the folder (<dir>/.lock, flock) while it lives: a second run into the same folder is
  // refused in one line naming the holder (pid and host); the lock ends with the process, so
  // --resume auto after a kill finds it free. Holding it, the primary removes temporary files
  // (*.tmp.<pid>) that a killed process of an earlier run left behind.
  RunFolder(const std::string& output, const std::string& experiment, bool primary);
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Starts the run in the folder (primary only): writes args.yaml and sends the log to log.txt as
  // well. A run that does not continue the folder's own run (`continues`: resumed from one of its
  // checkpoints) and finds an earlier run's checkpoints or summary.csv there moves that run's files
  // into <dir>/earlier-run-<N>/ with one warning, so that the runs never mix: no duplicate
  // summary.csv rows, no stale checkpoint-<N> beside the new ones for --resume auto to pick.
  // Returns the folder they went to ("" when none).
  std::string begin(const std::string& args_yaml, bool continues) const;
  // Moves `files` (paths in this folder) into the next free <dir>/earlier-run-<N>/ and returns it
  // ("" when there is nothing to move, or on other ranks).
  std::string set_aside(const std::vector<std::string>& files) const;
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

// TensorBoard event files, written natively (no protobuf library): TFRecord framing (length,
// masked CRC-32C of the length, the record, masked CRC-32C of the record) around Event protobufs
// holding one scalar summary each. File name as TensorBoard's own writer picks it
// (events.out.tfevents.<seconds>.<host>.<pid>); `tensorboard --logdir DIR` reads it.
class EventWriter {
 public:
  EventWriter() = default;  // off: scalar() does nothing
  explicit EventWriter(const std::string& dir);
  bool enabled() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }
  void scalar(const std::string& tag, double value, int64_t step);
  void flush();

 private:
  void record(const std::string& event);
  std::shared_ptr<std::FILE> file_;
  std::string path_;
};

// Training curves drawn from runs' summary.csv files into one PNG: three panels (train loss, the
// eval metric — top-1 and top-5, or the first eval columns that are not a loss — and lr) over
// epochs, with min/max on each axis. One run: a colour per curve (kCurveColours, in the order
// train loss, first eval, second eval, lr); several runs: a colour per run, named in a legend.
// Throws UserError when no run has a readable summary.csv.
void plot_runs(const std::vector<std::string>& run_dirs, const std::string& png_path);
// RGB colours of the curves of a single run's plot (the test finds them in the picture).
inline constexpr unsigned char kCurveColours[4][3] = {{31, 119, 180}, {214, 39, 40}, {255, 127, 14}, {44, 160, 44}};
// Writes an 8-bit BGR image as an RGB PNG (zlib; no image codec library needed).
void write_png(const std::string& path, int width, int height, const unsigned char* bgr);

// CRC-32C (Castagnoli), TFRecord's checksum.
uint32_t crc32c(const void* data, size_t n);

}  // namespace imgtrain::engine
