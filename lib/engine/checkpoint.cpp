#include "engine/checkpoint.h"

#include "core/error.h"
#include "core/log.h"
#include "io/torch_pickle.h"
#include "io/weights.h"

#include <torch/torch.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <unistd.h>

namespace fs = std::filesystem;

namespace imgtrain::engine {

namespace {
void replace_with_link(const std::string& from, const std::string& to) {
  // Hard link to a temporary name, then rename over the target: readers never see it missing.
  std::string tmp = to + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove(tmp, ec);
  fs::create_hard_link(from, tmp, ec);
  if (ec) {
    ec.clear();
    fs::copy_file(from, tmp, fs::copy_options::overwrite_existing, ec);
  }
  if (!ec) fs::rename(tmp, to, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw UserError(fmt::format("cannot write '{}' ({})", to, ec.message()));
  }
}

bool is_recovery_name(const std::string& name) {
  return name.rfind("recovery-", 0) == 0 && name.size() > 12 && name.ends_with(".safetensors");
}
}  // namespace

std::map<std::string, std::string> CheckpointMeta::to_metadata() const {
  std::map<std::string, std::string> md{{"arch", arch}, {"task", task}, {"version", std::to_string(version)}};
  auto put_int = [&](const char* k, const std::optional<int64_t>& v) {
    if (v) md[k] = std::to_string(*v);
  };
  auto put_double = [&](const char* k, const std::optional<double>& v) {
    if (v) md[k] = fmt::format("{}", *v);
  };
  put_int("num_classes", num_classes);
  put_int("in_chans", in_chans);
  put_int("img_size", img_size);
  if (global_pool) md["global_pool"] = *global_pool;
  put_double("crop_pct", crop_pct);
  put_int("fpn_channels", fpn_channels);
  put_int("box_head_dim", box_head_dim);
  put_int("mask_head_dim", mask_head_dim);
  put_int("mask_head_convs", mask_head_convs);
  put_double("roi_canonical_size", roi_canonical_size);
  put_int("box_sampling_ratio", box_sampling_ratio);
  put_int("roi_align_v2", roi_align_v2);
  if (mask_convention) md["mask_convention"] = *mask_convention;
  put_int("epoch", epoch);
  put_int("num_updates", num_updates);
  put_int("recovery_update", recovery_update);
  put_int("epoch_updates", epoch_updates);
  put_double("metric", metric);
  put_double("best_metric", best_metric);
  put_int("best_epoch", best_epoch);
  if (!plateau.empty()) md["plateau"] = plateau;
  if (!loss_meters.empty()) md["loss_meters"] = loss_meters;
  if (!args.empty()) md["args"] = args;
  return md;
}

CheckpointMeta CheckpointMeta::from_metadata(const std::map<std::string, std::string>& md, const std::string& what) {
  CheckpointMeta m;
  auto get = [&](const char* k) -> const std::string* {
    auto it = md.find(k);
    return it == md.end() ? nullptr : &it->second;
  };
  auto bad = [&](const char* k, const std::string& v, const char* expected) {
    return UserError(fmt::format("'{}': metadata '{}' is '{}', expected {}", what, k, v, expected));
  };
  // A number written by to_metadata: the whole string must parse.
  auto get_number = [&]<typename T>(const char* k, T (*parse)(const std::string&, size_t*),
                                    const char* expected) -> std::optional<T> {
    auto* s = get(k);
    if (!s) return std::nullopt;
    try {
      size_t used = 0;
      T v = parse(*s, &used);
      if (used == s->size()) return v;
    } catch (const std::exception&) {
    }
    throw bad(k, *s, expected);
  };
  auto get_int = [&](const char* k) {
    return get_number(k, +[](const std::string& s, size_t* n) -> int64_t { return std::stoll(s, n); }, "an integer");
  };
  // The ranges the flags accept (a hand-edited or foreign header must not reach the model or the
  // schedule with a size of -3 or an epoch of -5).
  auto in_range = [&](const char* k, auto v, double lo, double hi, const char* expected) {
    if (v && !(double(*v) >= lo && double(*v) <= hi)) throw bad(k, fmt::format("{}", *v), expected);
    return v;
  };
  auto get_double = [&](const char* k) {
    return get_number(k, +[](const std::string& s, size_t* n) { return std::stod(s, n); }, "a number");
  };
  if (auto* s = get("arch")) m.arch = *s;
  if (auto* s = get("task")) m.task = *s;
  m.num_classes = in_range("num_classes", get_int("num_classes"), 1, 1e6, "an integer in [1, 1000000]");
  m.in_chans = in_range("in_chans", get_int("in_chans"), 1, 3, "1 or 3");
  if (m.in_chans == 2) throw bad("in_chans", "2", "1 or 3");
  m.img_size = in_range("img_size", get_int("img_size"), 1, 8192, "an integer in [1, 8192]");
  if (auto* s = get("global_pool")) m.global_pool = *s;
  m.crop_pct = in_range("crop_pct", get_double("crop_pct"), 0.05, 2, "a number in [0.05, 2]");
  m.fpn_channels = in_range("fpn_channels", get_int("fpn_channels"), 1, 4096, "an integer in [1, 4096]");
  m.box_head_dim = in_range("box_head_dim", get_int("box_head_dim"), 1, 4096, "an integer in [1, 4096]");
  m.mask_head_dim = in_range("mask_head_dim", get_int("mask_head_dim"), 1, 4096, "an integer in [1, 4096]");
  m.mask_head_convs = in_range("mask_head_convs", get_int("mask_head_convs"), 0, 16, "an integer in [0, 16]");
  m.roi_canonical_size =
      in_range("roi_canonical_size", get_double("roi_canonical_size"), 1, 1e5, "a number in [1, 100000]");
  m.box_sampling_ratio =
      in_range("box_sampling_ratio", get_int("box_sampling_ratio"), 0, 1024, "an integer in [0, 1024]");
  m.roi_align_v2 = in_range("roi_align_v2", get_int("roi_align_v2"), 0, 1, "0 or 1");
  if (auto* s = get("mask_convention")) {
    if (*s != "torchvision" && *s != "detectron2" && *s != "aligned")
      throw bad("mask_convention", *s, "torchvision, detectron2 or aligned");
    m.mask_convention = *s;
  }
  m.epoch = get_int("epoch");  // the training position: checked where it is used (require_training)
  m.num_updates = get_int("num_updates");
  m.recovery_update = get_int("recovery_update");
  m.epoch_updates = get_int("epoch_updates");
  m.metric = get_double("metric");
  m.best_metric = get_double("best_metric");
  m.best_epoch = get_int("best_epoch");
  if (auto* s = get("plateau")) m.plateau = *s;
  if (auto* s = get("loss_meters")) m.loss_meters = *s;
  if (auto* s = get("args")) m.args = *s;
  if (auto v = get_int("version")) m.version = *v;
  return m;
}

void write_checkpoint(const std::string& path, const CheckpointMeta& meta, const TrainStateRefs& s) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  if (s.model)
    for (auto& [k, v] : io::state_dict(*s.model)) tensors.emplace_back("model." + k, v);
  if (s.ema)
    for (auto& [k, v] : io::state_dict(*s.ema)) tensors.emplace_back("ema." + k, v);
  for (auto& [k, v] : s.optim) tensors.emplace_back("optim." + k, v);
  for (auto& [k, v] : s.master) tensors.emplace_back("master." + k, v);
  for (auto& [k, v] : s.scaler) tensors.emplace_back("scaler." + k, v);
  if (s.rng_cpu.defined()) tensors.emplace_back("rng.cpu", s.rng_cpu);
  if (s.rng_cuda.defined()) tensors.emplace_back("rng.cuda", s.rng_cuda);
  io::save_safetensors(path, tensors, meta.to_metadata());
}

