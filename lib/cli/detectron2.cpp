#include "cli/detectron2.h"

#include "core/error.h"

#include <fmt/format.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

namespace imgtrain::cli {
namespace {

namespace fs = std::filesystem;

// A value as Detectron2 reads it: yacs literal-evaluates strings, so "(640, 672)" and
// "('coco_2017_train',)" are tuples and YAML sequences are lists; both become `items`.
struct Lit {
  bool list = false;
  std::string atom;  // canonical: numbers as fmt prints a double, booleans true/false, strings unquoted
  std::vector<Lit> items;
  std::string text() const {
    if (!list) return atom;
    std::string s = "[";
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) s += ", ";
      s += items[i].text();
    }
    return s + "]";
  }
};

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

Lit atom(std::string s) {
  s = trim(s);
  if (s.size() >= 2 && (s.front() == '\'' || s.front() == '"') && s.back() == s.front()) return {false, s.substr(1, s.size() - 2), {}};
  if (s == "True" || s == "true") return {false, "true", {}};
  if (s == "False" || s == "false") return {false, "false", {}};
  if (s == "None" || s == "null" || s == "~") return {false, "", {}};
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (!s.empty() && end && *end == 0 && std::isfinite(v)) return {false, fmt::format("{}", v), {}};
  return {false, s, {}};
}

// A Python literal of tuples / lists of atoms; `pos` advances over it.
Lit parse_literal(const std::string& s, size_t& pos, const std::string& where, int depth = 0) {
  auto skip = [&] {
    while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  };
  skip();
  if (depth > 8) throw UserError(fmt::format("{}: value nested too deeply", where));
  if (pos < s.size() && (s[pos] == '(' || s[pos] == '[')) {
    const char close = s[pos] == '(' ? ')' : ']';
    ++pos;
    Lit l;
    l.list = true;
    for (;;) {
      skip();
      if (pos >= s.size()) throw UserError(fmt::format("{}: '{}' is not a closed tuple or list", where, s));
      if (s[pos] == close) {
        ++pos;
        return l;
      }
      l.items.push_back(parse_literal(s, pos, where, depth + 1));
      skip();
      if (pos < s.size() && s[pos] == ',') ++pos;
      else if (pos < s.size() && s[pos] != close)
        throw UserError(fmt::format("{}: '{}' is not a tuple or list of values", where, s));
    }
  }
  const size_t start = pos;
  if (pos < s.size() && (s[pos] == '\'' || s[pos] == '"')) {
    const char q = s[pos++];
    while (pos < s.size() && s[pos] != q) ++pos;
    if (pos >= s.size()) throw UserError(fmt::format("{}: unterminated string in '{}'", where, s));
    ++pos;
  } else {
    while (pos < s.size() && s[pos] != ',' && s[pos] != ')' && s[pos] != ']') ++pos;
  }
  return atom(s.substr(start, pos - start));
}

Lit to_lit(const YAML::Node& n, const std::string& where) {
  if (n.IsNull()) return atom("None");
  if (n.IsSequence()) {
    Lit l;
    l.list = true;
    for (auto e : n) l.items.push_back(to_lit(e, where));
    return l;
  }
  if (!n.IsScalar()) throw UserError(fmt::format("{}: expected a value or a list", where));
  const std::string s = trim(n.as<std::string>());
  if (!s.empty() && (s[0] == '(' || s[0] == '[')) {
    size_t pos = 0;
    Lit l = parse_literal(s, pos, where);
    if (trim(s.substr(pos)).size()) throw UserError(fmt::format("{}: '{}' has text after its end", where, s));
    return l;
  }
  return atom(s);
}

void flatten(const YAML::Node& n, const std::string& prefix, const std::string& file, std::map<std::string, Lit>& out) {
  for (auto it : n) {
    const std::string key = prefix + it.first.as<std::string>();
    if (it.second.IsMap()) {
      flatten(it.second, key + ".", file, out);
    } else {
      out[key] = to_lit(it.second, fmt::format("key '{}' in {}", key, file));
    }
  }
}

