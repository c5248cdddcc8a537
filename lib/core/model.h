// The interface every classification model implements, and its default data config (timm's
// pretrained_cfg: input size, mean, std, crop_pct, interpolation). The engine trains any model
// through this interface; model_zoo provides the architectures.
#pragma once
#include <torch/nn/module.h>
#include <array>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace imgtrain {

struct ModelDefaults {
  std::array<int64_t, 3> input_size{3, 224, 224};
  std::array<double, 3> mean{0.485, 0.456, 0.406};
  std::array<double, 3> std{0.229, 0.224, 0.225};
  double crop_pct = 0.875;
  int64_t test_input_size = 0;  // timm's test_input_size (square side); 0 = same as input_size
  double test_crop_pct = 0.0;   // 0 = same as crop_pct
  std::string interpolation = "bilinear";
  int64_t num_classes = 1000;
  std::string first_conv = "conv1";
  std::string classifier = "fc";
  std::vector<std::string> tags;  // pretrained tags timm knows, the default first
  std::string crop_mode = "center";  // timm pretrained_cfg crop_mode: center | squash | border
};

struct ModelArgs {
  int64_t num_classes = 1000;
  int64_t in_chans = 3;
  double drop_rate = 0.0;
  double drop_path_rate = 0.0;
  std::string global_pool;  // timm's --gp: "" = the model's default (avg for CNNs, token for ViT)
  // Where global_pool came from, for the message when the model does not support it: the flag, or
  // a checkpoint's metadata the user never typed.
  std::string global_pool_from = "--gp";
  int64_t img_size = 0;  // for models whose shapes depend on it (ViT position embeddings); 0 = default
};

// One level of a model's multi-scale feature maps (timm's feature_info): channels, stride relative
// to the input, and the module whose output it is.
struct FeatureInfo {
  int64_t num_chs;
  int64_t reduction;
  std::string module;
};

// One rule of timm's group_matcher (fine-grained, coarse=False): parameters whose name matches
// `regex` at its start belong to group `ordinal`, sub-ordered by the regex's numeric captures and
// then `suffix` ({99999} = merge into the previous group, timm's MATCH_PREV_GROUP). Layer-wise
// lr decay numbers the layers by sorting these keys.
struct GroupRule {
  int ordinal;
  std::string regex;
  std::vector<double> suffix;
};

class ClassifierImpl : public torch::nn::Module {
 public:
  virtual at::Tensor forward_features(const at::Tensor& x) = 0;
  virtual at::Tensor forward_head(const at::Tensor& x, bool pre_logits = false) = 0;
  // The logits. A model may compute them without what forward_features returns that the head never
  // reads (ViT with class-token pooling: the last block's other tokens); the result is the same.
  virtual at::Tensor forward(const at::Tensor& x) { return forward_head(forward_features(x)); }
  virtual int64_t num_classes() const = 0;
  virtual int64_t num_features() const = 0;
  // Parameters excluded from weight decay beyond timm's 1-D rule (timm's model.no_weight_decay()).
  virtual std::set<std::string> no_weight_decay() const { return {}; }
  // timm's group_matcher(coarse=False), for --layer-decay.
  virtual std::vector<GroupRule> group_matcher() const { return {}; }
  // The features API (timm's features_only models, the detection backbone): every level the
  // model can return, and the NCHW maps of the levels in `indices` (indices into feature_info(),
  // ascending), computed with one pass through the trunk. Every zoo model implements both; the
  // defaults serve toy models in tests that have no feature levels.
  virtual std::vector<FeatureInfo> feature_info() const { return {}; }
  virtual std::vector<at::Tensor> forward_intermediates(const at::Tensor&, const std::vector<int64_t>&) {
    throw std::logic_error("this model has no feature levels");
  }
  // timm's default out_indices for features_only (all levels for CNNs, the last three blocks for ViT).
  virtual std::vector<int64_t> default_out_indices() const {
    std::vector<int64_t> v(feature_info().size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = int64_t(i);
    return v;
  }
};

}  // namespace imgtrain
