// EfficientNet, MobileNetV2 and MobileNetV3 as timm builds them (timm/models/efficientnet.py,
// mobilenetv3.py, _efficientnet_builder.py, _efficientnet_blocks.py): the architectures are
// timm's block strings, decoded and scaled by the same rules, so module names, channel counts and
// depths — hence the state dict — are timm's.
#include "core/error.h"
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

namespace imgtrain::model_zoo {
namespace {

// ---- architecture tables --------------------------------------------------------------------
// Block strings: type (ds = depthwise separable, ir = inverted residual, cn = conv-bn-act),
// r repeats, k kernel, s stride of the first repeat, e expansion, c output channels, se
// squeeze-excite ratio, n activation override (re = ReLU).
using ArchDef = std::vector<std::vector<std::string>>;

const ArchDef kEfficientNet = {
    {"ds_r1_k3_s1_e1_c16_se0.25"},  {"ir_r2_k3_s2_e6_c24_se0.25"},  {"ir_r2_k5_s2_e6_c40_se0.25"},
    {"ir_r3_k3_s2_e6_c80_se0.25"},  {"ir_r3_k5_s1_e6_c112_se0.25"}, {"ir_r4_k5_s2_e6_c192_se0.25"},
    {"ir_r1_k3_s1_e6_c320_se0.25"},
};
const ArchDef kMobileNetV2 = {
    {"ds_r1_k3_s1_c16"},     {"ir_r2_k3_s2_e6_c24"},  {"ir_r3_k3_s2_e6_c32"}, {"ir_r4_k3_s2_e6_c64"},
    {"ir_r3_k3_s1_e6_c96"},  {"ir_r3_k3_s2_e6_c160"}, {"ir_r1_k3_s1_e6_c320"},
};
const ArchDef kMobileNetV3Large = {
    {"ds_r1_k3_s1_e1_c16_nre"},
    {"ir_r1_k3_s2_e4_c24_nre", "ir_r1_k3_s1_e3_c24_nre"},
    {"ir_r3_k5_s2_e3_c40_se0.25_nre"},
    {"ir_r1_k3_s2_e6_c80", "ir_r1_k3_s1_e2.5_c80", "ir_r2_k3_s1_e2.3_c80"},
    {"ir_r2_k3_s1_e6_c112_se0.25"},
    {"ir_r3_k5_s2_e6_c160_se0.25"},
    {"cn_r1_k1_s1_c960"},
};
const ArchDef kMobileNetV3Small = {
    {"ds_r1_k3_s2_e1_c16_se0.25_nre"},
    {"ir_r1_k3_s2_e4.5_c24_nre", "ir_r1_k3_s1_e3.67_c24_nre"},
    {"ir_r1_k5_s2_e4_c40_se0.25", "ir_r2_k5_s1_e6_c40_se0.25"},
    {"ir_r2_k5_s1_e3_c48_se0.25"},
    {"ir_r3_k5_s2_e6_c96_se0.25"},
    {"cn_r1_k1_s1_c576"},
};

enum class Family { EfficientNet, MobileNetV2, MobileNetV3 };

struct EffSpec {
  const char* name;
  Family family;
  const ArchDef* arch;
  double channel_mult;
  double depth_mult;
  bool tf = false;  // TensorFlow ports: 'same' padding and BatchNorm eps 1e-3
};

const std::vector<EffSpec>& specs() {
  static const std::vector<EffSpec> s = {
      {"efficientnet_b0", Family::EfficientNet, &kEfficientNet, 1.0, 1.0},
      {"efficientnet_b1", Family::EfficientNet, &kEfficientNet, 1.0, 1.1},
      {"efficientnet_b2", Family::EfficientNet, &kEfficientNet, 1.1, 1.2},
      {"efficientnet_b3", Family::EfficientNet, &kEfficientNet, 1.2, 1.4},
      {"efficientnet_b4", Family::EfficientNet, &kEfficientNet, 1.4, 1.8},
      {"tf_efficientnet_b0", Family::EfficientNet, &kEfficientNet, 1.0, 1.0, true},
      {"tf_efficientnet_b1", Family::EfficientNet, &kEfficientNet, 1.0, 1.1, true},
      {"tf_efficientnet_b2", Family::EfficientNet, &kEfficientNet, 1.1, 1.2, true},
      {"tf_efficientnet_b3", Family::EfficientNet, &kEfficientNet, 1.2, 1.4, true},
      {"tf_efficientnet_b4", Family::EfficientNet, &kEfficientNet, 1.4, 1.8, true},
      {"mobilenetv2_100", Family::MobileNetV2, &kMobileNetV2, 1.0, 1.0},
      {"mobilenetv3_large_100", Family::MobileNetV3, &kMobileNetV3Large, 1.0, 1.0},
      {"mobilenetv3_large_075", Family::MobileNetV3, &kMobileNetV3Large, 0.75, 1.0},
      {"mobilenetv3_small_100", Family::MobileNetV3, &kMobileNetV3Small, 1.0, 1.0},
  };
  return s;
}

// ---- block string decoding and depth scaling (timm's decode_arch_def) -----------------------
struct BlockArgs {
  std::string type;  // ds, ir, cn
  int64_t repeats = 1, kernel = 3, stride = 1, out = 0;
  double exp = 1.0, se = 0.0;
  std::optional<Act> act;
  bool noskip = false, skip = false;
};

BlockArgs decode_block(const std::string& str) {
  BlockArgs b;
  size_t pos = str.find('_');
  b.type = str.substr(0, pos);
  while (pos != std::string::npos) {
    size_t next = str.find('_', pos + 1);
    std::string op = str.substr(pos + 1, next == std::string::npos ? std::string::npos : next - pos - 1);
    pos = next;
    if (op == "noskip") b.noskip = true;
    else if (op == "skip") b.skip = true;
    else if (op[0] == 'n') {
      const std::string v = op.substr(1);
      if (v == "re") b.act = Act::ReLU;
      else if (v == "r6") b.act = Act::ReLU6;
      else if (v == "hs") b.act = Act::HardSwish;
      else if (v == "sw") b.act = Act::Swish;
    } else {
      const size_t d = op.find_first_of("0123456789");
      const std::string key = op.substr(0, d), val = op.substr(d);
      if (key == "r") b.repeats = std::stoll(val);
      else if (key == "k") b.kernel = std::stoll(val);
      else if (key == "s") b.stride = std::stoll(val);
      else if (key == "c") b.out = std::stoll(val);
      else if (key == "e") b.exp = std::stod(val);
      else if (key == "se") b.se = std::stod(val);
    }
  }
  if (b.type == "ds") b.exp = 1.0;  // ds blocks have no expansion (their SE ratio is not rescaled)
  return b;
}

// One stage's blocks, repeats scaled by depth_mult ('ceil'), distributed in reverse as timm does.
std::vector<BlockArgs> scale_stage(const std::vector<std::string>& strs, double depth_mult) {
  std::vector<BlockArgs> args;
  int64_t num_repeat = 0;
  for (auto& s : strs) {
    args.push_back(decode_block(s));
    num_repeat += args.back().repeats;
  }
  auto scaled = int64_t(std::ceil(double(num_repeat) * depth_mult));
  std::vector<int64_t> reps(args.size());
  for (size_t i = args.size(); i-- > 0;) {
    const int64_t r = args[i].repeats;
    const int64_t rs = std::max<int64_t>(1, py_round(double(r) / double(num_repeat) * double(scaled)));
    reps[i] = rs;
    num_repeat -= r;
    scaled -= rs;
  }
  std::vector<BlockArgs> out;
  for (size_t i = 0; i < args.size(); ++i)
    for (int64_t j = 0; j < reps[i]; ++j) out.push_back(args[i]);
  return out;
}

// ---- blocks ---------------------------------------------------------------------------------
using imgtrain::BatchNorm2d;

struct BlockCfg {  // what the builder resolves for every block
  int64_t in, out, stride;
  Act act;
  double drop_path;
  std::string pad;
  double bn_eps;
  int64_t se_channels = 0;  // 0 = no squeeze-excite
  Act se_act = Act::ReLU, se_gate = Act::Sigmoid;
};

BatchNorm2d bn(int64_t c, double eps) { return BatchNorm2d(torch::nn::BatchNormOptions(c).eps(eps)); }


// timm's DepthwiseSeparableConv: dw conv, BN + act, SE, pw conv, BN (no act), residual.
struct DepthwiseSeparableImpl : torch::nn::Module {
  Conv conv_dw{nullptr}, conv_pw{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr};
  SqueezeExcite se{nullptr};
  Act act;
  bool has_skip;
  double dpr;
  DepthwiseSeparableImpl(const BlockCfg& c, int64_t k, bool noskip)
      : act(c.act), has_skip(c.stride == 1 && c.in == c.out && !noskip), dpr(c.drop_path) {
    conv_dw = register_module("conv_dw", Conv(c.in, c.in, k, c.stride, c.in, false, c.pad));
    bn1 = register_module("bn1", bn(c.in, c.bn_eps));
    if (c.se_channels) se = register_module("se", SqueezeExcite(c.in, c.se_channels, c.se_act, c.se_gate));
    conv_pw = register_module("conv_pw", Conv(c.in, c.out, 1, 1, 1, false, c.pad));
    bn2 = register_module("bn2", bn(c.out, c.bn_eps));
  }
  at::Tensor forward(at::Tensor x) {
    auto shortcut = x;
    x = conv_bn_act(*conv_dw, *bn1, x, act);
    if (se) x = se(x);
    if (!has_skip) return conv_bn_act(*conv_pw, *bn2, x);
    if (dpr > 0 && is_training()) return drop_path(conv_bn_act(*conv_pw, *bn2, x), dpr, true).add_(shortcut);
    return conv_bn_act(*conv_pw, *bn2, x, Act::Identity, std::move(shortcut));
  }
};

// timm's InvertedResidual (MBConv): pw expansion, dw conv, SE, pw linear projection, residual.
struct InvertedResidualImpl : torch::nn::Module {
  Conv conv_pw{nullptr}, conv_dw{nullptr}, conv_pwl{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  SqueezeExcite se{nullptr};
  Act act;
  bool has_skip;
  double dpr;
  InvertedResidualImpl(const BlockCfg& c, int64_t mid, int64_t k, bool noskip)
      : act(c.act), has_skip(c.stride == 1 && c.in == c.out && !noskip), dpr(c.drop_path) {
    conv_pw = register_module("conv_pw", Conv(c.in, mid, 1, 1, 1, false, c.pad));
    bn1 = register_module("bn1", bn(mid, c.bn_eps));
    conv_dw = register_module("conv_dw", Conv(mid, mid, k, c.stride, mid, false, c.pad));
    bn2 = register_module("bn2", bn(mid, c.bn_eps));
    if (c.se_channels) se = register_module("se", SqueezeExcite(mid, c.se_channels, c.se_act, c.se_gate));
    conv_pwl = register_module("conv_pwl", Conv(mid, c.out, 1, 1, 1, false, c.pad));
    bn3 = register_module("bn3", bn(c.out, c.bn_eps));
  }
  at::Tensor forward(at::Tensor x) {
    auto shortcut = x;
    x = conv_bn_act(*conv_pw, *bn1, x, act);
    x = conv_bn_act(*conv_dw, *bn2, x, act);
    if (se) x = se(x);
    if (!has_skip) return conv_bn_act(*conv_pwl, *bn3, x);
    if (dpr > 0 && is_training()) return drop_path(conv_bn_act(*conv_pwl, *bn3, x), dpr, true).add_(shortcut);
    return conv_bn_act(*conv_pwl, *bn3, x, Act::Identity, std::move(shortcut));
  }
};

// ---- the model ------------------------------------------------------------------------------
class EfficientNetImpl : public ClassifierImpl, public InferenceFusion {
 public:
  EfficientNetImpl(const EffSpec& s, const ModelArgs& a)
      : family_(s.family), num_classes_(a.num_classes), drop_rate_(a.drop_rate) {
    pool_ = resolve_global_pool(s.name, a.global_pool, "avg", {"avg", "max", "avgmax", "catavgmax"}, a.global_pool_from);
    const bool mnv3 = s.family == Family::MobileNetV3;
    const std::string pad = s.tf ? "same" : "";
    const double eps = s.tf ? 1e-3 : 1e-5;
    act_ = s.family == Family::EfficientNet ? Act::Swish : s.family == Family::MobileNetV2 ? Act::ReLU6 : Act::HardSwish;
    auto round_chs = [&](double c) { return make_divisible(c * s.channel_mult, 8); };

    int64_t stem = mnv3 ? 16 : 32;
    if (!(mnv3 && s.channel_mult < 0.75)) stem = round_chs(double(stem));
    conv_stem_ = register_module("conv_stem", Conv(a.in_chans, stem, 3, 2, 1, false, pad));
    bn1_ = register_module("bn1", bn(stem, eps));

    // The builder (timm's EfficientNetBuilder with output_stride 32).
    std::vector<std::vector<BlockArgs>> stages;
    size_t total = 0;
    for (auto& strs : *s.arch) {
      stages.push_back(scale_stage(strs, s.depth_mult));
      total += stages.back().size();
    }
    int64_t in = stem, cur_stride = 2;
    size_t block_idx = 0;
    if (stages[0][0].stride > 1) feature_info_.push_back({in, cur_stride, "bn1"});
    blocks_ = register_module("blocks", torch::nn::ModuleList());
    for (size_t si = 0; si < stages.size(); ++si) {
      torch::nn::ModuleList seq;
      std::vector<std::function<at::Tensor(at::Tensor)>> stage;
      for (size_t bi = 0; bi < stages[si].size(); ++bi, ++block_idx) {
        const BlockArgs& b = stages[si][bi];
        BlockCfg c{in, round_chs(double(b.out)), bi == 0 ? b.stride : 1, b.act.value_or(act_),
                   a.drop_path_rate * double(block_idx) / double(total), pad, eps};
        cur_stride *= c.stride;
        const int64_t mid = b.type == "ir" ? make_divisible(double(in) * b.exp) : in;
        if (b.se > 0) {
          const int64_t se_in = b.type == "ir" ? mid : in;
          if (mnv3) {  // SE ratio of the expanded channels, rounded to 8, ReLU, hard-sigmoid gate
            c.se_channels = make_divisible(double(se_in) * b.se);
            c.se_act = Act::ReLU;
            c.se_gate = Act::HardSigmoid;
          } else {  // ratio of the block input: b.se / exp of the expanded channels, Python round
            c.se_channels = py_round(double(se_in) * (b.se / b.exp));
            c.se_act = c.act;
            c.se_gate = Act::Sigmoid;
          }
        }
        if (b.type == "ds") add(seq, stage, std::make_shared<DepthwiseSeparableImpl>(c, b.kernel, b.noskip));
        else if (b.type == "ir") add(seq, stage, std::make_shared<InvertedResidualImpl>(c, mid, b.kernel, b.noskip));
        else  // cn: timm's ConvBnAct block (MobileNetV3's last stage)
          add(seq, stage, std::make_shared<ConvBnActImpl>(c.in, c.out, b.kernel, c.stride, c.act, c.pad, c.bn_eps,
                                                          b.skip, c.drop_path));
        in = c.out;
      }
      blocks_->push_back(seq);
      stages_.push_back(std::move(stage));
      const bool last = si + 1 == stages.size();
      if (last || stages[si + 1][0].stride > 1) {
        stage_feature_.push_back(int64_t(feature_info_.size()));
        feature_info_.push_back({in, cur_stride, "blocks." + std::to_string(si)});
      } else {
        stage_feature_.push_back(-1);
      }
    }

    if (mnv3) {  // pool, then a 1x1 conv with bias and the activation, then the classifier
      num_features_ = in;
      head_hidden_ = s.arch == &kMobileNetV3Small ? 1024 : 1280;
      conv_head_ = register_module("conv_head", Conv(in * pool_feat_mult(pool_), head_hidden_, 1, 1, 1, true, pad));
    } else {
      head_hidden_ = s.family == Family::MobileNetV2 ? std::max<int64_t>(1280, round_chs(1280)) : round_chs(1280);
      conv_head_ = register_module("conv_head", Conv(in, head_hidden_, 1, 1, 1, false, pad));
      bn2_ = register_module("bn2", bn(head_hidden_, eps));
      num_features_ = head_hidden_;
    }
    const int64_t cls_in = mnv3 ? head_hidden_ : head_hidden_ * pool_feat_mult(pool_);
    if (num_classes_ > 0) classifier_ = register_module("classifier", torch::nn::Linear(cls_in, num_classes_));
    init_weights_goog(*this);
  }