Checkpoint Checkpoint::read(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  c.st_ = io::load_weights_file(path);  // imgtrain's own, or a torch.save file for its weights
  c.meta_ = CheckpointMeta::from_metadata(c.st_.metadata, path);
  return c;
}

CheckpointMeta Checkpoint::read_meta(const std::string& path) {
  if (io::is_torch_save_file(path))  // no header to read apart: the whole file
    return CheckpointMeta::from_metadata(io::load_torch_save(path).metadata, path);
  return CheckpointMeta::from_metadata(io::load_safetensors_metadata(path), path);
}

std::optional<std::string> CheckpointMeta::arg(const std::string& key) const {
  const YAML::Node v = arg_node(key);
  if (v && v.IsScalar()) return v.as<std::string>();
  return std::nullopt;
}

YAML::Node CheckpointMeta::arg_node(const std::string& key) const {
  try {
    const YAML::Node root = YAML::Load(args);
    if (root.IsMap() && root[key]) return root[key];
  } catch (const YAML::Exception&) {  // not YAML: a file written by hand; nothing to read from it
  }
  return YAML::Node(YAML::NodeType::Undefined);
}

std::string Checkpoint::weights_prefix(bool prefer_ema) const { return io::weights_prefix(st_, prefer_ema); }

void Checkpoint::load_weights(torch::nn::Module& m, bool prefer_ema) const {
  load_prefixed(m, weights_prefix(prefer_ema));
}

