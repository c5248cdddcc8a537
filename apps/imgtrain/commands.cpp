#include "apps/imgtrain/commands.h"

#include "cli/config.h"
#include "core/error.h"
#include "engine/trainer.h"
#include "model_zoo/registry.h"

#include <torch/torch.h>

#include <cstdio>

namespace imgtrain::app {

int train(const std::vector<std::string>& args) {
  auto cfg = cli::parse(cli::Command::Train, args);
  return cfg ? engine::train(*cfg) : 0;
}

int validate(const std::vector<std::string>& args) {
  auto cfg = cli::parse(cli::Command::Validate, args);
  return cfg ? engine::validate(*cfg) : 0;
}

int models(const std::vector<std::string>& args) {
  std::string pattern = "*";
  bool verbose = false;
  for (auto& a : args) {
    if (a == "-h" || a == "--help") {
      std::puts("usage: imgtrain models [WILDCARD] [--verbose]\n"
                "Lists registered models matching WILDCARD (shell-style, e.g. 'resnet*') with their parameter count;\n"
                "--verbose adds the default input size, crop_pct and interpolation.");
      return 0;
    }
    if (a == "--verbose" || a == "-v") verbose = true;
    else if (!a.empty() && a[0] == '-') throw UserError("models: unknown flag '" + a + "' (accepted: --verbose)");
    else pattern = a;
  }
  auto names = model_zoo::list_models(pattern);
  if (names.empty()) throw UserError("models: no model matches '" + pattern + "'");
  for (auto& n : names) {
    auto m = model_zoo::create_model(n, {});
    const auto& d = model_zoo::model_defaults(n);
    if (verbose) {
      std::string tags;
      for (auto& t : d.tags) tags += (tags.empty() ? "" : ",") + t;
      std::printf("%-28s %12lld  %lldx%lldx%lld  crop_pct=%.3g  %-8s  %s\n", n.c_str(),
                  (long long)model_zoo::count_params(*m), (long long)d.input_size[0], (long long)d.input_size[1],
                  (long long)d.input_size[2], d.crop_pct, d.interpolation.c_str(), tags.c_str());
    }
    else
      std::printf("%-28s %12lld\n", n.c_str(), (long long)model_zoo::count_params(*m));
  }
  return 0;
}

int version(const char* version) {
  std::printf("imgtrain %s (LibTorch %s, CUDA %s)\n", version, TORCH_VERSION,
#ifdef IMGTRAIN_WITH_CUDA
              "enabled"
#else
              "disabled"
#endif
  );
  return 0;
}

}  // namespace imgtrain::app
