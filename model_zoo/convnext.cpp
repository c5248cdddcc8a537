// ConvNeXt as timm builds it (timm/models/convnext.py: patch stem, LayerNorm, channels-last MLP,
// layer scale, NormMlpClassifierHead): same module names, so named_parameters() is timm's state dict.
#include "core/error.h"
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"
#include "ops/mlp.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <utility>

namespace imgtrain::model_zoo {
namespace {

// ---- architecture table ---------------------------------------------------------------------
struct ConvNeXtSpec {
  const char* name;
  std::array<int64_t, 4> depths;
  std::array<int64_t, 4> dims;
};

const std::vector<ConvNeXtSpec>& specs() {
  static const std::vector<ConvNeXtSpec> s = {
      {"convnext_tiny", {3, 3, 9, 3}, {96, 192, 384, 768}},
      {"convnext_small", {3, 3, 27, 3}, {96, 192, 384, 768}},
  };
  return s;
}

// ---- blocks ---------------------------------------------------------------------------------
using torch::nn::Linear;

// 7x7 depthwise conv, LayerNorm and the MLP over channels (NHWC), layer scale `gamma`, residual.
struct ConvNeXtBlockImpl : torch::nn::Module, InferenceFusion, TrainingFusion {
  torch::nn::Conv2d conv_dw{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  std::shared_ptr<torch::nn::Module> mlp;
  Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor gamma;
  double dpr;
  ConvNeXtBlockImpl(int64_t dim, double drop_path_rate, double ls_init) : dpr(drop_path_rate) {
    conv_dw = register_module("conv_dw",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(dim, dim, 7).padding(3).groups(dim)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-6)));
    mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
    fc1 = mlp->register_module("fc1", Linear(dim, 4 * dim));
    fc2 = mlp->register_module("fc2", Linear(4 * dim, dim));
    gamma = register_parameter("gamma", torch::full({dim}, ls_init));
  }
  at::Tensor forward(const at::Tensor& in) {
    auto x = depthwise(in).permute({0, 2, 3, 1});
    if (fuse_infer && !is_training() && linear_fusable(x)) {  // eval: GELU as fc1's post-op, gamma in fc2
      fold_gamma();
      if (tiles_pay(x)) return mlp_tiled(x, in);
      auto h = linear_act(norm(x), fc1->weight, fc1->bias, Act::GELU, &fc1_pack);
      // the residual as NHWC: channels-last memory is read in place, the add a post-op of fc2
      const auto res = in.permute({0, 2, 3, 1});
      if (res.is_contiguous())
        return linear_add(h, fc2_folded_w, fc2_folded_b, res, &fc2_pack).permute({0, 3, 1, 2});
      return at::linear(h, fc2_folded_w, fc2_folded_b).permute({0, 3, 1, 2}) + in;
    }
    if (fuse_train && is_training() && at::GradMode::is_enabled() && ops::ln_mlp_tiled_train_supported(x) &&
        tiles_pay(x)) {
      const auto scale = drop_path_scale(in, dpr, true);
      return ops::ln_mlp_residual_tiled_train(x, norm->weight, norm->bias, norm->options.eps(), fc1->weight,
                                              fc1->bias, fc2->weight, fc2->bias, gamma,
                                              scale.defined() ? scale.reshape({-1}) : scale,
                                              in.permute({0, 2, 3, 1}), tile_rows(x.size(3)))
          .permute({0, 3, 1, 2});
    }
    x = linear(*fc2, torch::gelu(linear(*fc1, norm(x)))).permute({0, 3, 1, 2});
    x = x.mul(gamma.reshape({1, -1, 1, 1}));
    return drop_path(x, dpr, is_training()) + in;
  }

  // Inference (and training with --fuse-bn, ops::ln_mlp_residual_tiled_train, whose backward runs
  // on the same tiles): LayerNorm, fc1, GELU, fc2 (gamma folded in) and the residual add on tiles of pixels
  // (ops::ln_mlp_residual_tiled), so fc1's output, 4x the channels, stays in cache: where the MLP's
  // weights are small against the activations (the first two stages: 0.3 and 1.2 MB of weights
  // against 38 and 19 MB of fc1 output at batch 8, 224 px); elsewhere each tile would read the
  // weights again. Tiles of 32K to 1M floats of fc1 output measured alike (ConvNeXt-T, batch 8).
  static constexpr int64_t kTileFloats = 262144;  // fc1's output per tile: 1 MB
  bool tiles_pay(const at::Tensor& x) const {
    const int64_t C = x.size(3), pixels = x.size(1) * x.size(2);
    return x.scalar_type() == at::kFloat && 8 * C * C * 4 <= (2 << 20) && pixels >= 2 * tile_rows(C);
  }
  static int64_t tile_rows(int64_t C) { return std::max<int64_t>(16, kTileFloats / (4 * C)); }
  at::Tensor mlp_tiled(const at::Tensor& x, const at::Tensor& in) {
    return ops::ln_mlp_residual_tiled(x, norm->weight, norm->bias, norm->options.eps(), fc1->weight, fc1->bias,
                                      fc2_folded_w, fc2_folded_b, in.permute({0, 2, 3, 1}), tile_rows(x.size(3)))
        .permute({0, 3, 1, 2});
  }

