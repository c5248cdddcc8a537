#include "model_zoo/registry.h"

#include "core/error.h"

namespace imgtrain::model_zoo {
namespace {
const Registry<ModelEntry>& registry() {
  static const Registry<ModelEntry> r = [] {
    Registry<ModelEntry> r;
    register_resnet(r);
    register_vit(r);
    register_efficientnet(r);
    register_convnext(r);
    register_detection(r);
    return r;
  }();
  return r;
}
}  // namespace

ModelDefaults timm_defaults(const std::string& name) {
  static const std::map<std::string, ModelDefaults> table = {
#include "model_zoo/pretrained_cfgs.inc"
  };
  auto it = table.find(name);
  if (it == table.end()) throw std::logic_error("model_zoo/pretrained_cfgs.inc has no entry for " + name);
  return it->second;
}

std::pair<std::string, std::string> split_model_name(const std::string& name) {
  auto dot = name.find('.');
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

const ModelEntry* find_model(const std::string& name) { return registry().find(split_model_name(name).first); }

std::vector<std::string> list_models(const std::string& pattern) { return registry().names(pattern); }

namespace {
const ModelEntry& entry(const std::string& full_name) {
  const std::string name = split_model_name(full_name).first;
  auto* e = registry().find(name);
  if (!e) {
    auto close = closest_names(name, registry().names(), 3);
    std::string list;
    for (auto& c : close) list += (list.empty() ? "" : ", ") + c;
    throw UserError(fmt::format("--model '{}': unknown model (closest: {}; `imgtrain models` lists all)", name, list));
  }
  return *e;
}
}  // namespace

Model create_model(const std::string& full_name, const ModelArgs& args) {
  const auto& e = entry(full_name);
  if (!e.create)
    throw UserError(fmt::format("--model '{}': a {} model, not a classifier", full_name, e.task));
  return e.create(args);
}

std::shared_ptr<torch::nn::Module> create_module(const std::string& full_name, const ModelArgs& args) {
  const auto& e = entry(full_name);
  if (e.create) return e.create(args);
  return e.create_module(args);
}

const std::string& model_task(const std::string& name) { return entry(name).task; }

const ModelDefaults& model_defaults(const std::string& name) { return entry(name).defaults; }

bool cpu_training_nhwc_fused(const std::string& name) {
  const auto* e = find_model(name);
  return e && e->cpu_training_nhwc_fused;
}

bool cpu_training_fused(const std::string& name) {
  const auto* e = find_model(name);
  return e && (e->cpu_training_nhwc_fused || !e->cpu_training_fused.empty());
}

std::string cpu_training_fused_kernels(const std::string& name) {
  const auto* e = find_model(name);
  if (!e) return "";
  if (!e->cpu_training_fused.empty()) return e->cpu_training_fused;
  return e->cpu_training_nhwc_fused ? "BatchNorm fused with the residual add and activation" : "";
}

int64_t count_params(const torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace imgtrain::model_zoo