// merge_from_file: the _BASE_ file first (relative to this one), this file's keys over it.
void load(const std::string& path, const YAML::Node& root, std::map<std::string, Lit>& out, std::map<std::string, std::string>& from,
          int depth) {
  if (depth > 8) throw UserError(fmt::format("--config '{}': _BASE_ files nest more than 8 deep (a loop?)", path));
  if (!root.IsMap()) throw UserError(fmt::format("--config '{}': expected a mapping of keys to values", path));
  if (auto base = root["_BASE_"]) {
    if (!base.IsScalar()) throw UserError(fmt::format("--config '{}': _BASE_ must name one file", path));
    fs::path bp = base.as<std::string>();
    if (bp.is_relative()) bp = fs::path(path).parent_path() / bp;
    const YAML::Node broot = load_yaml_file(bp.string(), fmt::format("--config '{}': its _BASE_", path));
    load(bp.string(), broot, out, from, depth + 1);
  }
  YAML::Node rest = YAML::Clone(root);
  rest.remove("_BASE_");
  std::map<std::string, Lit> mine;
  flatten(rest, "", path, mine);
  for (auto& [k, v] : mine) {
    out[k] = v;
    from[k] = path;
  }
}

const std::set<std::string>& top_sections() {
  static const std::set<std::string> s = {"_BASE_", "MODEL",   "SOLVER",         "INPUT",      "DATALOADER", "DATASETS",
                                          "TEST",   "VERSION", "OUTPUT_DIR", "SEED", "CUDNN_BENCHMARK", "VIS_PERIOD",
                                          "GLOBAL"};
  return s;
}

struct Mapper {
  std::map<std::string, Lit> file;          // the merged keys
  std::map<std::string, std::string> from;  // which file set each key
  std::set<std::string> used;
  std::vector<Detectron2Setting> out;
  std::vector<std::string>& warnings;

  std::string where(const std::string& key) const {
    auto f = from.find(key);
    return f == from.end() ? fmt::format("Detectron2's default for {}", key)
                           : fmt::format("key '{}' in {}", key, f->second);
  }
  bool has(const std::string& key) const { return file.count(key) > 0; }
  // The file's value, else Detectron2's default (given as a literal's text).
  Lit get(const std::string& key, const std::string& def) {
    used.insert(key);
    auto f = file.find(key);
    if (f != file.end()) return f->second;
    size_t pos = 0;
    return def.size() && (def[0] == '(' || def[0] == '[') ? parse_literal(def, pos, key) : atom(def);
  }
  [[noreturn]] void refuse(const std::string& key, const Lit& v, const std::string& why) const {
    throw UserError(fmt::format("{}: {} {}", where(key), v.text(), why));
  }
  void set(const std::string& flag, const std::string& value, const std::string& key) {
    out.push_back({flag, value, has(key) ? key : "default " + key});
  }
  double number(const std::string& key, const Lit& v) const {
    char* end = nullptr;
    const double d = v.list ? NAN : std::strtod(v.atom.c_str(), &end);
    if (v.list || v.atom.empty() || *end || !std::isfinite(d)) refuse(key, v, "is not a number");
    return d;
  }
  bool boolean(const std::string& key, const Lit& v) const {
    if (v.list || (v.atom != "true" && v.atom != "false")) refuse(key, v, "is not True or False");
    return v.atom == "true";
  }
  std::string list(const std::string& key, const Lit& v) const {
    const std::vector<Lit> items = v.list ? v.items : std::vector<Lit>{v};
    if (items.empty()) refuse(key, v, "is empty");
    std::string s;
    for (auto& i : items) {
      if (!s.empty()) s += ',';
      s += fmt::format("{}", number(key, i));
    }
    return s;
  }
  // A key imgtrain maps straight onto one flag.
  void plain(const std::string& key, const std::string& def, const std::string& flag) {
    if (def.empty() && !has(key)) return;
    const Lit v = get(key, def);
    set(flag, v.list ? list(key, v) : v.atom, key);
  }
  // A key describing the architecture: accepted where it holds what imgtrain builds.
  void fixed(const std::string& key, const std::string& value, const std::string& what) {
    if (!has(key)) return;
    const Lit v = get(key, "");
    size_t pos = 0;
    const Lit want = value.size() && (value[0] == '(' || value[0] == '[') ? parse_literal(value, pos, key) : atom(value);
    if (v.text() != want.text())
      refuse(key, v, fmt::format("is not supported: imgtrain builds {} ({})", what, want.text()));
  }
  void no_effect(const std::string& key, const std::string& why) {
    if (!has(key)) return;
    get(key, "");
    warnings.push_back(fmt::format("{} ({}) changes nothing: {}", where(key), file.at(key).text(), why));
  }
};

}  // namespace

