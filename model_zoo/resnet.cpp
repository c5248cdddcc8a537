// ResNet family as timm builds it (timm/models/resnet.py): same module names, so
// named_parameters() and named_buffers() are timm's state dict.
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"

#include <algorithm>
#include <cmath>

namespace imgtrain::model_zoo {
namespace {

// ---- architecture table -------------------------------------------------------------------
struct ResNetSpec {
  const char* name;
  bool bottleneck;
  std::array<int, 4> layers;
  int cardinality = 1;
  int base_width = 64;
  bool deep_stem = false;  // timm stem_type='deep' with stem_width 32: three 3x3 convs
  bool avg_down = false;   // shortcut downsampling by 2x2 average pooling, then a 1x1 conv
};

const std::vector<ResNetSpec>& specs() {
  static const std::vector<ResNetSpec> s = {
      {"resnet18", false, {2, 2, 2, 2}, 1, 64, false, false},
      {"resnet34", false, {3, 4, 6, 3}, 1, 64, false, false},
      {"resnet50", true, {3, 4, 6, 3}, 1, 64, false, false},
      {"resnet101", true, {3, 4, 23, 3}, 1, 64, false, false},
      {"resnet152", true, {3, 8, 36, 3}, 1, 64, false, false},
      {"resnext50_32x4d", true, {3, 4, 6, 3}, 32, 4, false, false},
      {"resnet50d", true, {3, 4, 6, 3}, 1, 64, true, true},
      {"resnet26d", true, {2, 2, 2, 2}, 1, 64, true, true},
  };
  return s;
}

// ---- blocks -----------------------------------------------------------------------------
using imgtrain::BatchNorm2d;
using torch::nn::Conv2d;
using torch::nn::Conv2dOptions;

Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t pad = 0) {
  return Conv2d(Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
}

// timm's downsample (conv, norm; or pool / identity, conv, norm) through conv_bn_act, so that it
// fuses with the rest; x itself without one.
at::Tensor forward_downsample(const torch::nn::Sequential& ds, const at::Tensor& x) {
  if (!ds) return x;
  const size_t n = ds->size();
  auto in = x;
  if (auto* pool = n == 3 ? ds->ptr(0)->as<torch::nn::AvgPool2dImpl>() : nullptr) in = pool->forward(x);
  return conv_bn_act(*ds->ptr(n - 2)->as<torch::nn::Conv2dImpl>(), *ds->ptr(n - 1)->as<imgtrain::BatchNorm2dImpl>(), in);
}

struct BlockImpl : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor x) = 0;
  virtual void zero_init_last() = 0;
};

struct BasicBlockImpl : BlockImpl {
  static constexpr int64_t expansion = 1;
  Conv2d conv1{nullptr}, conv2{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};
  double drop_path_rate;

  BasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride, torch::nn::Sequential ds, double dpr)
      : drop_path_rate(dpr) {
    conv1 = register_module("conv1", conv(inplanes, planes, 3, stride, 1));
    bn1 = register_module("bn1", BatchNorm2d(planes));
    conv2 = register_module("conv2", conv(planes, planes, 3, 1, 1));
    bn2 = register_module("bn2", BatchNorm2d(planes));
    if (ds) downsample = register_module("downsample", ds);
  }
  at::Tensor forward(at::Tensor x) override {
    auto shortcut = forward_downsample(downsample, x);
    x = conv_bn_act(*conv1, *bn1, x, Act::ReLU);  // ReLU in place, as timm's act layers (inplace=True)
    if (drop_path_rate > 0 && is_training()) {
      x = drop_path(conv_bn_act(*conv2, *bn2, x), drop_path_rate, true);
      return x.add_(shortcut).relu_();
    }
    return conv_bn_act(*conv2, *bn2, x, Act::ReLU, std::move(shortcut));
  }
  void zero_init_last() override { torch::nn::init::zeros_(bn2->weight); }
};

