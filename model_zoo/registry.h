// The model registry: timm's model names (torchvision's for detectors) mapped to factories,
// default data configs and the task each model is trained by. `imgtrain models` and the task
// setup read it; nothing else lists models.
#pragma once
#include "core/model.h"
#include "core/registry.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace imgtrain::model_zoo {

using Model = std::shared_ptr<ClassifierImpl>;

struct ModelEntry {
  std::function<Model(const ModelArgs&)> create;  // classifiers; empty for other tasks' models
  ModelDefaults defaults;
  std::string task = "classification";
  // Models of other tasks (detectors) are plain modules that their task knows how to drive.
  std::function<std::shared_ptr<torch::nn::Module>(const ModelArgs&)> create_module = nullptr;
  // Training on the CPU in float32 defaults to channels-last and the fused BatchNorm kernels
  // (--channels-last, --fuse-bn): set for the families where both were measured faster
  // (docs/performance.md, "CPU training defaults per family").
  bool cpu_training_nhwc_fused = false;
  // Training on the CPU in float32 defaults to the fused kernels (--fuse-bn) in the layout given,
  // named here for the log: ConvNeXt's MLP on tiles, ViT's attention (measured faster; their NCHW
  // default stays). Empty: none. With cpu_training_nhwc_fused, the log's name for its kernels
  // where they are not the classifiers' BatchNorm + residual + activation alone (the detectors').
  std::string cpu_training_fused;
};

const ModelEntry* find_model(const std::string& name);
// timm's "arch.tag" model names: ("resnet50", "a1_in1k"); the tag is "" when not given.
std::pair<std::string, std::string> split_model_name(const std::string& name);
std::vector<std::string> list_models(const std::string& pattern = "*");
// Throws UserError naming the closest registered names when `name` is unknown. A ".tag" suffix
// is accepted and ignored here (it only selects pretrained weights).
Model create_model(const std::string& name, const ModelArgs& args);
// Any registered model as a module (classifier or not), with the same errors for unknown names.
std::shared_ptr<torch::nn::Module> create_module(const std::string& name, const ModelArgs& args);
// The task that trains `name` ("classification", "detection"); UserError for unknown names.
const std::string& model_task(const std::string& name);
const ModelDefaults& model_defaults(const std::string& name);
// ModelEntry::cpu_training_nhwc_fused of `name` (false for unknown names).
bool cpu_training_nhwc_fused(const std::string& name);
// Whether training `name` on the CPU defaults to the fused kernels: cpu_training_nhwc_fused or
// cpu_training_fused (false for unknown names).
bool cpu_training_fused(const std::string& name);
// What the fused kernels of `name`'s CPU training are, for the log ("" for unknown names).
std::string cpu_training_fused_kernels(const std::string& name);
int64_t count_params(const torch::nn::Module& m);

// timm's default pretrained config and tags for `name` (model_zoo/pretrained_cfgs.inc, generated
// from timm by scripts/gen_model_cfgs.py); throws std::logic_error for a name missing there.
ModelDefaults timm_defaults(const std::string& name);

// Family registration hooks, called once by the registry.
void register_resnet(Registry<ModelEntry>& r);
void register_vit(Registry<ModelEntry>& r);
void register_efficientnet(Registry<ModelEntry>& r);
void register_convnext(Registry<ModelEntry>& r);
void register_detection(Registry<ModelEntry>& r);  // model_zoo/detection/rcnn.cpp

}  // namespace imgtrain::model_zoo