  at::Tensor forward_features(const at::Tensor& in) override {
    auto x = conv_bn_act(*conv_stem_, *bn1_, in, act_);
    for (auto& stage : stages_)
      for (auto& b : stage) x = b(std::move(x));  // handed over: a block may sum into it (conv_bn_act)
    if (bn2_) x = conv_bn_act(*conv_head_, *bn2_, x, act_);
    return x;
  }
  at::Tensor forward_head(const at::Tensor& in, bool pre_logits) override {
    at::Tensor x;
    if (family_ == Family::MobileNetV3) {
      // inference fusion: the head's 1x1 convolution of the pooled map as a GEMM
      if (fuse_infer && !is_training()) x = pooled_conv1x1(*conv_head_, global_pool(in, pool_));
      x = x.defined() ? apply_act(x, act_, true)
                      : apply_act(conv_head_(global_pool(in, pool_, /*keepdim=*/true)), act_, true).flatten(1);
    } else
      x = global_pool(in, pool_);
    if (drop_rate_ > 0) x = torch::dropout(x, drop_rate_, is_training());
    if (pre_logits || !classifier_) return x;
    return classifier_(x);
  }
  int64_t num_classes() const override { return num_classes_; }
  int64_t num_features() const override { return num_features_; }
  std::vector<FeatureInfo> feature_info() const override { return feature_info_; }
  std::vector<GroupRule> group_matcher() const override {
    if (family_ == Family::MobileNetV3) return {{0, "^conv_stem|bn1", {}}, {1, R"(^blocks\.(\d+)\.(\d+))", {}}};
    return {{0, "^conv_stem|bn1", {}}, {1, R"(^blocks\.(\d+)\.(\d+))", {}}, {1, "conv_head|bn2", {99999}}};
  }
  std::vector<at::Tensor> forward_intermediates(const at::Tensor& in, const std::vector<int64_t>& indices) override {
    auto want = [&](int64_t level) { return std::find(indices.begin(), indices.end(), level) != indices.end(); };
    const int64_t last = indices.empty() ? -1 : *std::max_element(indices.begin(), indices.end());
    std::vector<at::Tensor> out;
    auto x = conv_bn_act(*conv_stem_, *bn1_, in, act_);
    if (feature_info_[0].module == "bn1" && want(0)) out.push_back(x);
    for (size_t si = 0; si < stages_.size(); ++si) {
      for (auto& b : stages_[si]) x = b(std::move(x));
      const int64_t level = stage_feature_[si];
      if (level >= 0 && want(level)) out.push_back(x);
      if (level >= last) break;
    }
    return out;
  }

