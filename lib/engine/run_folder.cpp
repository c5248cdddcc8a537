#include "engine/run_folder.h"

#include "core/error.h"
#include "core/log.h"

#include <ctime>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace imgtrain::engine {

std::string default_experiment(const std::string& model, int64_t img_size) {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
  return fmt::format("{}-{}-{}", buf, model, img_size);
}

RunFolder::RunFolder(const std::string& output, const std::string& experiment, const std::string& args_yaml,
                     bool primary)
    : dir_((fs::path(output.empty() ? "./output/train" : output) / experiment).string()), primary_(primary) {
  if (!primary_) return;
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw UserError(fmt::format("--output '{}': cannot create the folder ({})", dir_, ec.message()));
  std::ofstream f(dir_ + "/args.yaml");
  f << args_yaml;
  if (!f) throw UserError(fmt::format("cannot write '{}/args.yaml'", dir_));
}

void RunFolder::open_log() const {
  if (primary_) log::set_file(dir_ + "/log.txt");
}

void RunFolder::append_summary(int64_t epoch, const NamedValues& train, const NamedValues& eval, double lr) const {
  if (!primary_) return;
  const std::string summary = path("summary.csv");
  const bool header = !fs::exists(summary);
  std::ofstream f(summary, std::ios::app);
  if (header) {
    std::string h = "epoch";
    for (auto& [k, v] : train) h += ",train_" + k;
    for (auto& [k, v] : eval) h += ",eval_" + k;
    f << h << ",lr\n";
  }
  std::string row = std::to_string(epoch);
  for (auto& [k, v] : train) row += fmt::format(",{}", v);
  for (auto& [k, v] : eval) row += fmt::format(",{}", v);
  f << row << fmt::format(",{}\n", lr);
}

}  // namespace imgtrain::engine
