// The seam between the one training engine and what differs per task (classification,
// detection): a Task builds the model, turns a batch into a loss (a named loss dict, as
// torchvision's detection models return) and makes an Evaluator whose ordered (name, value)
// list becomes summary.csv's columns, the log line and the best-checkpoint metric. The loop,
// AMP, accumulation, DDP, EMA, checkpoints and logs know no labels: they see only this.
#pragma once
#include "core/model.h"
#include "data/loader.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace imgtrain::dist {
class Context;
}

namespace imgtrain::engine {

using NamedValues = std::vector<std::pair<std::string, double>>;

// The loss of one training micro-step: the total that is backpropagated and its named parts.
struct StepOutput {
  at::Tensor loss;
  std::vector<std::pair<std::string, at::Tensor>> parts;
};

// What the loop tells the task about the micro-step it runs.
struct StepContext {
  int64_t epoch = 0;
  int64_t batch_idx = 0;  // index within the epoch (per-batch randomness is drawn from it)
  // O2: the model runs in half precision: the input goes in as `input_dtype` (after any batch
  // augmentation), and the loss is taken in float32.
  std::optional<at::ScalarType> input_dtype;
  bool float32_loss = false;
  bool autocast = false;      // the forward runs under autocast
};

// An evaluation forward's results, by name (classification: "logits", "loss").
struct EvalOutputs {
  std::map<std::string, at::Tensor> tensors;
  const at::Tensor& at(const std::string& k) const { return tensors.at(k); }
};

// Accumulates one pass over the evaluation split.
class Evaluator {
 public:
  virtual ~Evaluator() = default;
  virtual void update(const EvalOutputs& out, const data::Batch& batch) = 0;
  // After the last batch: combine what the ranks saw (a no-op when update already reduces).
  virtual void sync() {}
  // Ordered metrics: summary.csv's eval_* columns, --eval-metric's choices, the best metric.
  virtual NamedValues summarize() const = 0;
  // The running part of the progress line (train.py style, or validate.py's when `validate_style`).
  virtual std::string progress(bool validate_style) const = 0;
  // Samples seen by all ranks.
  virtual int64_t count() const = 0;
  // validate.py's closing line (" * Acc@1 ...") and its result row's metric fields, in order.
  virtual std::string summary_line() const = 0;
  virtual NamedValues result_fields() const = 0;
};

// Parameter facts the optimizer needs (timm's no_weight_decay and group_matcher).
struct ParamInfo {
  std::set<std::string> no_weight_decay;
  std::vector<GroupRule> group_matcher;
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  // A new model (random init, the task's arguments); the EMA is a second one of these.
  virtual std::shared_ptr<torch::nn::Module> create_model() const = 0;
  // --pretrained / --pretrained-path, when asked for; no-op otherwise.
  virtual void load_pretrained(torch::nn::Module& model) const {}
  virtual ParamInfo param_info(torch::nn::Module& model) const { return {}; }
  // timm's clip exclude_head for --clip-mode agc: this many trailing parameters are not clipped.
  virtual int64_t agc_exclude_last() const { return 0; }
  // Called once per epoch before its first step (e.g. mixup off from some epoch on).
  virtual void start_epoch(int64_t epoch) {}
  // One micro-step's loss. `x` is the model's input on the device (normalised, channels-last
  // when asked); the task may change it (batch augmentations such as mixup).
  virtual StepOutput forward_train(torch::nn::Module& model, at::Tensor x, const data::Batch& batch,
                                   const StepContext& s) = 0;
  virtual EvalOutputs forward_eval(torch::nn::Module& model, const at::Tensor& x, const data::Batch& batch,
                                   const StepContext& s) = 0;
  // A fresh evaluator for one pass; `ctx` (null alone) is the group its metrics are reduced over.
  virtual std::unique_ptr<Evaluator> evaluator(dist::Context* ctx) const = 0;
  // The names summarize() reports, in order, known before any evaluation.
  virtual std::vector<std::string> metric_names() const = 0;
};

}  // namespace imgtrain::engine