void Checkpoint::load_prefixed(torch::nn::Module& m, const std::string& prefix) const {
  io::load_state_dict(m, st_, prefix, path_);
}

std::map<std::string, at::Tensor> Checkpoint::section(const std::string& prefix) const {
  std::map<std::string, at::Tensor> out;
  for (auto& [k, v] : st_.tensors)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

void Checkpoint::require_training(const std::string& flag, const std::string& arch) const {
  auto missing = [&](const char* k) {
    return UserError(fmt::format("{} '{}': not an imgtrain training checkpoint (no '{}')", flag, path_, k));
  };
  if (!meta_.is_training() && io::is_torch_save_file(path_))
    throw UserError(fmt::format("{} '{}': a torch.save file (timm's or torchvision's checkpoint) holds no imgtrain "
                                "training state (optimizer state by parameter name, update count, loss scaler, RNG); "
                                "start from its weights with --initial-checkpoint instead",
                                flag, path_));
  if (meta_.arch.empty()) throw missing("arch");
  if (meta_.arch != arch)
    throw UserError(fmt::format("{} '{}': checkpoint is a {}, but --model is {}", flag, path_, meta_.arch, arch));
  if (!meta_.epoch) throw missing("epoch");
  if (!meta_.num_updates) throw missing("num_updates");
  // a position a run can continue from (a foreign or hand-edited header must not restart at epoch -5)
  auto bad = [&](const char* k, int64_t v, const char* expected) {
    return UserError(fmt::format("{} '{}': metadata '{}' is {}, expected {}", flag, path_, k, v, expected));
  };
  if (*meta_.epoch < 0 || *meta_.epoch > 999999) throw bad("epoch", *meta_.epoch, "an integer in [0, 999999]");
  if (*meta_.num_updates < 0) throw bad("num_updates", *meta_.num_updates, "an integer >= 0");
  if (meta_.recovery_update && *meta_.recovery_update < 0)
    throw bad("recovery_update", *meta_.recovery_update, "an integer >= 0");
  if (meta_.epoch_updates && *meta_.epoch_updates < 1) throw bad("epoch_updates", *meta_.epoch_updates, "an integer >= 1");
  if (meta_.best_epoch && *meta_.best_epoch < -1) throw bad("best_epoch", *meta_.best_epoch, "an integer >= -1");
  if (!meta_.plateau.empty() && !parse_plateau(meta_.plateau))
    throw UserError(fmt::format("{} '{}': metadata 'plateau' is '{}', expected '<lr> <best metric> <epochs without "
                                "improvement>' (a finite lr >= 0, a number, an integer >= 0)",
                                flag, path_, meta_.plateau));
}

std::optional<PlateauMeta> parse_plateau(const std::string& text) {
  std::istringstream in(text);
  std::string t[3], rest;
  if (!(in >> t[0] >> t[1] >> t[2]) || (in >> rest)) return std::nullopt;
  PlateauMeta m;
  double* v[2] = {&m.lr, &m.best};
  for (int i = 0; i < 2; ++i) {  // strtod: "inf" too, which a stream does not read
    char* end = nullptr;
    *v[i] = std::strtod(t[i].c_str(), &end);
    if (*end != '\0' || std::isnan(*v[i])) return std::nullopt;
  }
  if (!std::isfinite(m.lr) || m.lr < 0 || t[2].size() > 9 || t[2].find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  m.num_bad = std::stoll(t[2]);
  return m;
}

std::vector<std::pair<std::string, CheckpointMeta>> scan_checkpoints(const std::string& dir, bool warn) {
  std::error_code ec;
  std::vector<std::pair<std::string, CheckpointMeta>> out;
  for (auto& e : fs::directory_iterator(dir, ec)) {
    const auto name = e.path().filename().string();
    if (e.path().extension() != ".safetensors" || name.find(".tmp") != std::string::npos) continue;
    if (std::error_code rec; !e.is_regular_file(rec)) {  // a FIFO would block the read
      if (warn) log::warn("--resume auto: ignoring '{}': not a regular file", e.path().string());
      continue;
    }
    try {
      out.emplace_back(e.path().string(), Checkpoint::read_meta(e.path().string()));
    } catch (const UserError&) {
      if (warn) log::warn("--resume auto: ignoring unreadable file '{}'", e.path().string());
    }
  }
  return out;
}

std::vector<std::string> find_checkpoints(const std::string& dir) {
  std::vector<std::pair<std::pair<int64_t, int>, std::string>> found;
  for (auto& [path, m] : scan_checkpoints(dir, /*warn=*/true))
    if (m.num_updates && m.epoch) found.push_back({{*m.num_updates, m.recovery_update ? 0 : 1}, path});
  // newest first; at equal keys (last / checkpoint-N / model_best of one epoch) by name, so the
  // order does not depend on the directory's
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::string> out;
  for (auto& [k, p] : found) out.push_back(p);
  return out;
}

void CheckpointSaver::adopt_existing(int64_t start_epoch) {
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir_, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind("checkpoint-", 0) != 0 || e.path().extension() != ".safetensors") continue;
    if (std::error_code rec; !e.is_regular_file(rec)) continue;
    const std::string path = e.path().string();
    if (std::any_of(kept_.begin(), kept_.end(), [&](auto& k) { return k.first == path; })) continue;
    CheckpointMeta m;
    try {
      m = Checkpoint::read_meta(path);
    } catch (const UserError&) {
      continue;  // not ours to judge or remove
    }
    if (!m.epoch || !m.metric || *m.epoch >= start_epoch ||
        path != this->path(fmt::format("checkpoint-{}.safetensors", *m.epoch)))
      continue;
    kept_.emplace_back(path, *m.metric);
  }
  std::stable_sort(kept_.begin(), kept_.end(), [&](auto& a, auto& b) { return better(a.second, b.second); });
  while (int64_t(kept_.size()) > std::max<int64_t>(max_history_, 0)) {
    fs::remove(kept_.back().first, ec);
    kept_.pop_back();
  }
  // A process killed between writing last.safetensors and linking it as checkpoint-<epoch> /
  // model_best: the resumed run makes the links the save would have made.
  const std::string last = path("last.safetensors");
  if (!fs::is_regular_file(last, ec)) return;
  CheckpointMeta lm;
  try {
    lm = Checkpoint::read_meta(last);
  } catch (const UserError&) {
    return;
  }
  if (!lm.epoch || *lm.epoch != start_epoch - 1 || lm.recovery_update || !lm.metric) return;
  if (!fs::exists(path(fmt::format("checkpoint-{}.safetensors", *lm.epoch)), ec)) keep(*lm.epoch, *lm.metric, last);
  if (lm.best_epoch == lm.epoch) {
    std::optional<int64_t> best_file_epoch;
    try {
      if (fs::is_regular_file(path("model_best.safetensors"), ec))
        best_file_epoch = Checkpoint::read_meta(path("model_best.safetensors")).epoch;
    } catch (const UserError&) {
    }
    if (best_file_epoch != lm.epoch) replace_with_link(last, path("model_best.safetensors"));
  }
}

void CheckpointSaver::prune_recovery(const std::string& keep) const {
  std::error_code ec;
  std::vector<fs::path> old;
  for (auto& e : fs::directory_iterator(dir_, ec))
    if (is_recovery_name(e.path().filename().string()) && e.path().string() != keep) old.push_back(e.path());
  for (auto& p : old) fs::remove(p, ec);
}

bool CheckpointSaver::save(int64_t epoch, double metric, const std::function<void(const std::string&)>& write) {
  const std::string last = path("last.safetensors");
  write(last);
  keep(epoch, metric, last);
  if (!best_metric || better(metric, *best_metric)) {
    best_metric = metric;
    best_epoch = epoch;
    replace_with_link(last, path("model_best.safetensors"));
    return true;
  }
  return false;
}

void CheckpointSaver::keep(int64_t epoch, double metric, const std::string& last) {
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
}

}  // namespace imgtrain::engine
