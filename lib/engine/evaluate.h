// The evaluation driver: one pass of a model over the evaluation split through the task's
// forward and Evaluator, with timm's progress lines (train.py's "Test" / "Test (EMA)" lines, or
// validate.py's when validating). Shared by training (model and EMA) and `imgtrain validate`.
#pragma once
#include "data/loader.h"
#include "engine/setup.h"
#include "engine/task.h"

namespace imgtrain::engine {

struct EvalOptions {
  torch::Device device = torch::kCPU;
  std::vector<double> mean, std;
  bool channels_last = false;
  Amp amp;
  int64_t log_interval = 50;
  std::string log_suffix;       // " (EMA)" for the EMA's pass
  bool validate_style = false;  // validate.py's line format
  dist::Context* dist = nullptr;
};

struct EvalResult {
  NamedValues metrics;  // the evaluator's summary, in order
  int64_t count = 0;    // samples seen by all ranks
  std::string summary_line;   // the evaluator's closing line
  NamedValues result_fields;  // the evaluator's fields of validate's result row
  double get(const std::string& name) const;  // std::out_of_range for a name not reported
};

EvalResult evaluate(Task& task, torch::nn::Module& model, data::Loader& loader, const EvalOptions& o);

}  // namespace imgtrain::engine