 private:
  template <typename B>
  static void add(torch::nn::ModuleList& list, std::vector<std::function<at::Tensor(at::Tensor)>>& fns,
                  std::shared_ptr<B> blk) {
    list->push_back(blk);
    fns.push_back([blk](at::Tensor x) { return blk->forward(std::move(x)); });
  }

  Family family_;
  int64_t num_classes_, num_features_ = 0, head_hidden_ = 0;
  double drop_rate_;
  std::string pool_;
  Act act_;
  Conv conv_stem_{nullptr}, conv_head_{nullptr};
  BatchNorm2d bn1_{nullptr}, bn2_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  std::vector<std::vector<std::function<at::Tensor(at::Tensor)>>> stages_;  // each block's forward
  torch::nn::Linear classifier_{nullptr};
  std::vector<FeatureInfo> feature_info_;
  std::vector<int64_t> stage_feature_;  // feature level ending at each stage, -1 if none
};

}  // namespace

void register_efficientnet(Registry<ModelEntry>& r) {
  for (auto& s : specs()) {
    ModelEntry e{[&s](const ModelArgs& a) -> Model { return std::make_shared<EfficientNetImpl>(s, a); },
                 timm_defaults(s.name)};
    e.cpu_training_nhwc_fused = true;
    r.add(s.name, std::move(e));
  }
}

}  // namespace imgtrain::model_zoo
