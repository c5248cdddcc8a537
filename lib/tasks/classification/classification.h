// Image classification as a Task: a zoo classifier, timm's training losses (label smoothing,
// soft targets after mixup/cutmix, BCE), batch augmentations on the normalised input (random
// erasing per sample, mixup/cutmix per batch), and an Evaluator reporting loss, top1 and top5
// exactly as timm's validate().
#pragma once
#include "data/augment.h"
#include "data/mixup.h"
#include "engine/task.h"
#include "tasks/classification/loss.h"

#include <optional>

namespace imgtrain::tasks {

struct ClassificationOptions {
  std::string model;  // registry name (".tag" selects pretrained weights)
  ModelArgs model_args;
  std::optional<double> bn_momentum, bn_eps;
  bool pretrained = false;      // timm's weights from the offline Hugging Face cache
  std::string pretrained_path;  // a weights file: safetensors or torch.save (io::load_weights_file)
  bool scored_as_loaded = false;  // validate: a classifier re-initialised for another class count is warned
  LossConfig loss;
  data::MixupConfig mixup;      // active() when mixup or cutmix is asked for
  int64_t mixup_off_epoch = 0;  // mixup/cutmix off from this epoch on (0: never)
  std::optional<data::RandomErasingConfig> erase;  // --reprob > 0: after normalisation, per sample
  uint64_t seed = 42;  // erasing draws come from (seed, epoch, sample); mixup's from (seed + rank, epoch, batch)
  int64_t rank = 0;
};

// timm's RandomErasing on a normalised NCHW batch (any device, any memory format), in place: each
// sample draws from its own (seed, epoch, indices[i]) generator; returns x.
at::Tensor random_erase(at::Tensor x, const at::Tensor& indices, const data::RandomErasingConfig& c, uint64_t seed,
                        int64_t epoch);

// The file --pretrained (timm's weights in the offline Hugging Face cache) or --pretrained-path
// names for `model` ("" when neither is given); a user error when the cache has none.
std::string pretrained_weights_path(const std::string& model, bool pretrained, const std::string& pretrained_path);

// The class count of the classifier `classifier` (its ".weight"'s rows) in a weights file, if it
// has one.
std::optional<int64_t> weights_class_count(const std::string& path, const std::string& classifier);

// Percent of rows whose target is within the top-k predictions, for each k.
std::vector<double> accuracy(const at::Tensor& logits, const at::Tensor& target, const std::vector<int64_t>& ks);

class ClassificationTask : public engine::Task {
 public:
  explicit ClassificationTask(ClassificationOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "classification"; }
  std::shared_ptr<torch::nn::Module> create_model() const override;
  void load_pretrained(torch::nn::Module& model) const override;
  engine::ParamInfo param_info(torch::nn::Module& model) const override;
  int64_t agc_exclude_last() const override { return 2; }  // the classifier's weight and bias
  void start_epoch(int64_t epoch) override;
  engine::StepOutput forward_train(torch::nn::Module& model, at::Tensor x, const data::Batch& batch,
                                   const engine::StepContext& s) override;
  engine::EvalOutputs forward_eval(torch::nn::Module& model, const at::Tensor& x, const data::Batch& batch,
                                   const engine::StepContext& s) override;
  std::unique_ptr<engine::Evaluator> evaluator(dist::Context* ctx) const override;
  std::vector<std::string> metric_names() const override { return {"loss", "top1", "top5"}; }
  const ClassificationOptions& options() const { return o_; }

 private:
  ClassificationOptions o_;
  bool mixup_enabled_ = true;
};

}  // namespace imgtrain::tasks