  // The 7x7 depthwise convolution, in training through imgtrain's weight gradient (depthwise_train)
  at::Tensor depthwise(const at::Tensor& in) {
    auto y = depthwise_train(*conv_dw, in);
    return y.defined() ? y : conv_dw(in);
  }

  // fc2's weight and bias times gamma, made again only when one of the three changed (an optimizer
  // step or a load between evaluations moves their version counters)
  at::Tensor fc2_folded_w, fc2_folded_b;
  LinearPack fc1_pack, fc2_pack;
  std::array<TensorStamp, 3> folded_from;  // fc2.weight, fc2.bias, gamma
  void fold_gamma() {
    const std::array<const at::Tensor*, 3> now = {&fc2->weight, &fc2->bias, &gamma};
    bool same = fc2_folded_w.defined();
    for (size_t i = 0; i < now.size(); ++i) same = same && folded_from[i].matches(*now[i]);
    if (same) return;
    at::NoGradGuard no_grad;
    fc2_folded_w = fc2->weight * gamma.unsqueeze(1);
    fc2_folded_b = fc2->bias * gamma;
    for (size_t i = 0; i < now.size(); ++i) folded_from[i].take(*now[i]);
  }
};
TORCH_MODULE(ConvNeXtBlock);

class ConvNeXtImpl : public ClassifierImpl, public InferenceFusion {
 public:
  ConvNeXtImpl(const ConvNeXtSpec& s, const ModelArgs& a)
      : name_(s.name), num_classes_(a.num_classes), drop_rate_(a.drop_rate) {
    if (a.img_size > 0 && a.img_size < kMinSize)
      throw UserError(fmt::format("--img-size {}: {} needs at least {} px {}", a.img_size, s.name, kMinSize, kMinSizeWhy));
    // timm's NormMlpClassifierHead normalises num_features channels, so no catavgmax
    pool_ = resolve_global_pool(s.name, a.global_pool, "avg", {"avg", "max", "avgmax"}, a.global_pool_from);
    stem_ = register_module("stem", torch::nn::Sequential());
    stem_->push_back("0", torch::nn::Conv2d(torch::nn::Conv2dOptions(a.in_chans, s.dims[0], 4).stride(4)));
    stem_->push_back("1", LayerNorm2d(s.dims[0]));
    // drop path: linspace(0, rate, total depth), split by stage (timm's stagewise rates)
    int64_t total = 0;
    for (auto d : s.depths) total += d;
    auto rates = torch::linspace(0.0, a.drop_path_rate, total, torch::kFloat64);
    stages_ = register_module("stages", torch::nn::ModuleList());
    int64_t idx = 0, stride = 4;
    for (int i = 0; i < 4; ++i) {
      auto stage = std::make_shared<torch::nn::Module>();
      if (i > 0) {  // LayerNorm2d then a 2x2 stride-2 conv
        auto ds = torch::nn::Sequential();
        ds->push_back("0", LayerNorm2d(s.dims[i - 1]));
        ds->push_back("1", torch::nn::Conv2d(torch::nn::Conv2dOptions(s.dims[i - 1], s.dims[i], 2).stride(2)));
        stage->register_module("downsample", ds);
        downsample_.push_back(ds);
        stride *= 2;
      } else {
        downsample_.push_back(nullptr);
      }
      auto blocks = torch::nn::ModuleList();
      std::vector<ConvNeXtBlock> bl;
      for (int64_t j = 0; j < s.depths[i]; ++j, ++idx) {
        bl.push_back(ConvNeXtBlock(s.dims[i], rates[idx].item<double>(), 1e-6));
        blocks->push_back(bl.back());
      }
      stage->register_module("blocks", blocks);
      stages_->push_back(stage);
      blocks_.push_back(std::move(bl));
      feature_info_.push_back({s.dims[i], stride, "stages." + std::to_string(i)});
    }
    num_features_ = s.dims[3];
    head_ = register_module("head", std::make_shared<torch::nn::Module>());
    head_norm_ = head_->register_module("norm", LayerNorm2d(num_features_));
    if (num_classes_ > 0) head_fc_ = head_->register_module("fc", Linear(num_features_, num_classes_));
    init_weights();
  }

