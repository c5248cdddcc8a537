#include "model_zoo/registry.h"

#include "core/error.h"

namespace imgtrain::model_zoo {
namespace {
const Registry<ModelEntry>& registry() {
  static const Registry<ModelEntry> r = [] {
    Registry<ModelEntry> r;
    register_resnet(r);
    return r;
  }();
  return r;
}
}  // namespace

const ModelEntry* find_model(const std::string& name) { return registry().find(name); }

std::vector<std::string> list_models(const std::string& pattern) { return registry().names(pattern); }

const ModelDefaults& model_defaults(const std::string& name) {
  auto* e = registry().find(name);
  if (!e) create_model(name, {});  // throws the friendly error
  return e->defaults;
}

Model create_model(const std::string& name, const ModelArgs& args) {
  auto* e = registry().find(name);
  if (!e) {
    auto close = closest_names(name, registry().names(), 3);
    std::string list;
    for (auto& c : close) list += (list.empty() ? "" : ", ") + c;
    throw UserError(fmt::format("--model '{}': unknown model (closest: {}; `imgtrain models` lists all)", name, list));
  }
  return e->create(args);
}

int64_t count_params(const torch::nn::Module& m) {
  int64_t n = 0;
  for (auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace imgtrain::model_zoo
