// Vision Transformer as timm builds it (timm/models/vision_transformer.py, class-token pooling,
// pre-norm blocks): same module names, so named_parameters() is timm's state dict.
#include "core/error.h"
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"
#include "ops/attention.h"

#include <algorithm>
#include <cmath>

namespace imgtrain::model_zoo {
namespace {

// ---- architecture table -------------------------------------------------------------------
struct VitSpec {
  const char* name;
  int64_t patch;
  int64_t dim;
  int64_t depth;
  int64_t heads;
};

const std::vector<VitSpec>& specs() {
  static const std::vector<VitSpec> s = {
      {"vit_tiny_patch16_224", 16, 192, 12, 3},
      {"vit_small_patch16_224", 16, 384, 12, 6},
      {"vit_base_patch16_224", 16, 768, 12, 12},
      {"vit_base_patch32_224", 32, 768, 12, 12},
  };
  return s;
}

// ---- blocks -------------------------------------------------------------------------------
using torch::nn::LayerNorm;
using torch::nn::LayerNormOptions;
using torch::nn::Linear;

struct AttentionImpl : torch::nn::Module, TrainingFusion {
  Linear qkv{nullptr}, proj{nullptr};
  int64_t heads;
  AttentionImpl(int64_t dim, int64_t heads_) : heads(heads_) {
    qkv = register_module("qkv", Linear(dim, dim * 3));
    proj = register_module("proj", Linear(dim, dim));
  }
  // residual defined (inference fusion, no autograd): qkv through oneDNN with its packed weight (the
  // bias inside the call: addmm copies it into the output first), imgtrain's attention kernel over
  // qkv's output where the CPU has AVX-512 (ops/attention.h), and proj(o) + residual as one call
  at::Tensor forward(const at::Tensor& x, const at::Tensor& residual = {}) {
    const int64_t b = x.size(0), n = x.size(1), c = x.size(2);
    const bool fused = residual.defined();
    auto t = fused ? linear_act(x, qkv->weight, qkv->bias, Act::Identity, &qkv_pack) : linear(*qkv, x);
    at::Tensor o;
    if (fused && ops::attention_infer_supported(t, heads)) {
      o = ops::attention_infer(t, heads);
    } else if (fuse_train && is_training() && at::GradMode::is_enabled() && ops::attention_train_supported(t, heads)) {
      o = ops::attention_train(t, heads);  // training fusion: the same kernels with their backward
    } else {
      // unbind, not three selects: its backward stacks the three gradients into one tensor, where
      // each select's backward zero-fills a full-size gradient, copies into it and adds the three up
      const auto parts = t.reshape({b, n, 3, heads, c / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
      o = at::scaled_dot_product_attention(parts[0], parts[1], parts[2]).transpose(1, 2).reshape({b, n, c});
    }
    return project(o, residual);
  }
  // The class token's row of forward(x) (+ residual, the class token's input row, when defined:
  // inference fusion): keys and values for every token, the query for the class token alone.
  at::Tensor forward_cls(const at::Tensor& x, const at::Tensor& residual = {}) {
    const int64_t b = x.size(0), n = x.size(1), c = x.size(2), d = c / heads;
    const bool fused = residual.defined();
    const auto &w = qkv->weight, &bias = qkv->bias;
    const auto q = at::linear(x.narrow(1, 0, 1), w.narrow(0, 0, c), bias.narrow(0, 0, c)).view({b, 1, heads, d});
    at::Tensor kv;
    if (fused) {
      if (!kv_from.matches(w)) {  // kv_pack is kept while it sees the same tensor: one view until qkv changes
        kv_weight = w.detach().narrow(0, c, 2 * c).contiguous();
        kv_from.take(w);
      }
      kv = linear_act(x, kv_weight, bias.narrow(0, c, 2 * c), Act::Identity, &kv_pack);
    } else {
      kv = at::linear(x, w.narrow(0, c, 2 * c), bias.narrow(0, c, 2 * c));
    }
    const auto parts = kv.reshape({b, n, 2, heads, d}).permute({2, 0, 3, 1, 4}).unbind(0);
    const auto o = at::scaled_dot_product_attention(q.transpose(1, 2), parts[0], parts[1]).transpose(1, 2).reshape({b, 1, c});
    return project(o, residual);
  }
  at::Tensor project(const at::Tensor& o, const at::Tensor& residual) {  // proj(o) (+ residual: fused, one call)
    return residual.defined() ? linear_add(o, proj->weight, proj->bias, residual, &proj_pack) : linear(*proj, o);
  }
  LinearPack proj_pack, qkv_pack, kv_pack;
  at::Tensor kv_weight;  // qkv's key and value rows (inference fusion), made from the weight stamped here
  TensorStamp kv_from;
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  Linear fc1{nullptr}, fc2{nullptr};
  MlpImpl(int64_t dim, int64_t hidden) {
    fc1 = register_module("fc1", Linear(dim, hidden));
    fc2 = register_module("fc2", Linear(hidden, dim));
  }
  at::Tensor forward(const at::Tensor& x) { return linear(*fc2, torch::gelu(linear(*fc1, x))); }
  // inference fusion: fc2(gelu(fc1(x))) + residual in two oneDNN calls (GELU and the add as post-ops)
  at::Tensor forward_fused(const at::Tensor& x, const at::Tensor& residual) {
    return linear_add(linear_act(x, fc1->weight, fc1->bias, Act::GELU, &fc1_pack), fc2->weight, fc2->bias, residual,
                      &fc2_pack);
  }
  LinearPack fc1_pack, fc2_pack;
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module, InferenceFusion {
  LayerNorm norm1{nullptr}, norm2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
  double dpr;
  BlockImpl(int64_t dim, int64_t heads, double drop_path_rate) : dpr(drop_path_rate) {
    norm1 = register_module("norm1", LayerNorm(LayerNormOptions({dim}).eps(1e-6)));
    attn = register_module("attn", Attention(dim, heads));
    norm2 = register_module("norm2", LayerNorm(LayerNormOptions({dim}).eps(1e-6)));
    mlp = register_module("mlp", Mlp(dim, dim * 4));
  }
  at::Tensor forward(at::Tensor x) {
    if (fuse_infer && !is_training() && linear_fusable(x)) {  // eval: no drop path
      x = attn->forward(norm1(x), x);
      return mlp->forward_fused(norm2(x), x);
    }
    x = x + drop_path(attn(norm1(x)), dpr, is_training());
    return x + drop_path(mlp(norm2(x)), dpr, is_training());
  }
  // forward(x)'s class-token row, [B, 1, C]: what the last block computes when the head reads only
  // that row (the other rows' queries, projections and MLP have no use).
  at::Tensor forward_cls(const at::Tensor& x) {
    auto cls = x.narrow(1, 0, 1);
    if (fuse_infer && !is_training() && linear_fusable(x)) {
      cls = attn->forward_cls(norm1(x), cls);
      return mlp->forward_fused(norm2(cls), cls);
    }
    cls = cls + drop_path(attn->forward_cls(norm1(x)), dpr, is_training());
    return cls + drop_path(mlp(norm2(cls)), dpr, is_training());
  }
};
TORCH_MODULE(Block);

struct PatchEmbedImpl : torch::nn::Module, InferenceFusion {
  torch::nn::Conv2d proj{nullptr};
  PatchEmbedImpl(int64_t in_chans, int64_t dim, int64_t patch) {
    proj = register_module("proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_chans, dim, patch).stride(patch)));
  }
  at::Tensor forward(const at::Tensor& x) {  // B, N, C (inference fusion: a linear over the patches)
    return patch_conv(*proj, x, &cache, fuse_infer && !is_training()).flatten(2).transpose(1, 2);
  }
  PatchLinearCache cache;
};
TORCH_MODULE(PatchEmbed);

class VisionTransformerImpl : public ClassifierImpl {
 public:
  VisionTransformerImpl(const VitSpec& s, const ModelArgs& a)
      : spec_(s), num_classes_(a.num_classes), drop_rate_(a.drop_rate) {
    pool_ = resolve_global_pool(s.name, a.global_pool, "token", {"token", "avg"}, a.global_pool_from);
    img_size_ = a.img_size > 0 ? a.img_size : 224;
    if (img_size_ % s.patch)
      throw UserError(fmt::format("--img-size {}: {} needs a multiple of its patch size {}", img_size_, s.name, s.patch));
    const int64_t n = (img_size_ / s.patch) * (img_size_ / s.patch);
    cls_token_ = register_parameter("cls_token", torch::zeros({1, 1, s.dim}));
    pos_embed_ = register_parameter("pos_embed", torch::zeros({1, n + 1, s.dim}));
    patch_embed_ = register_module("patch_embed", PatchEmbed(a.in_chans, s.dim, s.patch));
    blocks_ = register_module("blocks", torch::nn::Sequential());
    for (int64_t i = 0; i < s.depth; ++i) {
      double dpr = s.depth > 1 ? a.drop_path_rate * double(i) / double(s.depth - 1) : 0.0;  // linspace(0, rate)
      blocks_->push_back(std::to_string(i), Block(s.dim, s.heads, dpr));
    }
    // timm: with avg pooling the final norm moves after the pool (fc_norm) and `norm` is Identity
    norm_ = register_module(pool_ == "avg" ? "fc_norm" : "norm", LayerNorm(LayerNormOptions({s.dim}).eps(1e-6)));
    if (num_classes_ > 0) head_ = register_module("head", Linear(s.dim, num_classes_));
    init_weights();
  }

  at::Tensor forward_features(const at::Tensor& in) override {
    auto x = blocks_->forward(embed(in));
    return pool_ == "avg" ? x : norm_(x);
  }
  // With class-token pooling the head reads one row of the last block's output: that block computes
  // only it (keys and values of every token, the rest for the class token), and the final norm
  // normalises only it. The logits equal forward_head(forward_features(x)) within float rounding;
  // ViT-S/16 at 224 px skips 10/12 of one block's linear layers of twelve.
  at::Tensor forward(const at::Tensor& in) override {
    if (pool_ != "token") return forward_head(forward_features(in), false);
    auto x = embed(in);
    const size_t depth = blocks_->size();
    for (size_t i = 0; i + 1 < depth; ++i) x = blocks_[i]->as<BlockImpl>()->forward(x);
    return forward_head(norm_(blocks_[depth - 1]->as<BlockImpl>()->forward_cls(x)), false);
  }
  at::Tensor forward_head(const at::Tensor& in, bool pre_logits) override {
    // the class token, or (timm's 'avg') the mean of the patch tokens
    auto x = pool_ == "avg" ? norm_(in.slice(1, 1).mean(1)) : in.select(1, 0);
    if (drop_rate_ > 0) x = torch::dropout(x, drop_rate_, is_training());
    if (pre_logits || !head_) return x;
    return head_(x);
  }
  int64_t num_classes() const override { return num_classes_; }
  int64_t num_features() const override { return spec_.dim; }
  std::set<std::string> no_weight_decay() const override { return {"pos_embed", "cls_token"}; }
  std::vector<GroupRule> group_matcher() const override {
    return {{0, "^cls_token|reg_token|pos_embed|patch_embed|norm_pre", {}},
            {1, R"(^blocks\.(\d+))", {}},
            {1, "^norm", {99999}}};
  }
  std::vector<FeatureInfo> feature_info() const override {
    std::vector<FeatureInfo> v;
    for (int64_t i = 0; i < spec_.depth; ++i) v.push_back({spec_.dim, spec_.patch, "blocks." + std::to_string(i)});
    return v;
  }
  std::vector<int64_t> default_out_indices() const override {  // timm: out_indices=3, the last three blocks
    return {spec_.depth - 3, spec_.depth - 2, spec_.depth - 1};
  }
  // timm's forward_intermediates(norm=False, output_fmt='NCHW'): block outputs without the class
  // token, as B x C x H/patch x W/patch.
  std::vector<at::Tensor> forward_intermediates(const at::Tensor& in, const std::vector<int64_t>& indices) override {
    const int64_t gh = in.size(2) / spec_.patch, gw = in.size(3) / spec_.patch;
    auto x = embed(in);
    std::vector<at::Tensor> out;
    const int64_t last = indices.empty() ? -1 : *std::max_element(indices.begin(), indices.end());
    for (int64_t i = 0; i <= last; ++i) {
      x = blocks_[i]->as<BlockImpl>()->forward(x);
      if (std::find(indices.begin(), indices.end(), i) != indices.end())
        out.push_back(x.slice(1, 1).reshape({x.size(0), gh, gw, -1}).permute({0, 3, 1, 2}).contiguous());
    }
    return out;
  }

 private:
  at::Tensor embed(const at::Tensor& in) {  // patch tokens after the class token, plus position embeddings
    auto x = patch_embed_(in);
    return torch::cat({cls_token_.expand({x.size(0), -1, -1}), x}, 1) + pos_embed_;
  }
  void init_weights() {  // timm 'timm' mode: trunc_normal(.02) for Linear, zero biases
    torch::NoGradGuard ng;
    trunc_normal_(pos_embed_, 0.0, 0.02, -2.0, 2.0);
    torch::nn::init::normal_(cls_token_, 0.0, 1e-6);
    for (auto& m : modules(false))
      if (auto* l = m->as<Linear>()) {
        trunc_normal_(l->weight, 0.0, 0.02, -2.0, 2.0);
        if (l->bias.defined()) torch::nn::init::zeros_(l->bias);
      }
  }

  const VitSpec& spec_;
  int64_t num_classes_, img_size_ = 224;
  double drop_rate_;
  std::string pool_;
  at::Tensor cls_token_, pos_embed_;
  PatchEmbed patch_embed_{nullptr};
  torch::nn::Sequential blocks_{nullptr};
  LayerNorm norm_{nullptr};
  Linear head_{nullptr};
};

}  // namespace

void register_vit(Registry<ModelEntry>& r) {
  for (auto& s : specs()) {
    ModelEntry e{[&s](const ModelArgs& a) -> Model { return std::make_shared<VisionTransformerImpl>(s, a); },
                 timm_defaults(s.name)};
    e.cpu_training_fused = "fused kernels (attention)";  // imgtrain's attention kernels (docs/performance.md)
    r.add(s.name, std::move(e));
  }
}

}  // namespace imgtrain::model_zoo
