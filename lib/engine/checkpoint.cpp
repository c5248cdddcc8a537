#include "engine/checkpoint.h"

#include "core/error.h"
#include "core/log.h"

#include <fmt/ranges.h>
#include <torch/torch.h>

#include <filesystem>
#include <set>

namespace fs = std::filesystem;

namespace imgtrain::engine {

std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (auto& b : m.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

std::string weights_prefix(const io::SafeTensors& st, bool prefer_ema) {
  bool has_ema = false, has_model = false;
  for (auto& [k, v] : st.tensors) {
    has_ema |= k.rfind("ema.", 0) == 0;
    has_model |= k.rfind("model.", 0) == 0;
  }
  if (prefer_ema && has_ema) return "ema.";
  if (has_model) return "model.";
  return "";
}

void load_state_dict(torch::nn::Module& m, const io::SafeTensors& st, const std::string& prefix,
                     const std::string& what) {
  std::map<std::string, const at::Tensor*> src;
  for (auto& [k, v] : st.tensors)
    if (prefix.empty() || k.rfind(prefix, 0) == 0)
      src[k.substr(prefix.size())] = &v;
  std::vector<std::string> missing, wrong;
  std::set<std::string> used;
  auto dst = state_dict(m);
  for (auto& [k, t] : dst) {
    auto it = src.find(k);
    if (it == src.end()) {
      missing.push_back(k);
      continue;
    }
    used.insert(k);
    if (it->second->sizes() != t.sizes())
      wrong.push_back(fmt::format("{} ({} in file, {} in model)", k, fmt::join(it->second->sizes(), "x"),
                                  fmt::join(t.sizes(), "x")));
  }
  std::vector<std::string> unexpected;
  for (auto& [k, v] : src)
    if (!used.count(k)) unexpected.push_back(k);
  if (!missing.empty() || !wrong.empty() || !unexpected.empty()) {
    auto list = [](const std::vector<std::string>& v) {
      std::string s;
      for (size_t i = 0; i < v.size() && i < 5; ++i) s += (i ? ", " : "") + v[i];
      if (v.size() > 5) s += fmt::format(", ... ({} in all)", v.size());
      return s;
    };
    std::string msg = fmt::format("weights in '{}' do not fit the model:", what);
    if (!missing.empty()) msg += " missing " + list(missing) + ";";
    if (!unexpected.empty()) msg += " unexpected " + list(unexpected) + ";";
    if (!wrong.empty()) msg += " wrong shape " + list(wrong) + ";";
    msg.pop_back();
    throw UserError(msg);
  }
  torch::NoGradGuard ng;
  for (auto& [k, t] : dst) t.copy_(*src[k]);
}

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
