#include "io/weights.h"

#include "core/error.h"
#include "io/torch_pickle.h"

#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

namespace fs = std::filesystem;

namespace imgtrain::io {

SafeTensors load_weights_file(const std::string& path) {
  return is_torch_save_file(path) ? load_torch_save(path) : load_safetensors(path);
}

std::vector<std::pair<std::string, at::Tensor>> state_dict(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& p : m.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (auto& b : m.named_buffers(true)) out.emplace_back(b.key(), b.value());
  return out;
}

std::string weights_prefix(const SafeTensors& st, bool prefer_ema) {
  bool has_ema = false, has_model = false;
  for (auto& [k, v] : st.tensors) {
    has_ema |= k.rfind("ema.", 0) == 0;
    has_model |= k.rfind("model.", 0) == 0;
  }
  if (prefer_ema && has_ema) return "ema.";
  if (has_model) return "model.";
  return "";
}

bool all_finite(const at::Tensor& t) {
  return !at::isFloatingType(t.scalar_type()) || t.numel() == 0 || at::isfinite(t).all().item<bool>();
}

void load_state_dict(torch::nn::Module& m, const SafeTensors& st, const std::string& prefix, const std::string& what,
                     const std::set<std::string>& keep) {
  std::map<std::string, const at::Tensor*> src;
  for (auto& [k, v] : st.tensors)
    if (prefix.empty() || k.rfind(prefix, 0) == 0) src[k.substr(prefix.size())] = &v;
  std::vector<std::string> missing, wrong, wrong_names, unexpected;
  std::set<std::string> used;
  auto dst = state_dict(m);
  for (auto& [k, t] : dst) {
    if (keep.count(k)) continue;
    auto it = src.find(k);
    if (it == src.end()) {
      missing.push_back(k);
      continue;
    }
    used.insert(k);
    if (it->second->sizes() != t.sizes()) {
      wrong_names.push_back(k);
      wrong.push_back(fmt::format("{} ({} in file, {} in model)", k, fmt::join(it->second->sizes(), "x"),
                                  fmt::join(t.sizes(), "x")));
    }
  }
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
    throw WeightsMismatch(msg, std::move(missing), std::move(unexpected), std::move(wrong_names));
  }
  // NaN or infinite weights would only surface later as "training diverged": name them now.
  std::vector<std::string> non_finite;
  for (auto& [k, t] : dst) {
    if (keep.count(k)) continue;
    const at::Tensor& v = *src[k];
    if (!all_finite(v)) non_finite.push_back(k);
  }
  if (!non_finite.empty())
    throw UserError(fmt::format("weights in '{}' hold NaN or infinite values: {}{}", what, non_finite.front(),
                                non_finite.size() > 1 ? fmt::format(" and {} more tensor(s)", non_finite.size() - 1) : ""));
  torch::NoGradGuard ng;
  for (auto& [k, t] : dst)
    if (!keep.count(k)) t.copy_(*src[k]);
}

at::Tensor adapt_input_conv(int64_t in_chans, const at::Tensor& weight) {
  auto w = weight.to(torch::kFloat32);
  const int64_t o = w.size(0), i = w.size(1), kh = w.size(2), kw = w.size(3);
  if (in_chans == 1) {
    if (i > 3) {
      if (i % 3) throw UserError(fmt::format("cannot adapt a {}-channel first conv to 1 channel", i));
      w = w.reshape({o, i / 3, 3, kh, kw}).sum(2);
    } else {
      w = w.sum(1, true);
    }
  } else if (in_chans != 3) {
    if (i != 3) throw UserError(fmt::format("cannot adapt a {}-channel first conv to {} channels", i, in_chans));
    int64_t repeat = (in_chans + 2) / 3;
    w = w.repeat({1, repeat, 1, 1}).narrow(1, 0, in_chans) * (3.0 / double(in_chans));
  }
  return w.to(weight.scalar_type());
}

at::Tensor resample_abs_pos_embed(const at::Tensor& posemb, int64_t new_h, int64_t new_w, int64_t num_prefix_tokens) {
  const int64_t n = posemb.size(1) - num_prefix_tokens, dim = posemb.size(2);
  const auto side = int64_t(std::lround(std::sqrt(double(n))));
  if (side * side != n)
    throw UserError(fmt::format("pos_embed with {} grid tokens is not a square grid; cannot resample it", n));
  auto prefix = posemb.narrow(1, 0, num_prefix_tokens);
  auto grid = posemb.narrow(1, num_prefix_tokens, n).to(torch::kFloat32).reshape({1, side, side, dim}).permute({0, 3, 1, 2});
  namespace F = torch::nn::functional;
  grid = F::interpolate(grid, F::InterpolateFuncOptions()
                                  .size(std::vector<int64_t>{new_h, new_w})
                                  .mode(torch::kBicubic)
                                  .align_corners(false)
                                  .antialias(true));
  grid = grid.permute({0, 2, 3, 1}).reshape({1, new_h * new_w, dim}).to(posemb.scalar_type());
  return torch::cat({prefix, grid}, 1);
}

