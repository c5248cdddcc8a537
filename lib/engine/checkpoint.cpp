#include "engine/checkpoint.h"

#include "core/error.h"
#include "core/log.h"

#include <torch/torch.h>

#include <filesystem>

namespace fs = std::filesystem;

namespace imgtrain::engine {

namespace {
void replace_with_link(const std::string& from, const std::string& to) {
  // Hard link to a temporary name, then rename over the target: readers never see it missing.
  std::string tmp = to + ".tmp";
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_hard_link(from, tmp, ec);
  if (ec) fs::copy_file(from, tmp, fs::copy_options::overwrite_existing);
  fs::rename(tmp, to);
}
}  // namespace

bool CheckpointSaver::save(int64_t epoch, double metric, const std::function<void(const std::string&)>& write) {
  const std::string last = path("last.safetensors");
  write(last);
  const bool room = int64_t(kept_.size()) < max_history_;
  if (room || better(metric, kept_.back().second)) {
    if (!room) {
      std::error_code ec;
      fs::remove(kept_.back().first, ec);
      kept_.pop_back();
    }
    std::string name = path(fmt::format("checkpoint-{}.safetensors", epoch));
    replace_with_link(last, name);
    kept_.emplace_back(name, metric);
    std::stable_sort(kept_.begin(), kept_.end(), [&](auto& a, auto& b) { return better(a.second, b.second); });
    std::string listing = "Current checkpoints:\n";
    for (auto& [f, m] : kept_) listing += fmt::format(" ('{}', {})\n", f, m);
    listing.pop_back();
    log::write_info(listing);
  }
  if (!best_metric || better(metric, *best_metric)) {
    best_metric = metric;
    best_epoch = epoch;
    replace_with_link(last, path("model_best.safetensors"));
    return true;
  }
  return false;
}

}  // namespace imgtrain::engine