namespace {
// Keys at any depth must be plain names (a list or a mapping as a key is valid YAML). Aliases make
// a small file a huge tree ("billion laughs"): at most 100,000 values are looked at.
void check_keys(const YAML::Node& n, const std::string& path, const std::string& what, int depth, size_t& budget) {
  if (depth > 64) throw UserError(fmt::format("{} '{}': nested more than 64 levels deep", what, path));
  if (budget-- == 0)
    throw UserError(fmt::format("{} '{}': more than 100000 values (aliases expanding?); a config is a few hundred",
                                what, path));
  if (n.IsMap()) {
    for (auto it : n) {
      if (!it.first.IsScalar())
        throw UserError(fmt::format("{} '{}': line {}: a key must be a name, not a list or a mapping", what, path,
                                    it.first.Mark().line + 1));
      check_keys(it.second, path, what, depth + 1, budget);
    }
  } else if (n.IsSequence()) {
    for (auto e : n) check_keys(e, path, what, depth + 1, budget);
  }
}
}  // namespace

namespace {
// yaml-cpp (0.7 and 0.8) never consumes a stray ',' (or ',]', ',}') at the start of a document: the
// parser reports the same empty document again and again, so YAML::LoadAll loops, allocating until
// memory runs out (upstream jbeder/yaml-cpp#1040, fixed after 0.8 by #1319), and YAML::Load quietly
// returns null. One pass over the events finds it: a document that starts where the previous one
// started made no progress. The same pass counts documents without building them.
struct DocumentCounter : YAML::EventHandler {
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& m) override { starts.push_back(m); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};
}  // namespace

YAML::Node load_yaml_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw UserError(fmt::format("{} '{}': a folder, not a file", what, path));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UserError(fmt::format("{} '{}': cannot read the file", what, path));
  constexpr size_t kMaxBytes = size_t(16) << 20;
  std::string text;  // read in 64 KiB pieces up to the cap (a pipe has no size to ask for)
  char piece[1 << 16];
  while (text.size() <= kMaxBytes && f.read(piece, sizeof piece).gcount() > 0) text.append(piece, size_t(f.gcount()));
  if (text.size() > kMaxBytes)
    throw UserError(fmt::format("{} '{}': larger than 16 MiB; a config is a few kilobytes", what, path));
  YAML::Node root;
  try {
    std::istringstream in(text);
    YAML::Parser parser(in);
    DocumentCounter counter;
    while (counter.starts.size() < 3 && parser.HandleNextDocument(counter)) {
      const auto& s = counter.starts;
      if (s.size() >= 2 && s[s.size() - 1].pos == s[s.size() - 2].pos) {
        const YAML::Mark m = s.back();
        const char c = size_t(m.pos) < text.size() ? text[size_t(m.pos)] : ' ';
        throw UserError(fmt::format("{} '{}': not valid YAML (line {}, column {}: unexpected '{}')", what, path,
                                    m.line + 1, m.column + 1, c));
      }
    }
    if (counter.starts.size() > 1)
      throw UserError(fmt::format("{} '{}': holds {}{} YAML documents ('---' separators); one config per file is read",
                                  what, path, counter.starts.size() >= 3 ? "at least " : "", counter.starts.size()));
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw UserError(fmt::format("{} '{}': not valid YAML ({})", what, path, e.what()));
  }
  size_t budget = 100000;
  check_keys(root, path, what, 0, budget);
  return root;
}

