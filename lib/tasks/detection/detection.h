// Object detection / instance segmentation as a Task: torchvision's Faster / Mask R-CNN
// (model_zoo/detection) trained on COCO-style data. The loader gives pad-collated batches of whole
// images with their targets; this task does the rest of torchvision's GeneralizedRCNNTransform
// on the device (per image: the normalised crop resized by the image's drawn shorter side, boxes
// and masks with it, then padded to 32), runs the model, and returns torchvision's loss dict. The
// evaluator is the COCO one (bbox, and segm for Mask R-CNN).
#pragma once
#include "data/coco_detection.h"
#include "engine/task.h"
#include "model_zoo/detection/rcnn.h"

#include <memory>
#include <string>

namespace imgtrain::tasks {

struct DetectionOptions {
  std::string model;
  model_zoo::detection::RCNNOptions rcnn;
  // --pretrained-path: a backbone's weights (a classifier state dict, e.g. timm's or torchvision's
  // ResNet-50; torchvision's --weights-backbone) or a whole detector's (torchvision names); a box
  // or mask predictor with another class count keeps its initialisation.
  std::string pretrained_path;
  double eval_min_size = 800, max_size = 1333;  // training sizes are drawn per sample by the loader
  uint64_t seed = 42;
  int64_t rank = 0;
  std::shared_ptr<const data::CocoDetection> eval_data;  // what the evaluator scores against
  std::string results_path;  // validate: write the detections (COCO results json) here
};

class DetectionTask : public engine::Task {
 public:
  explicit DetectionTask(DetectionOptions o) : o_(std::move(o)) {}
  std::string name() const override { return "detection"; }
  std::shared_ptr<torch::nn::Module> create_model() const override;
  void load_pretrained(torch::nn::Module& model) const override;
  engine::StepOutput forward_train(torch::nn::Module& model, at::Tensor x, const data::Batch& batch,
                                   const engine::StepContext& s) override;
  engine::EvalOutputs forward_eval(torch::nn::Module& model, const at::Tensor& x, const data::Batch& batch,
                                   const engine::StepContext& s) override;
  std::unique_ptr<engine::Evaluator> evaluator(dist::Context* ctx) const override;
  std::vector<std::string> metric_names() const override;
  const DetectionOptions& options() const { return o_; }

 private:
  DetectionOptions o_;
};

// The model's input for a batch: each image's valid part of the normalised, padded batch `x`,
// resized as GeneralizedRCNNTransform does (shorter side to `min_size` of its target, or
// `default_min`, capped by `max_size`), batched to multiples of 32; with `targets`, the boxes (and
// masks when `masks`) at the resized size.
model_zoo::detection::ImageBatch detection_input(const at::Tensor& x, const data::Batch& batch, double default_min,
                                                 double max_size, std::vector<model_zoo::detection::Target>* targets,
                                                 bool masks);

}  // namespace imgtrain::tasks