struct BottleneckImpl : BlockImpl {
  static constexpr int64_t expansion = 4;
  Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};
  double drop_path_rate;

  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride, torch::nn::Sequential ds, double dpr,
                 int cardinality, int base_width)
      : drop_path_rate(dpr) {
    const int64_t width = int64_t(std::floor(double(planes) * base_width / 64.0)) * cardinality;
    conv1 = register_module("conv1", conv(inplanes, width, 1));
    bn1 = register_module("bn1", BatchNorm2d(width));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(width, width, 3).stride(stride).padding(1).groups(cardinality).bias(false)));
    bn2 = register_module("bn2", BatchNorm2d(width));
    conv3 = register_module("conv3", conv(width, planes * expansion, 1));
    bn3 = register_module("bn3", BatchNorm2d(planes * expansion));
    if (ds) downsample = register_module("downsample", ds);
  }
  at::Tensor forward(at::Tensor x) override {
    auto shortcut = forward_downsample(downsample, x);
    x = conv_bn_act(*conv1, *bn1, x, Act::ReLU);
    x = conv_bn_act(*conv2, *bn2, x, Act::ReLU);
    if (drop_path_rate > 0 && is_training()) {
      x = drop_path(conv_bn_act(*conv3, *bn3, x), drop_path_rate, true);
      return x.add_(shortcut).relu_();
    }
    return conv_bn_act(*conv3, *bn3, x, Act::ReLU, std::move(shortcut));
  }
  void zero_init_last() override { torch::nn::init::zeros_(bn3->weight); }
};


class ResNetImpl : public ClassifierImpl {
 public:
  ResNetImpl(const ResNetSpec& spec, const ModelArgs& a) : num_classes_(a.num_classes), drop_rate_(a.drop_rate) {
    pool_ = resolve_global_pool(spec.name, a.global_pool, "avg", {"avg", "max", "avgmax", "catavgmax"}, a.global_pool_from);
    const int64_t stem_width = 32;
    int64_t inplanes = spec.deep_stem ? stem_width * 2 : 64;
    if (spec.deep_stem) {
      torch::nn::Sequential stem;
      stem->push_back("0", conv(a.in_chans, stem_width, 3, 2, 1));
      stem->push_back("1", BatchNorm2d(stem_width));
      stem->push_back("2", torch::nn::ReLU());
      stem->push_back("3", conv(stem_width, stem_width, 3, 1, 1));
      stem->push_back("4", BatchNorm2d(stem_width));
      stem->push_back("5", torch::nn::ReLU());
      stem->push_back("6", conv(stem_width, inplanes, 3, 1, 1));
      stem_ = register_module("conv1", stem);
    } else {
      conv1_ = register_module("conv1", conv(a.in_chans, inplanes, 7, 2, 3));
    }
    bn1_ = register_module("bn1", BatchNorm2d(inplanes));
    feature_info_.push_back({inplanes, 2, "act1"});
    const int64_t expansion = spec.bottleneck ? 4 : 1;
    int total = 0;
    for (int n : spec.layers) total += n;
    int block_idx = 0;
    for (int stage = 0; stage < 4; ++stage) {
      int64_t planes = int64_t(64) << stage;
      int64_t stride = stage == 0 ? 1 : 2;
      torch::nn::Sequential seq;
      for (int b = 0; b < spec.layers[stage]; ++b, ++block_idx) {
        int64_t s = b == 0 ? stride : 1;
        torch::nn::Sequential ds{nullptr};
        if (b == 0 && (s != 1 || inplanes != planes * expansion)) {
          ds = torch::nn::Sequential();
          if (spec.avg_down) {  // timm downsample_avg: pool (or identity), 1x1 conv, norm
            if (s != 1)
              ds->push_back("0", torch::nn::AvgPool2d(
                                     torch::nn::AvgPool2dOptions(2).stride(s).ceil_mode(true).count_include_pad(false)));
            else
              ds->push_back("0", torch::nn::Identity());
            ds->push_back("1", conv(inplanes, planes * expansion, 1, 1, 0));
            ds->push_back("2", BatchNorm2d(planes * expansion));
          } else {
            ds->push_back("0", conv(inplanes, planes * expansion, 1, s, 0));
            ds->push_back("1", BatchNorm2d(planes * expansion));
          }
        }
        double dpr = total > 1 ? a.drop_path_rate * block_idx / (total - 1) : 0.0;
        std::shared_ptr<BlockImpl> blk;
        if (spec.bottleneck)
          blk = std::make_shared<BottleneckImpl>(inplanes, planes, s, ds, dpr, spec.cardinality, spec.base_width);
        else
          blk = std::make_shared<BasicBlockImpl>(inplanes, planes, s, ds, dpr);
        seq->push_back(std::to_string(b), torch::nn::AnyModule(blk));
        blocks_.push_back(blk);
        inplanes = planes * expansion;
      }
      stages_.push_back(register_module("layer" + std::to_string(stage + 1), seq));
      feature_info_.push_back({inplanes, int64_t(4) << stage, "layer" + std::to_string(stage + 1)});
    }
    num_features_ = inplanes;
    if (num_classes_ > 0)
      fc_ = register_module("fc", torch::nn::Linear(num_features_ * pool_feat_mult(pool_), num_classes_));
    init_weights();
  }