  at::Tensor forward_features(const at::Tensor& in) override {
    if (in.dim() == 4 && (in.size(2) < kMinSize || in.size(3) < kMinSize))
      throw UserError(fmt::format("input {}x{}: {} needs at least {}x{} pixels {}", in.size(2), in.size(3), name_,
                                  kMinSize, kMinSize, kMinSizeWhy));
    auto x = stem(in);
    for (size_t i = 0; i < blocks_.size(); ++i) x = run_stage(i, x);
    return x;
  }
  // timm's NormMlpClassifierHead: average pool, LayerNorm2d, flatten, dropout, fc.
  at::Tensor forward_head(const at::Tensor& in, bool pre_logits) override {
    auto x = head_norm_(global_pool(in, pool_, /*keepdim=*/true)).flatten(1);
    if (drop_rate_ > 0) x = torch::dropout(x, drop_rate_, is_training());
    if (pre_logits || !head_fc_) return x;
    return head_fc_(x);
  }
  int64_t num_classes() const override { return num_classes_; }
  int64_t num_features() const override { return num_features_; }
  std::vector<FeatureInfo> feature_info() const override { return feature_info_; }
  std::vector<GroupRule> group_matcher() const override {
    return {{0, "^stem", {}},
            {1, R"(^stages\.(\d+)\.downsample)", {0}},
            {1, R"(^stages\.(\d+)\.blocks\.(\d+))", {}},
            {1, "^norm_pre", {99999}}};
  }
  std::vector<at::Tensor> forward_intermediates(const at::Tensor& in, const std::vector<int64_t>& indices) override {
    std::vector<at::Tensor> out;
    const int64_t last = indices.empty() ? -1 : *std::max_element(indices.begin(), indices.end());
    auto x = stem(in);
    for (int64_t i = 0; i <= last; ++i) {
      x = run_stage(size_t(i), x);
      if (std::find(indices.begin(), indices.end(), i) != indices.end()) out.push_back(x);
    }
    return out;
  }

 private:
  // Inference fusion: the stem's 4x4 and the downsampling's 2x2 convolutions (kernel = stride) as
  // linears over patches (patch_conv_linear), whose output is channels-last for the LayerNorm2d
  // and depthwise convolution after them.
  at::Tensor stem(const at::Tensor& in) {  // conv, LayerNorm2d
    const bool fuse = fuse_infer && !is_training();
    return stem_[1]->as<LayerNorm2dImpl>()->forward(
        patch_conv(*stem_[0]->as<torch::nn::Conv2dImpl>(), in, &patch_cache_[0], fuse));
  }
  at::Tensor run_stage(size_t i, at::Tensor x) {
    if (auto& ds = downsample_[i]) {  // LayerNorm2d, conv
      const bool fuse = fuse_infer && !is_training();
      x = patch_conv(*ds[1]->as<torch::nn::Conv2dImpl>(), ds[0]->as<LayerNorm2dImpl>()->forward(x), &patch_cache_[i],
                     fuse);
    }
    for (auto& b : blocks_[i]) x = b(x);
    return x;
  }
  void init_weights() {  // timm's _init_weights: trunc_normal(.02) for convs and linears, zero biases
    torch::NoGradGuard ng;
    for (auto& m : modules(false)) {
      if (auto* c = m->as<torch::nn::Conv2dImpl>()) {
        trunc_normal_(c->weight, 0.0, 0.02, -2.0, 2.0);
        if (c->bias.defined()) c->bias.zero_();
      } else if (auto* l = m->as<torch::nn::LinearImpl>()) {
        trunc_normal_(l->weight, 0.0, 0.02, -2.0, 2.0);
        l->bias.zero_();
      }
    }
  }

  static constexpr int64_t kMinSize = 32;  // the smallest input side that leaves the last stage a pixel
  static constexpr const char* kMinSizeWhy = "(its 4x4 stem and three 2x2 downsamplings, none padded, divide the size by 32)";
  std::string name_;
  int64_t num_classes_, num_features_ = 0;
  double drop_rate_;
  std::string pool_;
  torch::nn::Sequential stem_{nullptr};
  torch::nn::ModuleList stages_{nullptr};
  std::shared_ptr<torch::nn::Module> head_;
  std::vector<torch::nn::Sequential> downsample_;
  std::array<PatchLinearCache, 4> patch_cache_;  // the stem's ([0]) and stage i's downsampling ([i])
  std::vector<std::vector<ConvNeXtBlock>> blocks_;
  LayerNorm2d head_norm_{nullptr};
  Linear head_fc_{nullptr};
  std::vector<FeatureInfo> feature_info_;
};

}  // namespace

void register_convnext(Registry<ModelEntry>& r) {
  for (auto& s : specs()) {
    ModelEntry e{[&s](const ModelArgs& a) -> Model { return std::make_shared<ConvNeXtImpl>(s, a); },
                 timm_defaults(s.name)};
    e.cpu_training_fused = "fused kernels (LayerNorm and MLP on tiles)";  // docs/performance.md
    r.add(s.name, std::move(e));
  }
}

}  // namespace imgtrain::model_zoo