bool is_detectron2_config(const YAML::Node& root) {
  if (!root.IsMap()) return false;
  for (auto it : root)
    if (it.first.IsScalar() && top_sections().count(it.first.as<std::string>())) return true;
  return false;
}

std::vector<Detectron2Setting> detectron2_settings(const std::string& path, const YAML::Node& root,
                                                   std::vector<std::string>& warnings) {
  Mapper m{{}, {}, {}, {}, warnings};
  load(path, root, m.file, m.from, 0);
  const std::string tv = "torchvision's R-CNN with FPN";

  // The model: MASK_ON and the ResNet depth name one of torchvision's builders.
  m.fixed("MODEL.META_ARCHITECTURE", "GeneralizedRCNN", tv);
  m.fixed("MODEL.BACKBONE.NAME", "build_resnet_fpn_backbone", tv);
  if (m.has("MODEL.META_ARCHITECTURE") || m.has("MODEL.MASK_ON") || m.has("MODEL.RESNETS.DEPTH")) {
    const bool mask = m.boolean("MODEL.MASK_ON", m.get("MODEL.MASK_ON", "False"));
    const Lit d = m.get("MODEL.RESNETS.DEPTH", "50");
    const double depth = m.number("MODEL.RESNETS.DEPTH", d);
    if (depth != 18 && depth != 34 && depth != 50 && depth != 101)
      m.refuse("MODEL.RESNETS.DEPTH", d, "is not supported: expected 18, 34, 50 or 101");
    m.set("model", fmt::format("{}rcnn_resnet{}_fpn", mask ? "mask" : "faster", int(depth)),
          m.has("MODEL.MASK_ON") ? "MODEL.MASK_ON" : "MODEL.RESNETS.DEPTH");
    m.set("dataset", "coco", "MODEL.META_ARCHITECTURE");
    // Detectron2's masks: targets by BitMasks.crop_and_resize (aligned, binarised), pasted by
    // grid_sample (no key selects another)
    if (mask) m.set("mask-convention", "detectron2", "MODEL.MASK_ON");
  }
  if (m.has("MODEL.WEIGHTS")) {
    const Lit w = m.get("MODEL.WEIGHTS", "");
    if (!w.atom.empty()) m.set("pretrained-path", w.atom, "MODEL.WEIGHTS");
  }
  if (m.has("MODEL.ROI_HEADS.NUM_CLASSES")) {  // Detectron2 counts without the background
    const Lit v = m.get("MODEL.ROI_HEADS.NUM_CLASSES", "");
    const double n = m.number("MODEL.ROI_HEADS.NUM_CLASSES", v);
    if (n < 1 || n != std::floor(n)) m.refuse("MODEL.ROI_HEADS.NUM_CLASSES", v, "is not a positive integer");
    m.set("num-classes", fmt::format("{}", int64_t(n) + 1), "MODEL.ROI_HEADS.NUM_CLASSES");
  }
  if (m.has("MODEL.BACKBONE.FREEZE_AT")) {  // its default 2 is torchvision's default from weights (3 layers)
    const Lit v = m.get("MODEL.BACKBONE.FREEZE_AT", "");
    const double f = m.number("MODEL.BACKBONE.FREEZE_AT", v);
    if (f < 0 || f > 5 || f != std::floor(f)) m.refuse("MODEL.BACKBONE.FREEZE_AT", v, "is not 0 to 5");
    // FREEZE_AT k freezes the stem and the first k - 1 stages: torchvision trains the other 5 - k.
    m.set("trainable-backbone-layers", fmt::format("{}", 5 - int(f)), "MODEL.BACKBONE.FREEZE_AT");
  }
  m.fixed("MODEL.RESNETS.OUT_FEATURES", "['res2', 'res3', 'res4', 'res5']", tv);
  m.fixed("MODEL.RESNETS.NORM", "FrozenBN", tv + ", FrozenBatchNorm2d in a body that starts from weights");
  m.fixed("MODEL.RESNETS.STRIDE_IN_1X1", "False", "torchvision's ResNet, stride in the 3x3 convolution");
  m.fixed("MODEL.RESNETS.NUM_GROUPS", "1", "torchvision's ResNet");
  m.fixed("MODEL.RESNETS.WIDTH_PER_GROUP", "64", "torchvision's ResNet");
  m.fixed("MODEL.FPN.IN_FEATURES", "['res2', 'res3', 'res4', 'res5']", tv);
  m.fixed("MODEL.FPN.NORM", "", tv);
  m.fixed("MODEL.ANCHOR_GENERATOR.SIZES", "[[32], [64], [128], [256], [512]]", tv);
  m.fixed("MODEL.ANCHOR_GENERATOR.ASPECT_RATIOS", "[[0.5, 1.0, 2.0]]", tv);
  m.fixed("MODEL.RPN.IN_FEATURES", "['p2', 'p3', 'p4', 'p5', 'p6']", tv);
  m.fixed("MODEL.RPN.IOU_THRESHOLDS", "[0.3, 0.7]", tv);
  m.fixed("MODEL.RPN.POSITIVE_FRACTION", "0.5", tv);
  m.fixed("MODEL.ROI_HEADS.NAME", "StandardROIHeads", tv);
  m.fixed("MODEL.ROI_HEADS.IN_FEATURES", "['p2', 'p3', 'p4', 'p5']", tv);
  m.fixed("MODEL.ROI_HEADS.IOU_THRESHOLDS", "[0.5]", tv);
  m.fixed("MODEL.ROI_HEADS.POSITIVE_FRACTION", "0.25", tv);
  m.fixed("MODEL.ROI_BOX_HEAD.NAME", "FastRCNNConvFCHead", tv);
  m.fixed("MODEL.ROI_BOX_HEAD.NUM_FC", "2", tv);
  m.fixed("MODEL.ROI_BOX_HEAD.NUM_CONV", "0", tv);
  m.fixed("MODEL.ROI_BOX_HEAD.POOLER_RESOLUTION", "7", tv);
  m.fixed("MODEL.ROI_MASK_HEAD.NAME", "MaskRCNNConvUpsampleHead", tv);
  m.fixed("MODEL.ROI_MASK_HEAD.POOLER_RESOLUTION", "14", tv);

  m.plain("MODEL.RPN.NMS_THRESH", "0.7", "rpn-nms-thresh");
  m.plain("MODEL.RPN.PRE_NMS_TOPK_TRAIN", "2000", "rpn-pre-nms-top-n-train");
  m.plain("MODEL.RPN.PRE_NMS_TOPK_TEST", "1000", "rpn-pre-nms-top-n-test");
  m.plain("MODEL.RPN.POST_NMS_TOPK_TRAIN", "2000", "rpn-post-nms-top-n-train");
  m.plain("MODEL.RPN.POST_NMS_TOPK_TEST", "1000", "rpn-post-nms-top-n-test");
  m.plain("MODEL.RPN.BATCH_SIZE_PER_IMAGE", "256", "rpn-batch-size-per-image");
  m.plain("MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", "512", "box-batch-size-per-image");
  m.plain("MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.05", "box-score-thresh");
  m.plain("MODEL.ROI_HEADS.NMS_THRESH_TEST", "0.5", "box-nms-thresh");
  m.plain("TEST.DETECTIONS_PER_IMAGE", "100", "box-detections-per-img");
  // Widths: taken where the file names them (Base-RCNN-FPN's 256 / 1024 / 256 / 4 are imgtrain's defaults).
  m.plain("MODEL.FPN.OUT_CHANNELS", "", "fpn-channels");
  m.plain("MODEL.ROI_BOX_HEAD.FC_DIM", "", "box-head-dim");
  m.plain("MODEL.ROI_MASK_HEAD.CONV_DIM", "", "mask-head-dim");
  m.plain("MODEL.ROI_MASK_HEAD.NUM_CONV", "", "mask-head-convs");

  // RoIAlign: one setting for the box and mask poolers.
  {
    const Lit type = m.get("MODEL.ROI_BOX_HEAD.POOLER_TYPE", "ROIAlignV2");
    if (type.atom != "ROIAlignV2" && type.atom != "ROIAlign")
      m.refuse("MODEL.ROI_BOX_HEAD.POOLER_TYPE", type, "is not supported: expected ROIAlignV2 or ROIAlign");
    const Lit ratio = m.get("MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO", "0");
    const Lit mtype = m.get("MODEL.ROI_MASK_HEAD.POOLER_TYPE", "ROIAlignV2");
    const Lit mratio = m.get("MODEL.ROI_MASK_HEAD.POOLER_SAMPLING_RATIO", "0");
    if (m.has("MODEL.ROI_MASK_HEAD.POOLER_TYPE") || m.has("MODEL.ROI_MASK_HEAD.POOLER_SAMPLING_RATIO") ||
        m.has("MODEL.ROI_BOX_HEAD.POOLER_TYPE") || m.has("MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO"))
      if (mtype.text() != type.text() || mratio.text() != ratio.text())
        m.refuse("MODEL.ROI_MASK_HEAD.POOLER_TYPE", mtype,
                 fmt::format("with sampling ratio {}: imgtrain's mask pooler takes the box pooler's setting ({}, {})",
                             mratio.text(), type.text(), ratio.text()));
    m.set("roi-align-v2", type.atom == "ROIAlignV2" ? "true" : "false", "MODEL.ROI_BOX_HEAD.POOLER_TYPE");
    m.set("box-sampling-ratio", fmt::format("{}", m.number("MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO", ratio)),
          "MODEL.ROI_BOX_HEAD.POOLER_SAMPLING_RATIO");
  }
  // Box regression losses: Detectron2's smooth_l1 with beta 0 is L1; torchvision's beta is 1/9.
  auto reg_loss = [&](const std::string& prefix, const std::string& flag) {
    const Lit type = m.get(prefix + ".BBOX_REG_LOSS_TYPE", "smooth_l1");
    if (type.atom != "smooth_l1")
      m.refuse(prefix + ".BBOX_REG_LOSS_TYPE", type, "is not supported: expected smooth_l1 (L1 with beta 0)");
    const Lit beta = m.get(prefix + ".SMOOTH_L1_BETA", "0.0");
    const double b = m.number(prefix + ".SMOOTH_L1_BETA", beta);
    if (b != 0 && std::abs(b - 1.0 / 9) > 1e-6)
      m.refuse(prefix + ".SMOOTH_L1_BETA", beta, "is not supported: expected 0 (L1) or 1/9 (torchvision's)");
    m.set(flag, b == 0 ? "l1" : "smooth_l1", prefix + ".SMOOTH_L1_BETA");
  };
  reg_loss("MODEL.ROI_BOX_HEAD", "box-loss");
  reg_loss("MODEL.RPN", "rpn-box-loss");

  // Solver: SGD with momentum, a linear warmup and multistep (or cosine) decay, counted in iterations.
  {
    const Lit nesterov = m.get("SOLVER.NESTEROV", "False");
    m.set("opt", m.boolean("SOLVER.NESTEROV", nesterov) ? "nesterov" : "momentum", "SOLVER.NESTEROV");
  }
  m.plain("SOLVER.BASE_LR", "0.001", "lr");
  m.plain("SOLVER.MOMENTUM", "0.9", "momentum");
  m.plain("SOLVER.WEIGHT_DECAY", "0.0001", "weight-decay");
  m.fixed("SOLVER.WEIGHT_DECAY_NORM", "0.0", "no weight decay on norm layers (and biases), as timm");
  m.fixed("SOLVER.WEIGHT_DECAY_BIAS", "0.0", "no weight decay on biases (and norm layers), as timm");
  m.plain("SOLVER.IMS_PER_BATCH", "16", "ims-per-batch");
  m.fixed("SOLVER.REFERENCE_WORLD_SIZE", "0", "the batch and lr as given");
  m.plain("SOLVER.MAX_ITER", "40000", "max-iter");
  {
    const Lit name = m.get("SOLVER.LR_SCHEDULER_NAME", "WarmupMultiStepLR");
    if (name.atom == "WarmupMultiStepLR") {
      m.plain("SOLVER.STEPS", "(30000,)", "lr-steps");
    } else if (name.atom == "WarmupCosineLR") {
      m.set("sched", "cosine", "SOLVER.LR_SCHEDULER_NAME");
      m.plain("SOLVER.BASE_LR_END", "0.0", "min-lr");
      m.get("SOLVER.STEPS", "");  // unused by the cosine schedule, as in Detectron2
    } else {
      m.refuse("SOLVER.LR_SCHEDULER_NAME", name, "is not supported: expected WarmupMultiStepLR or WarmupCosineLR");
    }
  }
  m.plain("SOLVER.GAMMA", "0.1", "lr-gamma");
  m.fixed("SOLVER.WARMUP_METHOD", "linear", "a linear warmup");
  m.plain("SOLVER.WARMUP_ITERS", "1000", "warmup-iters");
  m.plain("SOLVER.WARMUP_FACTOR", "0.001", "warmup-factor");
  if (m.has("SOLVER.CLIP_GRADIENTS.ENABLED") &&
      m.boolean("SOLVER.CLIP_GRADIENTS.ENABLED", m.get("SOLVER.CLIP_GRADIENTS.ENABLED", ""))) {
    const Lit type = m.get("SOLVER.CLIP_GRADIENTS.CLIP_TYPE", "value");
    if (type.atom != "value" && type.atom != "norm")
      m.refuse("SOLVER.CLIP_GRADIENTS.CLIP_TYPE", type, "is not supported: expected value or norm");
    m.fixed("SOLVER.CLIP_GRADIENTS.NORM_TYPE", "2.0", "the 2-norm");
    m.set("clip-mode", type.atom, "SOLVER.CLIP_GRADIENTS.CLIP_TYPE");
    m.plain("SOLVER.CLIP_GRADIENTS.CLIP_VALUE", "1.0", "clip-grad");
  } else {
    for (const char* k : {"SOLVER.CLIP_GRADIENTS.CLIP_TYPE", "SOLVER.CLIP_GRADIENTS.CLIP_VALUE",
                          "SOLVER.CLIP_GRADIENTS.NORM_TYPE"})
      if (m.has(k)) m.get(k, "");
  }
  if (m.has("SOLVER.AMP.ENABLED")) m.set("amp", m.boolean("SOLVER.AMP.ENABLED", m.get("SOLVER.AMP.ENABLED", "")) ? "true" : "false", "SOLVER.AMP.ENABLED");
  m.no_effect("SOLVER.CHECKPOINT_PERIOD", "imgtrain writes a checkpoint at the end of each epoch (--recovery-interval N "
                                          "adds one every N updates)");
  m.no_effect("TEST.EVAL_PERIOD", "imgtrain evaluates at the end of each epoch");
  m.no_effect("VIS_PERIOD", "imgtrain draws no training visualisations");
  m.no_effect("CUDNN_BENCHMARK", "imgtrain chooses cuDNN's algorithm search itself");

  // Input: ResizeShortestEdge with a choice of sizes, a horizontal flip.
  m.plain("INPUT.MIN_SIZE_TRAIN", "(800,)", "min-size");
  m.plain("INPUT.MIN_SIZE_TEST", "800", "min-size-test");
  m.fixed("INPUT.MIN_SIZE_TRAIN_SAMPLING", "choice", "a shorter side drawn from INPUT.MIN_SIZE_TRAIN");
  {
    const Lit tr = m.get("INPUT.MAX_SIZE_TRAIN", "1333"), te = m.get("INPUT.MAX_SIZE_TEST", "1333");
    if (tr.text() != te.text())
      m.refuse("INPUT.MAX_SIZE_TEST", te,
               fmt::format("differs from INPUT.MAX_SIZE_TRAIN {}: imgtrain has one --max-size, as torchvision",
                           tr.text()));
    m.set("max-size", fmt::format("{}", m.number("INPUT.MAX_SIZE_TRAIN", tr)), "INPUT.MAX_SIZE_TRAIN");
  }
  {
    const Lit flip = m.get("INPUT.RANDOM_FLIP", "horizontal");
    if (flip.atom != "horizontal" && flip.atom != "none")
      m.refuse("INPUT.RANDOM_FLIP", flip, "is not supported: expected horizontal or none");
    m.set("hflip", flip.atom == "horizontal" ? "0.5" : "0", "INPUT.RANDOM_FLIP");
  }
  if (m.has("INPUT.MASK_FORMAT")) {
    const Lit f = m.get("INPUT.MASK_FORMAT", "");
    if (f.atom != "polygon" && f.atom != "bitmask")
      m.refuse("INPUT.MASK_FORMAT", f, "is not supported: expected polygon or bitmask");
  }
  m.plain("DATALOADER.NUM_WORKERS", "4", "workers");
  {
    const Lit g = m.get("DATALOADER.ASPECT_RATIO_GROUPING", "True");
    if (m.boolean("DATALOADER.ASPECT_RATIO_GROUPING", g)) {
      m.set("two-bucket-grouping", "true", "DATALOADER.ASPECT_RATIO_GROUPING");
    } else {
      m.set("two-bucket-grouping", "false", "DATALOADER.ASPECT_RATIO_GROUPING");
      m.set("aspect-ratio-group-factor", "-1", "DATALOADER.ASPECT_RATIO_GROUPING");
    }
  }
  m.fixed("DATALOADER.FILTER_EMPTY_ANNOTATIONS", "True", "training images without a usable box left out");
  m.fixed("DATALOADER.SAMPLER_TRAIN", "TrainingSampler", "a shuffled sampler");
  auto split = [&](const std::string& key, const std::string& flag) {
    if (!m.has(key)) return;
    const Lit v = m.get(key, "");
    const std::vector<Lit> items = v.list ? v.items : std::vector<Lit>{v};
    if (items.size() != 1 || items[0].list || items[0].atom.rfind("coco_2017_", 0) != 0)
      m.refuse(key, v, "is not supported: expected one COCO 2017 split (coco_2017_train, coco_2017_val), read from --data-dir");
    m.set(flag, items[0].atom.substr(10), key);
  };
  split("DATASETS.TRAIN", "train-split");
  split("DATASETS.TEST", "val-split");
  m.plain("OUTPUT_DIR", "", "output");
  if (m.has("SEED")) {
    const Lit s = m.get("SEED", "");
    const double v = m.number("SEED", s);
    if (v < 0 || v != std::floor(v))
      m.refuse("SEED", s, "is not supported: imgtrain runs are seeded; give a seed >= 0 (--seed, default 42)");
    m.set("seed", fmt::format("{}", int64_t(v)), "SEED");
  }
  m.fixed("VERSION", "2", "Detectron2's config version 2");

  for (auto& [k, v] : m.file)
    if (!m.used.count(k))
      throw UserError(fmt::format("{}: a Detectron2 key imgtrain does not map (docs/detection.md lists the keys it "
                                  "reads)",
                                  m.where(k)));
  return m.out;
}

}  // namespace imgtrain::cli