  at::Tensor stem(const at::Tensor& in) {
    if (!stem_) return conv_bn_act(*conv1_, *bn1_, in, Act::ReLU);
    // the deep stem (conv, bn, relu, conv, bn, relu, conv) and bn1
    auto conv_at = [&](size_t i) -> torch::nn::Conv2dImpl& { return *stem_->ptr(i)->as<torch::nn::Conv2dImpl>(); };
    auto bn_at = [&](size_t i) -> imgtrain::BatchNorm2dImpl& { return *stem_->ptr(i)->as<imgtrain::BatchNorm2dImpl>(); };
    auto x = conv_bn_act(conv_at(0), bn_at(1), in, Act::ReLU);
    x = conv_bn_act(conv_at(3), bn_at(4), x, Act::ReLU);
    return conv_bn_act(conv_at(6), *bn1_, x, Act::ReLU);
  }
  at::Tensor forward_features(const at::Tensor& in) override {
    auto x = stem(in);
    x = torch::max_pool2d(x, 3, 2, 1);
    for (auto& s : stages_) x = s->forward(std::move(x));  // handed over: a block may sum into it
    return x;
  }
  std::vector<FeatureInfo> feature_info() const override { return feature_info_; }
  std::vector<GroupRule> group_matcher() const override {
    return {{0, "^conv1|bn1|maxpool", {}}, {1, R"(^layer(\d+)\.(\d+))", {}}};
  }
  std::vector<at::Tensor> forward_intermediates(const at::Tensor& in, const std::vector<int64_t>& indices) override {
    std::vector<at::Tensor> out;
    auto want = [&](int64_t level) { return std::find(indices.begin(), indices.end(), level) != indices.end(); };
    const int64_t last = indices.empty() ? -1 : *std::max_element(indices.begin(), indices.end());
    auto x = stem(in);
    if (want(0)) out.push_back(x);
    x = torch::max_pool2d(x, 3, 2, 1);
    for (int64_t i = 0; i < int64_t(stages_.size()) && i + 1 <= last; ++i) {
      x = stages_[i]->forward(std::move(x));
      if (want(i + 1)) out.push_back(x);
    }
    return out;
  }
  at::Tensor forward_head(const at::Tensor& in, bool pre_logits) override {
    auto x = global_pool(in, pool_);
    if (drop_rate_ > 0) x = torch::dropout(x, drop_rate_, is_training());
    if (pre_logits || !fc_) return x;
    return fc_(x);
  }
  int64_t num_classes() const override { return num_classes_; }
  int64_t num_features() const override { return num_features_; }

 private:
  void init_weights() {
    torch::NoGradGuard ng;
    for (auto& m : modules(/*include_self=*/false))
      if (auto* c = m->as<torch::nn::Conv2d>())
        torch::nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
    for (auto& b : blocks_) b->zero_init_last();
  }

  int64_t num_classes_, num_features_ = 0;
  double drop_rate_;
  std::string pool_;
  Conv2d conv1_{nullptr};
  torch::nn::Sequential stem_{nullptr};
  BatchNorm2d bn1_{nullptr};
  std::vector<torch::nn::Sequential> stages_;
  std::vector<std::shared_ptr<BlockImpl>> blocks_;
  torch::nn::Linear fc_{nullptr};
  std::vector<FeatureInfo> feature_info_;
};

}  // namespace

void register_resnet(Registry<ModelEntry>& r) {
  for (auto& spec : specs()) {
    ModelEntry e{[&spec](const ModelArgs& a) -> Model { return std::make_shared<ResNetImpl>(spec, a); },
                 timm_defaults(spec.name)};
    e.cpu_training_nhwc_fused = true;
    r.add(spec.name, std::move(e));
  }
}

}  // namespace imgtrain::model_zoo