std::string load_pretrained(torch::nn::Module& m, const SafeTensors& st, const PretrainedSpec& spec,
                            const std::string& what) {
  const std::string prefix = weights_prefix(st, true);
  std::map<std::string, at::Tensor> model_sd;
  for (auto& [k, v] : state_dict(m)) model_sd[k] = v;
  SafeTensors adapted;
  std::set<std::string> keep;
  std::string note;
  const std::string conv_key = spec.first_conv + ".weight";
  const std::string head = spec.classifier + ".";
  bool head_reset = false;
  for (auto& [k0, v] : st.tensors) {
    if (!prefix.empty() && k0.rfind(prefix, 0) != 0) continue;
    std::string k = k0.substr(prefix.size());
    auto it = model_sd.find(k);
    if (k.rfind(head, 0) == 0 && (it == model_sd.end() || it->second.sizes() != v.sizes())) {
      head_reset = true;  // different class count (or no head): keep the model's own classifier
      continue;
    }
    at::Tensor t = v;
    if (k == conv_key && it != model_sd.end() && v.dim() == 4 && it->second.size(1) != v.size(1)) {
      t = adapt_input_conv(it->second.size(1), v);
      note += fmt::format("adapted {} from {} to {} input channels; ", conv_key, v.size(1), it->second.size(1));
    }
    if (k == "pos_embed" && it != model_sd.end() && v.dim() == 3 && it->second.dim() == 3 &&
        it->second.size(1) != v.size(1) && it->second.size(2) == v.size(2)) {
      // a ViT at another image size: the square grid of the model (after the class token)
      const int64_t n = it->second.size(1) - 1, side = int64_t(std::lround(std::sqrt(double(n))));
      if (side * side == n) {
        t = resample_abs_pos_embed(v, side, side, 1);
        note += fmt::format("resampled pos_embed from {} to {} tokens; ", v.size(1), it->second.size(1));
      }
    }
    adapted.tensors.emplace_back(k, t);
  }
  if (head_reset) {
    for (auto& [k, v] : model_sd)
      if (k.rfind(head, 0) == 0) keep.insert(k);
    note += fmt::format("classifier {} re-initialised for the model's class count; ", spec.classifier);
  }
  load_state_dict(m, adapted, "", what, keep);
  if (!note.empty()) note.resize(note.size() - 2);
  return note;
}

std::string find_hub_weights(const std::string& model, const std::string& tag) {
  std::string cache;
  if (const char* c = std::getenv("HF_HUB_CACHE"); c && *c) cache = c;
  else if (const char* h = std::getenv("HF_HOME"); h && *h) cache = std::string(h) + "/hub";
  else if (const char* home = std::getenv("HOME"); home && *home) cache = std::string(home) + "/.cache/huggingface/hub";
  else cache = ".cache/huggingface/hub";
  const std::string repo = fmt::format("{}/models--timm--{}.{}", cache, model, tag);
  std::error_code ec;
  std::vector<std::string> looked;
  std::string rev;
  if (std::ifstream ref(repo + "/refs/main"); ref && std::getline(ref, rev) && !rev.empty()) {
    std::string p = repo + "/snapshots/" + rev + "/model.safetensors";
    if (fs::is_regular_file(p, ec)) return p;
    looked.push_back(p);
  }
  std::vector<std::string> found;
  if (fs::is_directory(repo + "/snapshots", ec))
    for (auto& e : fs::directory_iterator(repo + "/snapshots", ec))
      if (fs::is_regular_file(e.path() / "model.safetensors", ec)) found.push_back((e.path() / "model.safetensors").string());
  std::sort(found.begin(), found.end());
  if (!found.empty()) return found.front();
  looked.push_back(repo + "/snapshots/*/model.safetensors");
  throw UserError(fmt::format("--pretrained: no weights for {}.{} in the Hugging Face cache (looked at {}; set HF_HUB_CACHE "
                              "or HF_HOME, or give --pretrained-path FILE)",
                              model, tag, fmt::join(looked, ", ")));
}

}  // namespace imgtrain::io
