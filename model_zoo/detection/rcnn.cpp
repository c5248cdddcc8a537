// Faster / Mask R-CNN with torchvision's module tree and arithmetic (see rcnn.h). Each function
// names the torchvision function it follows; the tensor operations are the same ones in the same
// order, so float32 results are equal, not just close.
#include "model_zoo/detection/rcnn.h"

#include "core/batch_norm.h"
#include "core/error.h"
#include "core/log.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"
#include "ops/ops.h"

#include <ATen/ATen.h>
#include <ATen/TensorIndexing.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <set>

namespace imgtrain::model_zoo::detection {
namespace {

using torch::nn::Conv2d;
using torch::nn::Conv2dOptions;
using torch::nn::Linear;
using torch::nn::Sequential;

struct Arch {
  std::string name;
  std::string backbone;  // a zoo ResNet, or "mobilenet_v3_large" (torchvision's module tree)
  bool mask = false;
  bool v2 = false;  // torchvision's _v2 builders: BatchNorm in the FPN, two RPN convs, conv heads
  RCNNDefaults defaults = {};
  bool mobilenet() const { return backbone == "mobilenet_v3_large"; }
};

const std::vector<Arch>& archs() {
  // fasterrcnn_mobilenet_v3_large_fpn / _320_fpn: the builders' keyword defaults
  static const RCNNDefaults mnv3{800, 1333, 1000, 1000, 0.05}, mnv3_320{320, 640, 150, 150, 0.05};
  static const std::vector<Arch> a = {
      {"fasterrcnn_mobilenet_v3_large_fpn", "mobilenet_v3_large", false, false, mnv3},
      {"fasterrcnn_mobilenet_v3_large_320_fpn", "mobilenet_v3_large", false, false, mnv3_320},
      {"fasterrcnn_resnet50_fpn", "resnet50", false, false},
      {"fasterrcnn_resnet50_fpn_v2", "resnet50", false, true},
      {"fasterrcnn_resnet101_fpn", "resnet101", false, false},
      {"fasterrcnn_resnet18_fpn", "resnet18", false, false},
      {"fasterrcnn_resnet34_fpn", "resnet34", false, false},
      {"maskrcnn_resnet50_fpn", "resnet50", true, false},
      {"maskrcnn_resnet50_fpn_v2", "resnet50", true, true},
      {"maskrcnn_resnet101_fpn", "resnet101", true, false},
      {"maskrcnn_resnet18_fpn", "resnet18", true, false},
      {"maskrcnn_resnet34_fpn", "resnet34", true, false},
  };
  return a;
}

const Arch& find_arch(const std::string& name) {
  for (auto& a : archs())
    if (a.name == name) return a;
  throw UserError(fmt::format("--model '{}': not a detection model", name));
}

// torchvision's Conv2dNormActivation: conv (bias only without a norm) as "0", optional BatchNorm
// as "1", ReLU. (A module rather than a nested Sequential, which LibTorch's AnyModule cannot hold.)
// With inference fusion on (set_inference_fusion: benchmark, validate --fuse-bn), its 3x3
// convolutions run by Winograd in inference (model_zoo::conv_module_forward).
struct ConvNormActImpl : torch::nn::Module, imgtrain::InferenceFusion {
  Conv2d conv{nullptr};
  imgtrain::BatchNorm2d bn{nullptr};
  bool relu;
  ConvNormActImpl(int64_t in, int64_t out, int64_t k, bool with_bn, bool relu, int64_t dilation = 1) : relu(relu) {
    const int64_t pad = (k - 1) / 2 * dilation;
    conv = register_module("0", Conv2d(Conv2dOptions(in, out, k).padding(pad).dilation(dilation).bias(!with_bn)));
    if (with_bn) bn = register_module("1", imgtrain::BatchNorm2d(out));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = model_zoo::conv_module_forward(*conv, x, fuse_infer);  // the zoo's paths (the dense 3x3 one)
    if (bn) y = bn(y);
    return relu ? y.relu_() : y;
  }
};
TORCH_MODULE(ConvNormAct);

// A Sequential with a plain forward, so that it can sit in an AnyModule.
struct SeqImpl : torch::nn::SequentialImpl {
  at::Tensor forward(const at::Tensor& x) { return torch::nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(Seq);

template <class F>
void for_each_conv(torch::nn::Module& m, F f) {
  for (auto& c : m.modules(/*include_self=*/false))
    if (auto* conv = c->as<torch::nn::Conv2d>()) f(*conv);
}

// ---- torchvision's mobilenet_v3_large features (models/mobilenetv3.py), as the FPN body -------

enum class Act { None, ReLU, HardSwish };

// Conv2dNormActivation with BatchNorm: conv "0" (no bias), BatchNorm "1", the activation.
struct MbConvImpl : torch::nn::Module {
  Conv2d conv{nullptr};
  imgtrain::BatchNorm2d bn{nullptr};
  Act act;
  MbConvImpl(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t groups, Act act) : act(act) {
    conv = register_module(
        "0", Conv2d(Conv2dOptions(in, out, k).stride(stride).padding((k - 1) / 2).groups(groups).bias(false)));
    bn = register_module("1", imgtrain::BatchNorm2d(out));
  }
  // through the zoo's conv_bn_act, so that the BatchNorm folding and fusions apply here too
  at::Tensor forward(const at::Tensor& x) {
    const auto a = act == Act::ReLU        ? model_zoo::Act::ReLU
                   : act == Act::HardSwish ? model_zoo::Act::HardSwish
                                           : model_zoo::Act::Identity;
    return model_zoo::conv_bn_act(*conv, *bn, x, a);
  }
};
TORCH_MODULE(MbConv);

// SqueezeExcitation(exp, _make_divisible(exp // 4, 8)) with ReLU and a hard-sigmoid gate.
struct MbSqueezeImpl : torch::nn::Module {
  Conv2d fc1{nullptr}, fc2{nullptr};
  MbSqueezeImpl(int64_t c, int64_t squeeze) {
    fc1 = register_module("fc1", Conv2d(Conv2dOptions(c, squeeze, 1)));
    fc2 = register_module("fc2", Conv2d(Conv2dOptions(squeeze, c, 1)));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto s = fc2(fc1(x.mean({2, 3}, /*keepdim=*/true)).relu());
    return x * at::hardsigmoid(s);
  }
};
TORCH_MODULE(MbSqueeze);

// InvertedResidual: `block` = [expand], depthwise, [SE], project; the input added back where
// stride 1 keeps the channels.
struct MbInvertedResidualImpl : torch::nn::Module {
  Seq block{nullptr};
  bool residual;
  MbInvertedResidualImpl(int64_t in, int64_t k, int64_t exp, int64_t out, bool se, Act act, int64_t stride)
      : residual(stride == 1 && in == out) {
    block = register_module("block", Seq());
    if (exp != in) block->push_back(std::to_string(block->size()), MbConv(in, exp, 1, 1, 1, act));
    block->push_back(std::to_string(block->size()), MbConv(exp, exp, k, stride, exp, act));
    if (se) {
      const int64_t v = exp / 4;
      int64_t sq = std::max<int64_t>(8, (v + 4) / 8 * 8);  // _make_divisible(v, 8)
      if (double(sq) < 0.9 * double(v)) sq += 8;
      block->push_back(std::to_string(block->size()), MbSqueeze(exp, sq));
    }
    block->push_back(std::to_string(block->size()), MbConv(exp, out, 1, 1, 1, Act::None));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto y = block->forward(x);
    return residual ? y + x : y;
  }
};
TORCH_MODULE(MbInvertedResidual);

// features.0 .. features.16 under their indices (IntermediateLayerGetter keeps every module up
// to the last returned one); forward returns features.13 and features.16, both at stride 32.
struct MobileNetV3BodyImpl : torch::nn::Module {
  std::vector<torch::nn::AnyModule> layers;
  static constexpr std::array<int64_t, 6> stage_indices{0, 2, 4, 7, 13, 16};
  MobileNetV3BodyImpl() {
    struct Cfg {
      int64_t in, k, exp, out;
      bool se;
      Act act;
      int64_t stride;
    };
    const Act RE = Act::ReLU, HS = Act::HardSwish;
    static const Cfg cfgs[] = {{16, 3, 16, 16, false, RE, 1},     {16, 3, 64, 24, false, RE, 2},
                               {24, 3, 72, 24, false, RE, 1},     {24, 5, 72, 40, true, RE, 2},
                               {40, 5, 120, 40, true, RE, 1},     {40, 5, 120, 40, true, RE, 1},
                               {40, 3, 240, 80, false, HS, 2},    {80, 3, 200, 80, false, HS, 1},
                               {80, 3, 184, 80, false, HS, 1},    {80, 3, 184, 80, false, HS, 1},
                               {80, 3, 480, 112, true, HS, 1},    {112, 3, 672, 112, true, HS, 1},
                               {112, 5, 672, 160, true, HS, 2},   {160, 5, 960, 160, true, HS, 1},
                               {160, 5, 960, 160, true, HS, 1}};
    layers.emplace_back(register_module("0", MbConv(3, 16, 3, 2, 1, HS)));
    for (const Cfg& c : cfgs)
      layers.emplace_back(register_module(std::to_string(layers.size()),
                                          MbInvertedResidual(c.in, c.k, c.exp, c.out, c.se, c.act, c.stride)));
    layers.emplace_back(register_module("16", MbConv(160, 960, 1, 1, 1, HS)));
    torch::NoGradGuard ng;  // MobileNetV3's init: convolutions kaiming-normal over fan-out, biases 0
    for (auto& m : modules(false))
      if (auto* conv = m->as<torch::nn::Conv2d>()) {
        torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
        if (conv->bias.defined()) torch::nn::init::zeros_(conv->bias);
      }
  }
  std::vector<at::Tensor> forward(at::Tensor x) {
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < layers.size(); ++i) {
      x = layers[i].forward(x);
      if (i == 13 || i == 16) out.push_back(x);
    }
    return out;
  }
};
TORCH_MODULE(MobileNetV3Body);

// ---- backbone: ResNet body + FeaturePyramidNetwork + LastLevelMaxPool -------------------------

struct FPNImpl : torch::nn::Module {
  torch::nn::ModuleList inner_blocks, layer_blocks;
  std::vector<ConvNormAct> inner, layer;
  FPNImpl(const std::vector<int64_t>& in_channels, int64_t out, bool bn) {
    inner_blocks = register_module("inner_blocks", torch::nn::ModuleList());
    layer_blocks = register_module("layer_blocks", torch::nn::ModuleList());
    for (int64_t c : in_channels) {
      inner.push_back(ConvNormAct(c, out, 1, bn, false));
      layer.push_back(ConvNormAct(out, out, 3, bn, false));
      inner_blocks->push_back(inner.back());
      layer_blocks->push_back(layer.back());
    }
    torch::NoGradGuard ng;
    for_each_conv(*this, [](torch::nn::Conv2dImpl& c) {
      torch::nn::init::kaiming_uniform_(c.weight, 1.0);
      if (c.bias.defined()) torch::nn::init::zeros_(c.bias);
    });
  }
  // FeaturePyramidNetwork.forward, then LastLevelMaxPool: levels '0'..'3' and 'pool'.
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& x) {
    const int64_t n = int64_t(x.size());
    std::vector<at::Tensor> results(static_cast<size_t>(n));
    auto last_inner = inner[size_t(n - 1)]->forward(x.back());
    results[size_t(n - 1)] = layer[size_t(n - 1)]->forward(last_inner);
    for (int64_t i = n - 2; i >= 0; --i) {
      auto lateral = inner[size_t(i)]->forward(x[size_t(i)]);
      auto top_down = at::upsample_nearest2d(last_inner, {lateral.size(-2), lateral.size(-1)});
      last_inner = lateral + top_down;
      results[size_t(i)] = layer[size_t(i)]->forward(last_inner);
    }
    results.push_back(at::max_pool2d(results.back(), {1, 1}, {2, 2}, {0, 0}));
    return results;
  }
};
TORCH_MODULE(FPN);

struct BackboneImpl : torch::nn::Module {
  std::shared_ptr<ClassifierImpl> body;
  MobileNetV3Body mobilenet{nullptr};
  FPN fpn{nullptr};
  BackboneImpl(const Arch& a, const RCNNOptions& o) {
    if (a.mobilenet()) {
      build_mobilenet(o);
      return;
    }
    ModelArgs ma;
    ma.num_classes = 0;
    body = register_module("body", create_model(a.backbone, ma));
    {
      // torchvision's ResNet initialisation (zero_init_residual=False): every BatchNorm weight 1,
      // where timm's zero-inits each block's last one. Weights loaded later replace both.
      torch::NoGradGuard ng;
      for (auto& m : body->modules(false))
        if (auto* bn = m->as<torch::nn::BatchNorm2dImpl>()) bn->weight.fill_(1.0);
    }
    std::vector<int64_t> chans;
    const auto info = body->feature_info();
    for (int64_t i = 1; i <= 4; ++i) chans.push_back(info.at(size_t(i)).num_chs);
    fpn = register_module("fpn", FPN(chans, o.fpn_channels, a.v2));
    // torchvision: FrozenBatchNorm2d in a body that starts from weights (the v1 builders).
    if (o.from_weights && !a.v2)
      for (auto& m : body->modules(false))
        if (auto* bn = m->as<imgtrain::BatchNorm2dImpl>()) bn->freeze(o.frozen_bn_eps);
    // _resnet_fpn_extractor: parameters outside the trained layers are frozen.
    int64_t trainable = o.trainable_backbone_layers;
    if (!o.from_weights) {
      if (trainable >= 0 && trainable != 5)
        log::warn("--trainable-backbone-layers {} has no effect without backbone weights (--pretrained-path): "
                  "all 5 layers are trained, as torchvision does", trainable);
      trainable = 5;
    } else if (trainable < 0) {
      trainable = 3;
    }
    if (trainable > 5)
      throw UserError(fmt::format("--trainable-backbone-layers {}: expected 0 to 5", trainable));
    std::vector<std::string> train = {"layer4", "layer3", "layer2", "layer1", "conv1"};
    train.resize(size_t(trainable));
    if (trainable == 5) train.push_back("bn1");
    for (auto& p : body->named_parameters()) {
      bool keep = false;
      for (auto& t : train) keep = keep || p.key().rfind(t, 0) == 0;
      if (!keep) p.value().requires_grad_(false);
    }
  }
  // _mobilenet_extractor(fpn=True): features 13 and 16 into the FPN; FrozenBatchNorm2d from
  // weights; the first stage_indices[6 - t] features frozen for t trainable layers (0..6).
  void build_mobilenet(const RCNNOptions& o) {
    mobilenet = register_module("body", MobileNetV3Body());
    fpn = register_module("fpn", FPN(std::vector<int64_t>{160, 960}, o.fpn_channels, false));
    if (o.from_weights)
      for (auto& m : mobilenet->modules(false))
        if (auto* bn = m->as<imgtrain::BatchNorm2dImpl>()) bn->freeze(o.frozen_bn_eps);
    int64_t trainable = o.trainable_backbone_layers;
    if (!o.from_weights) {
      if (trainable >= 0 && trainable != 6)
        log::warn("--trainable-backbone-layers {} has no effect without backbone weights (--pretrained-path): "
                  "all 6 layers are trained, as torchvision does", trainable);
      trainable = 6;
    } else if (trainable < 0) {
      trainable = 3;
    }
    if (trainable > 6)
      throw UserError(fmt::format("--trainable-backbone-layers {}: expected 0 to 6 for a MobileNetV3 body", trainable));
    const int64_t freeze_before =
        trainable == 0 ? int64_t(mobilenet->layers.size()) : MobileNetV3BodyImpl::stage_indices[size_t(6 - trainable)];
    for (auto& p : mobilenet->named_parameters()) {
      const int64_t idx = std::stoll(p.key().substr(0, p.key().find('.')));
      if (idx < freeze_before) p.value().requires_grad_(false);
    }
  }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    if (mobilenet) return fpn->forward(mobilenet->forward(x));
    return fpn->forward(body->forward_intermediates(x, {1, 2, 3, 4}));
  }
};
TORCH_MODULE(Backbone);

// ---- RPN ----------------------------------------------------------------------------------------

struct RPNHeadImpl : torch::nn::Module {
  Sequential conv;
  Conv2d cls_logits{nullptr}, bbox_pred{nullptr};
  RPNHeadImpl(int64_t in, int64_t anchors, int64_t depth) {
    conv = register_module("conv", Sequential());
    for (int64_t i = 0; i < depth; ++i) conv->push_back(std::to_string(i), ConvNormAct(in, in, 3, false, true));
    cls_logits = register_module("cls_logits", Conv2d(Conv2dOptions(in, anchors, 1)));
    bbox_pred = register_module("bbox_pred", Conv2d(Conv2dOptions(in, anchors * 4, 1)));
    torch::NoGradGuard ng;
    for_each_conv(*this, [](torch::nn::Conv2dImpl& c) {
      torch::nn::init::normal_(c.weight, 0.0, 0.01);
      if (c.bias.defined()) torch::nn::init::zeros_(c.bias);
    });
  }
};
TORCH_MODULE(RPNHead);

struct RPNImpl : torch::nn::Module {
  RPNHead head{nullptr};
  RPNImpl(int64_t in, int64_t depth, int64_t anchors) { head = register_module("head", RPNHead(in, anchors, depth)); }
};
TORCH_MODULE(RPN);

// ---- RoI heads ----------------------------------------------------------------------------------

struct TwoMLPHeadImpl : torch::nn::Module {
  Linear fc6{nullptr}, fc7{nullptr};
  TwoMLPHeadImpl(int64_t in, int64_t rep) {
    fc6 = register_module("fc6", Linear(in, rep));
    fc7 = register_module("fc7", Linear(rep, rep));
  }
  at::Tensor forward(const at::Tensor& x) { return fc7(fc6(x.flatten(1)).relu()).relu(); }
};
TORCH_MODULE(TwoMLPHead);

struct FastRCNNPredictorImpl : torch::nn::Module {
  Linear cls_score{nullptr}, bbox_pred{nullptr};
  FastRCNNPredictorImpl(int64_t in, int64_t classes) {
    cls_score = register_module("cls_score", Linear(in, classes));
    bbox_pred = register_module("bbox_pred", Linear(in, classes * 4));
  }
};
TORCH_MODULE(FastRCNNPredictor);

// FastRCNNConvFCHead (v2): four 3x3 conv-BN-ReLU (256 channels), flatten, Linear `rep`, ReLU.
Seq conv_fc_head(int64_t in, int64_t res, int64_t rep) {
  Seq s;
  int64_t c = in;
  for (int i = 0; i < 4; ++i, c = 256) s->push_back(std::to_string(i), ConvNormAct(c, 256, 3, true, true));
  s->push_back("4", torch::nn::Flatten());
  s->push_back("5", Linear(256 * res * res, rep));
  s->push_back("6", torch::nn::ReLU(torch::nn::ReLUOptions(true)));
  torch::NoGradGuard ng;
  for_each_conv(*s, [](torch::nn::Conv2dImpl& c) {
    torch::nn::init::kaiming_normal_(c.weight, 0.0, torch::kFanOut, torch::kReLU);
    if (c.bias.defined()) torch::nn::init::zeros_(c.bias);
  });
  return s;
}

// MaskRCNNHeads: `n` 3x3 conv(-BN)-ReLU of `dim` channels (torchvision: four of 256).
Sequential mask_heads(int64_t in, int64_t dim, int64_t n, bool bn) {
  Sequential s;
  int64_t c = in;
  for (int64_t i = 0; i < n; ++i, c = dim) s->push_back(std::to_string(i), ConvNormAct(c, dim, 3, bn, true));
  torch::NoGradGuard ng;
  for_each_conv(*s, [](torch::nn::Conv2dImpl& c) {
    torch::nn::init::kaiming_normal_(c.weight, 0.0, torch::kFanOut, torch::kReLU);
    if (c.bias.defined()) torch::nn::init::zeros_(c.bias);
  });
  return s;
}

// The predictor's ConvTranspose2d(in, out, 2, stride=2): the same parameters, names and
// initialisation, with the bias added after the transposed convolution instead of by it. The sum
// is the same, but for a channels-last map oneDNN computes the bias gradient of a transposed
// convolution in a reference loop (4% of a narrow Mask R-CNN's CPU step), where the add's
// backward is ATen's vectorised sum.
struct UpConv2x2Impl : torch::nn::Module {
  at::Tensor weight, bias;
  UpConv2x2Impl(int64_t in, int64_t out) {
    torch::nn::ConvTranspose2d made(torch::nn::ConvTranspose2dOptions(in, out, 2).stride(2));  // its init
    weight = register_parameter("weight", made->weight.detach().clone());
    bias = register_parameter("bias", made->bias.detach().clone());
  }
  at::Tensor forward(const at::Tensor& x) {
    return at::conv_transpose2d(x, weight, {}, {2, 2}).add_(bias.view({1, -1, 1, 1}));
  }
};
TORCH_MODULE(UpConv2x2);

// MaskRCNNPredictor: 2x2 transposed conv, ReLU, 1x1 to the classes.
Sequential mask_predictor(int64_t in, int64_t dim, int64_t classes) {
  Sequential s;
  s->push_back("conv5_mask", UpConv2x2(in, dim));
  s->push_back("relu", torch::nn::ReLU(torch::nn::ReLUOptions(true)));
  s->push_back("mask_fcn_logits", Conv2d(Conv2dOptions(dim, classes, 1)));
  torch::NoGradGuard ng;
  for (auto& p : s->named_parameters())
    if (p.key().find("weight") != std::string::npos)
      torch::nn::init::kaiming_normal_(p.value(), 0.0, torch::kFanOut, torch::kReLU);
  return s;
}

struct RoIHeadsImpl : torch::nn::Module {
  torch::nn::AnyModule box_head;
  FastRCNNPredictor box_predictor{nullptr};
  Sequential mask_head{nullptr}, mask_predictor{nullptr};
  RoIHeadsImpl(const Arch& a, const RCNNOptions& o) {
    const int64_t c = o.fpn_channels;
    if (a.v2) {
      box_head = torch::nn::AnyModule(register_module("box_head", conv_fc_head(c, 7, o.box_head_dim)));
    } else {
      box_head = torch::nn::AnyModule(register_module("box_head", TwoMLPHead(c * 7 * 7, o.box_head_dim)));
    }
    box_predictor = register_module("box_predictor", FastRCNNPredictor(o.box_head_dim, o.num_classes));
    if (a.mask) {
      mask_head = register_module("mask_head", mask_heads(c, o.mask_head_dim, o.mask_head_convs, a.v2));
      const int64_t in = o.mask_head_convs > 0 ? o.mask_head_dim : c;
      mask_predictor =
          register_module("mask_predictor", detection::mask_predictor(in, o.mask_head_dim, o.num_classes));
    }
  }
};
TORCH_MODULE(RoIHeads);

// ---- box arithmetic -----------------------------------------------------------------------------

// box_ops.clip_boxes_to_image on [..., 4] boxes.
at::Tensor clip_boxes(const at::Tensor& boxes, int64_t h, int64_t w) {
  auto x = boxes.slice(-1, 0, 4, 2).clamp(0, w);
  auto y = boxes.slice(-1, 1, 4, 2).clamp(0, h);
  return at::stack({x, y}, boxes.dim()).reshape(boxes.sizes());
}

// box_ops.remove_small_boxes
at::Tensor remove_small(const at::Tensor& b, double min_size) {
  auto ws = b.select(1, 2) - b.select(1, 0), hs = b.select(1, 3) - b.select(1, 1);
  return at::where(ws.ge(min_size).logical_and(hs.ge(min_size)))[0];
}

// BalancedPositiveNegativeSampler: masks of the sampled positives (label >= 1) and negatives (0).
std::pair<at::Tensor, at::Tensor> balanced_sample(const at::Tensor& labels, int64_t batch, double fraction,
                                                  bool deterministic, std::optional<at::Generator>& gen) {
  auto positive = at::where(labels.ge(1))[0];
  auto negative = at::where(labels.eq(0))[0];
  const int64_t num_pos = std::min(positive.numel(), int64_t(double(batch) * fraction));
  const int64_t num_neg = std::min(negative.numel(), batch - num_pos);
  auto perm = [&](int64_t n, int64_t k) {
    at::Tensor p;
    if (deterministic) p = at::arange(n, at::TensorOptions().dtype(at::kLong));
    else if (gen) p = at::randperm(n, *gen, at::TensorOptions().dtype(at::kLong));
    else p = at::randperm(n, at::TensorOptions().dtype(at::kLong));
    return p.slice(0, 0, k).to(labels.device());
  };
  auto pos_mask = at::zeros_like(labels, labels.options().dtype(at::kByte));
  auto neg_mask = at::zeros_like(labels, labels.options().dtype(at::kByte));
  pos_mask.index_put_({positive.index_select(0, perm(positive.numel(), num_pos))}, 1);
  neg_mask.index_put_({negative.index_select(0, perm(negative.numel(), num_neg))}, 1);
  return {pos_mask, neg_mask};
}

// _convert_to_roi_format
at::Tensor to_rois(const std::vector<at::Tensor>& boxes) {
  std::vector<at::Tensor> ids, all;
  for (size_t i = 0; i < boxes.size(); ++i) {
    ids.push_back(at::full_like(boxes[i].slice(1, 0, 1), double(i)));
    all.push_back(boxes[i]);
  }
  return at::cat({at::cat(ids, 0), at::cat(all, 0)}, 1);
}

// MultiScaleRoIAlign over levels '0'..'3' (_setup_scales, LevelMapper, _multiscale_roi_align).
at::Tensor multiscale_roi_align(const std::vector<at::Tensor>& feats, const std::vector<at::Tensor>& boxes,
                                const std::vector<std::array<int64_t, 2>>& sizes, int64_t out, int64_t sampling,
                                bool aligned, double canonical) {
  int64_t max_h = 0, max_w = 0;
  for (auto& s : sizes) max_h = std::max(max_h, s[0]), max_w = std::max(max_w, s[1]);
  std::vector<double> scales;
  const size_t n_levels = feats.size();
  for (size_t l = 0; l < n_levels; ++l) {
    const float approx = float(double(feats[l].size(-2)) / double(max_h));
    scales.push_back(std::pow(2.0, double(std::nearbyint(std::log2(approx)))));
  }
  const int64_t k_min = int64_t(-std::log2(float(scales.front()))), k_max = int64_t(-std::log2(float(scales.back())));
  auto rois = to_rois(boxes);
  std::vector<at::Tensor> areas;
  for (auto& b : boxes) areas.push_back(ops::box_area(b));
  auto s = at::sqrt(at::cat(areas));
  auto lvls = at::floor(at::log2(s / canonical) + 4 + at::scalar_tensor(1e-6, s.options()));
  lvls = lvls.clamp(double(k_min), double(k_max)).to(at::kLong) - k_min;
  return ops::multiscale_roi_align(feats, rois, lvls, scales, out, out, sampling, aligned);
}

at::Tensor box_regression_loss(const at::Tensor& pred, const at::Tensor& target, const std::string& kind) {
  if (kind == "l1") return at::l1_loss(pred, target, at::Reduction::Sum);
  return at::smooth_l1_loss(pred, target, at::Reduction::Sum, 1.0 / 9);
}

}  // namespace

// ---- public pieces --------------------------------------------------------------------------------

at::Tensor encode_boxes(const at::Tensor& reference, const at::Tensor& proposals, const std::array<double, 4>& w) {
  auto col = [](const at::Tensor& t, int64_t i) { return t.select(1, i).unsqueeze(1); };
  auto ex_w = col(proposals, 2) - col(proposals, 0), ex_h = col(proposals, 3) - col(proposals, 1);
  auto ex_x = col(proposals, 0) + 0.5 * ex_w, ex_y = col(proposals, 1) + 0.5 * ex_h;
  auto gt_w = col(reference, 2) - col(reference, 0), gt_h = col(reference, 3) - col(reference, 1);
  auto gt_x = col(reference, 0) + 0.5 * gt_w, gt_y = col(reference, 1) + 0.5 * gt_h;
  auto wt = at::tensor(std::vector<double>(w.begin(), w.end()), reference.options());
  auto dx = wt[0] * (gt_x - ex_x) / ex_w, dy = wt[1] * (gt_y - ex_y) / ex_h;
  auto dw = wt[2] * at::log(gt_w / ex_w), dh = wt[3] * at::log(gt_h / ex_h);
  return at::cat({dx, dy, dw, dh}, 1);
}

at::Tensor decode_boxes(const at::Tensor& rel, const at::Tensor& boxes_in, const std::array<double, 4>& w) {
  static const double clip = std::log(1000.0 / 16);
  auto boxes = boxes_in.to(rel.scalar_type());
  auto widths = boxes.select(1, 2) - boxes.select(1, 0), heights = boxes.select(1, 3) - boxes.select(1, 1);
  auto ctr_x = boxes.select(1, 0) + 0.5 * widths, ctr_y = boxes.select(1, 1) + 0.5 * heights;
  auto dx = rel.slice(1, 0, c10::nullopt, 4) / w[0], dy = rel.slice(1, 1, c10::nullopt, 4) / w[1];
  auto dw = (rel.slice(1, 2, c10::nullopt, 4) / w[2]).clamp_max(clip);
  auto dh = (rel.slice(1, 3, c10::nullopt, 4) / w[3]).clamp_max(clip);
  auto pcx = dx * widths.unsqueeze(1) + ctr_x.unsqueeze(1), pcy = dy * heights.unsqueeze(1) + ctr_y.unsqueeze(1);
  auto pw = at::exp(dw) * widths.unsqueeze(1), ph = at::exp(dh) * heights.unsqueeze(1);
  auto half = at::scalar_tensor(0.5, pw.options());
  auto hw = half * pw, hh = half * ph;
  return at::stack({pcx - hw, pcy - hh, pcx + hw, pcy + hh}, 2).flatten(1);
}

at::Tensor match(const at::Tensor& q, double high, double low, bool allow_low_quality) {
  if (q.numel() == 0) throw std::logic_error("match: no ground truth or no proposals");
  auto [vals, matches] = q.max(0);
  at::Tensor all = allow_low_quality ? matches.clone() : at::Tensor();
  auto below = vals.lt(low);
  auto between = vals.ge(low).logical_and(vals.lt(high));
  matches.masked_fill_(below, -1);
  matches.masked_fill_(between, -2);
  if (allow_low_quality) {
    auto best = std::get<0>(q.max(1));
    auto pairs = at::where(q.eq(best.unsqueeze(1)));
    auto upd = pairs[1];
    matches.index_put_({upd}, all.index_select(0, upd));
  }
  return matches;
}

at::Tensor grid_anchors(int64_t gh, int64_t gw, int64_t sh, int64_t sw, const std::vector<double>& sizes,
                        const std::vector<double>& ratios) {
  auto f = at::TensorOptions().dtype(at::kFloat);
  auto scales = at::tensor(std::vector<float>(sizes.begin(), sizes.end()), f);
  auto ar = at::tensor(std::vector<float>(ratios.begin(), ratios.end()), f);
  auto h_ratios = at::sqrt(ar), w_ratios = h_ratios.reciprocal();
  auto ws = (w_ratios.unsqueeze(1) * scales.unsqueeze(0)).view(-1);
  auto hs = (h_ratios.unsqueeze(1) * scales.unsqueeze(0)).view(-1);
  auto base = (at::stack({-ws, -hs, ws, hs}, 1) / 2).round();
  auto i32 = at::TensorOptions().dtype(at::kInt);
  auto sx = at::arange(gw, i32) * sw, sy = at::arange(gh, i32) * sh;
  auto grid = at::meshgrid({sy, sx}, "ij");
  auto shift_x = grid[1].reshape(-1), shift_y = grid[0].reshape(-1);
  auto shifts = at::stack({shift_x, shift_y, shift_x, shift_y}, 1);
  return (shifts.view({-1, 1, 4}) + base.view({1, -1, 4})).reshape({-1, 4});
}

// ---- the model -------------------------------------------------------------------------------------

struct GeneralizedRCNNImpl::Impl {
  Backbone backbone{nullptr};
  RPN rpn{nullptr};
  RoIHeads roi_heads{nullptr};
};

GeneralizedRCNNImpl::GeneralizedRCNNImpl(const std::string& arch, RCNNOptions o) : arch_(arch), o_(std::move(o)) {
  const Arch& a = find_arch(arch);
  mask_ = a.mask;
  mobilenet_ = a.mobilenet();
  if (o_.num_classes < 2)
    throw UserError(fmt::format("--num-classes {}: a detector needs the background and at least one class",
                                o_.num_classes));
  impl = std::make_shared<Impl>();
  auto width = [](const char* flag, int64_t v) {
    if (v < 1 || v > 4096) throw UserError(fmt::format("--{} {}: expected 1 to 4096", flag, v));
  };
  width("fpn-channels", o_.fpn_channels);
  width("box-head-dim", o_.box_head_dim);
  width("mask-head-dim", o_.mask_head_dim);
  if (o_.mask_head_convs < 0 || o_.mask_head_convs > 16)
    throw UserError(fmt::format("--mask-head-convs {}: expected 0 to 16", o_.mask_head_convs));
  impl->backbone = register_module("backbone", Backbone(a, o_));
  impl->rpn = register_module("rpn", RPN(o_.fpn_channels, a.v2 ? 2 : 1, a.mobilenet() ? 15 : 3));
  impl->roi_heads = register_module("roi_heads", RoIHeads(a, o_));
}

RCNNResult GeneralizedRCNNImpl::forward(const ImageBatch& images, const std::vector<Target>* targets) {
  const bool training = is_training();
  if (training && !targets) throw std::logic_error("GeneralizedRCNN: training needs targets");
  const auto& o = o_;
  auto& rpn_head = *impl->rpn->head;
  auto& heads = *impl->roi_heads;
  const auto feats = impl->backbone->forward(images.tensors);
  const int64_t N = images.tensors.size(0);
  const auto dev = images.tensors.device();
  RCNNResult res;
  std::vector<std::pair<std::string, at::Tensor>> rpn_losses;

  // RegionProposalNetwork.forward
  std::vector<at::Tensor> cls, reg, anchor_levels;
  std::vector<int64_t> per_level;
  static const std::vector<double> ratios = {0.5, 1.0, 2.0};
  for (size_t l = 0; l < feats.size(); ++l) {
    auto t = rpn_head.conv->forward(feats[l]);
    auto logits = rpn_head.cls_logits(t).to(at::kFloat), deltas = rpn_head.bbox_pred(t).to(at::kFloat);
    const int64_t h = logits.size(2), w = logits.size(3), A = deltas.size(1) / 4, C = logits.size(1) / A;
    per_level.push_back(logits.size(1) * h * w);
    cls.push_back(logits.view({N, -1, C, h, w}).permute({0, 3, 4, 1, 2}).reshape({N, -1, C}));
    reg.push_back(deltas.view({N, -1, 4, h, w}).permute({0, 3, 4, 1, 2}).reshape({N, -1, 4}));
    // ResNet FPN: one size per level (32 .. 512); MobileNetV3: all five on each level
    const std::vector<double> sizes = mobilenet_ ? std::vector<double>{32, 64, 128, 256, 512}
                                                 : std::vector<double>{32.0 * double(1 << l)};
    anchor_levels.push_back(
        grid_anchors(h, w, images.tensors.size(-2) / h, images.tensors.size(-1) / w, sizes, ratios));
  }
  auto objectness = at::cat(cls, 1).flatten(0, -2);
  auto pred_deltas = at::cat(reg, 1).reshape({-1, 4});
  auto anchors = at::cat(anchor_levels).to(dev);
  auto all_anchors = anchors.repeat({N, 1});
  auto proposals_all = decode_boxes(pred_deltas.detach(), all_anchors, {1, 1, 1, 1}).view({N, -1, 4});

  // filter_proposals
  std::vector<at::Tensor> proposals;
  {
    auto ob = objectness.detach().reshape({N, -1});
    std::vector<at::Tensor> lv, idx;
    int64_t offset = 0;
    for (size_t l = 0; l < per_level.size(); ++l) {
      lv.push_back(at::full({per_level[l]}, int64_t(l), at::TensorOptions().dtype(at::kLong).device(dev)));
      auto chunk = ob.narrow(1, offset, per_level[l]);
      const int64_t k = std::min(training ? o.rpn_pre_nms_top_n_train : o.rpn_pre_nms_top_n_test, per_level[l]);
      idx.push_back(std::get<1>(chunk.topk(k, 1)) + offset);
      offset += per_level[l];
    }
    auto top = at::cat(idx, 1);
    auto levels = at::cat(lv).reshape({1, -1}).expand_as(ob).gather(1, top);
    auto scores_all = ob.gather(1, top).sigmoid();
    auto boxes_all = proposals_all.gather(1, top.unsqueeze(-1).expand({N, top.size(1), 4}));
    const int64_t post = training ? o.rpn_post_nms_top_n_train : o.rpn_post_nms_top_n_test;
    for (int64_t i = 0; i < N; ++i) {
      auto boxes = clip_boxes(boxes_all[i], images.sizes[size_t(i)][0], images.sizes[size_t(i)][1]);
      auto scores = scores_all[i], lvl = levels[i];
      auto keep = remove_small(boxes, 1e-3);
      boxes = boxes.index_select(0, keep), scores = scores.index_select(0, keep), lvl = lvl.index_select(0, keep);
      keep = at::where(scores.ge(o.rpn_score_thresh))[0];
      boxes = boxes.index_select(0, keep), scores = scores.index_select(0, keep), lvl = lvl.index_select(0, keep);
      keep = ops::batched_nms(boxes, scores, lvl, o.rpn_nms_thresh).slice(0, 0, post);
      proposals.push_back(boxes.index_select(0, keep));
    }
  }

  if (training) {  // assign_targets_to_anchors, compute_loss
    std::vector<at::Tensor> labels, matched;
    for (int64_t i = 0; i < N; ++i) {
      const auto& gt = (*targets)[size_t(i)].boxes;
      if (gt.numel() == 0) {
        labels.push_back(at::zeros({anchors.size(0)}, anchors.options()));
        matched.push_back(at::zeros(anchors.sizes(), anchors.options()));
        continue;
      }
      auto m = match(ops::box_iou(gt, anchors), o.rpn_fg_iou_thresh, o.rpn_bg_iou_thresh, true);
      matched.push_back(gt.index_select(0, m.clamp_min(0)));
      auto l = m.ge(0).to(at::kFloat);
      l.masked_fill_(m.eq(-1), 0.0);
      l.masked_fill_(m.eq(-2), -1.0);
      labels.push_back(l);
    }
    auto targets_reg = encode_boxes(at::cat(matched), all_anchors, {1, 1, 1, 1});
    std::vector<at::Tensor> pos_m, neg_m;
    for (auto& l : labels) {
      auto [p, n] = balanced_sample(l, o.rpn_batch_size_per_image, o.rpn_positive_fraction, o.deterministic_sampling,
                                    generator);
      pos_m.push_back(p), neg_m.push_back(n);
    }
    auto pos = at::where(at::cat(pos_m))[0], neg = at::where(at::cat(neg_m))[0];
    auto sampled = at::cat({pos, neg});
    auto lab = at::cat(labels);
    auto box_loss = box_regression_loss(pred_deltas.index_select(0, pos), targets_reg.index_select(0, pos),
                                        o.rpn_box_loss) /
                    double(sampled.numel());
    auto obj_loss = at::binary_cross_entropy_with_logits(objectness.flatten().index_select(0, sampled),
                                                         lab.index_select(0, sampled));
    rpn_losses = {{"loss_objectness", obj_loss}, {"loss_rpn_box_reg", box_loss}};
  }

  // RoIHeads.forward
  // MultiScaleRoIAlign's featmap_names '0'..'3': the maps before 'pool' (two for MobileNetV3)
  const std::vector<at::Tensor> levels4(feats.begin(), feats.end() - 1);
  std::vector<at::Tensor> matched_idxs, box_labels;
  at::Tensor box_targets;
  if (training) {  // select_training_samples
    std::vector<at::Tensor> reg_t_gt, reg_t_props;
    for (int64_t i = 0; i < N; ++i) {
      const auto& t = (*targets)[size_t(i)];
      auto gt = t.boxes.to(proposals[size_t(i)].scalar_type());
      auto props = at::cat({proposals[size_t(i)], gt});
      at::Tensor mi, li;
      if (gt.numel() == 0) {
        mi = at::zeros({props.size(0)}, props.options().dtype(at::kLong));
        li = at::zeros({props.size(0)}, props.options().dtype(at::kLong));
      } else {
        auto m = match(ops::box_iou(gt, props), o.box_fg_iou_thresh, o.box_bg_iou_thresh, false);
        mi = m.clamp_min(0);
        li = t.labels.index_select(0, mi).to(at::kLong);
        li.masked_fill_(m.eq(-1), 0);
        li.masked_fill_(m.eq(-2), -1);
      }
      auto [pm, nm] = balanced_sample(li, o.box_batch_size_per_image, o.box_positive_fraction,
                                      o.deterministic_sampling, generator);
      auto s = at::where(pm.logical_or(nm))[0];
      props = props.index_select(0, s), li = li.index_select(0, s), mi = mi.index_select(0, s);
      auto gt_or_zero = gt.numel() == 0 ? at::zeros({1, 4}, props.options()) : gt;
      reg_t_gt.push_back(gt_or_zero.index_select(0, mi));
      reg_t_props.push_back(props);
      proposals[size_t(i)] = props, box_labels.push_back(li), matched_idxs.push_back(mi);
    }
    box_targets = encode_boxes(at::cat(reg_t_gt), at::cat(reg_t_props), o.bbox_reg_weights);
  }
  auto box_features = multiscale_roi_align(levels4, proposals, images.sizes, 7, o.box_sampling_ratio, o.roi_aligned,
                                           o.roi_canonical_size);
  box_features = heads.box_head.forward(box_features);
  auto class_logits = heads.box_predictor->cls_score(box_features);
  auto box_regression = heads.box_predictor->bbox_pred(box_features);

  if (training) {  // fastrcnn_loss
    auto labels = at::cat(box_labels);
    auto logits = class_logits.to(at::kFloat), regression = box_regression.to(at::kFloat);
    auto cls_loss = at::cross_entropy_loss(logits, labels);
    auto pos = at::where(labels.gt(0))[0];
    auto labels_pos = labels.index_select(0, pos);
    regression = regression.reshape({logits.size(0), regression.size(-1) / 4, 4});
    auto picked = regression.index({pos, labels_pos});
    auto box_loss = box_regression_loss(picked, box_targets.index_select(0, pos), o.box_loss) / double(labels.numel());
    res.losses = {{"loss_classifier", cls_loss}, {"loss_box_reg", box_loss}};
  } else {  // postprocess_detections
    const int64_t C = class_logits.size(-1);
    std::vector<int64_t> per_image;
    for (auto& p : proposals) per_image.push_back(p.size(0));
    auto pred_boxes = decode_boxes(box_regression.to(at::kFloat), at::cat(proposals), o.bbox_reg_weights);
    if (pred_boxes.size(0) > 0) pred_boxes = pred_boxes.reshape({pred_boxes.size(0), -1, 4});
    else pred_boxes = pred_boxes.reshape({0, C, 4});
    auto pred_scores = at::softmax(class_logits.to(at::kFloat), -1);
    auto boxes_split = pred_boxes.split_with_sizes(per_image, 0);
    auto scores_split = pred_scores.split_with_sizes(per_image, 0);
    for (int64_t i = 0; i < N; ++i) {
      auto boxes = clip_boxes(boxes_split[size_t(i)], images.sizes[size_t(i)][0], images.sizes[size_t(i)][1]);
      auto scores = scores_split[size_t(i)];
      auto labels = at::arange(C, at::TensorOptions().dtype(at::kLong).device(dev)).view({1, -1}).expand_as(scores);
      boxes = boxes.slice(1, 1).reshape({-1, 4});
      scores = scores.slice(1, 1).reshape(-1);
      labels = labels.slice(1, 1).reshape(-1);
      auto inds = at::where(scores.gt(o.box_score_thresh))[0];
      boxes = boxes.index_select(0, inds), scores = scores.index_select(0, inds), labels = labels.index_select(0, inds);
      auto keep = remove_small(boxes, 1e-2);
      boxes = boxes.index_select(0, keep), scores = scores.index_select(0, keep), labels = labels.index_select(0, keep);
      keep = ops::batched_nms(boxes, scores, labels, o.box_nms_thresh).slice(0, 0, o.box_detections_per_img);
      res.detections.push_back({boxes.index_select(0, keep), scores.index_select(0, keep), labels.index_select(0, keep), {}});
    }
  }

  if (mask_) {
    std::vector<at::Tensor> mask_props, pos_matched;
    if (training) {
      for (int64_t i = 0; i < N; ++i) {
        auto pos = at::where(box_labels[size_t(i)].gt(0))[0];
        if (o.mask_rois_per_image > 0 && pos.numel() > o.mask_rois_per_image) {
          // a random subset of the positives (the first ones with deterministic sampling), kept in
          // their order
          const auto cpu = at::TensorOptions().dtype(at::kLong);
          at::Tensor pick;
          if (o.deterministic_sampling) pick = at::arange(o.mask_rois_per_image, cpu);
          else if (generator) pick = at::randperm(pos.numel(), *generator, cpu);
          else pick = at::randperm(pos.numel(), cpu);
          pick = std::get<0>(pick.slice(0, 0, o.mask_rois_per_image).sort());
          pos = pos.index_select(0, pick.to(pos.device()));
        }
        mask_props.push_back(proposals[size_t(i)].index_select(0, pos));
        pos_matched.push_back(matched_idxs[size_t(i)].index_select(0, pos));
      }
    } else {
      for (auto& d : res.detections) mask_props.push_back(d.boxes);
    }
    auto mf = multiscale_roi_align(levels4, mask_props, images.sizes, 14, o.mask_sampling_ratio, o.roi_aligned,
                                   o.roi_canonical_size);
    auto mask_logits = heads.mask_predictor->forward(heads.mask_head->size() ? heads.mask_head->forward(mf) : mf).to(at::kFloat);
    if (training) {  // maskrcnn_loss
      std::vector<at::Tensor> labels, mask_targets;
      const int64_t M = mask_logits.size(-1);
      for (int64_t i = 0; i < N; ++i) {
        const auto& t = (*targets)[size_t(i)];
        const auto& idxs = pos_matched[size_t(i)];
        if (t.labels.numel() == 0) {  // no gt: torchvision indexes an empty tensor; nothing is positive
          continue;
        }
        labels.push_back(t.labels.index_select(0, idxs));
        auto rois = at::cat({idxs.to(mask_props[size_t(i)].scalar_type()).unsqueeze(1), mask_props[size_t(i)]}, 1);
        auto gm = t.masks.unsqueeze(1).to(rois.scalar_type());
        if (o.mask_convention == RCNNOptions::MaskConvention::kTorchvision) {  // project_masks_on_boxes
          mask_targets.push_back(ops::roi_align(gm, rois, 1.0, M, M, -1, false).select(1, 0));
        } else {  // BitMasks.crop_and_resize (binarised for Detectron2's own)
          auto t = ops::roi_align(gm, rois, 1.0, M, M, 0, true).select(1, 0);
          if (o.mask_convention == RCNNOptions::MaskConvention::kDetectron2) t = t.ge(0.5).to(t.scalar_type());
          mask_targets.push_back(t);
        }
      }
      at::Tensor loss;
      const auto all_t = mask_targets.empty() ? at::Tensor() : at::cat(mask_targets);
      if (!all_t.defined() || all_t.numel() == 0) {
        loss = mask_logits.sum() * 0;
      } else {
        auto lab = at::cat(labels);
        auto picked = mask_logits.index({at::arange(lab.size(0), lab.options()), lab});
        loss = at::binary_cross_entropy_with_logits(picked, all_t);
      }
      res.losses.emplace_back("loss_mask", loss);
    } else {  // maskrcnn_inference
      auto prob = mask_logits.sigmoid();
      int64_t start = 0;
      for (auto& d : res.detections) {
        const int64_t n = d.labels.size(0);
        auto p = prob.narrow(0, start, n);
        d.masks = p.index({at::arange(n, d.labels.options()), d.labels}).unsqueeze(1);
        start += n;
      }
    }
  }
  for (auto& l : rpn_losses) res.losses.push_back(std::move(l));
  return res;
}

RCNNOptions::MaskConvention parse_mask_convention(const std::string& s) {
  using C = RCNNOptions::MaskConvention;
  if (s == "torchvision") return C::kTorchvision;
  if (s == "detectron2") return C::kDetectron2;
  if (s == "aligned") return C::kAligned;
  throw UserError(fmt::format("mask convention '{}': expected torchvision, detectron2 or aligned", s));
}

const char* mask_convention_name(RCNNOptions::MaskConvention c) {
  switch (c) {
    case RCNNOptions::MaskConvention::kDetectron2: return "detectron2";
    case RCNNOptions::MaskConvention::kAligned: return "aligned";
    default: return "torchvision";
  }
}

namespace {

// detectron2.layers.paste_masks_in_image as it runs on a CPU (one box at a time, skip_empty): the
// pixels from floor(x0) - 1 to ceil(x1) + 1 sample the mask by grid_sample (bilinear, zeros
// outside, align_corners=False) at their centres, mapped into the float box.
void paste_grid_sample(Detections& d, int64_t im_h, int64_t im_w, double threshold) {
  const auto masks = d.masks.to(at::kFloat);
  const int64_t n = masks.size(0);
  auto f = masks.options();
  auto out = at::zeros({n, 1, im_h, im_w}, threshold > 0 ? f.dtype(at::kByte) : f);
  const auto bx = d.boxes.to(at::kFloat).cpu().contiguous();
  auto acc = bx.accessor<float, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const float x0 = acc[i][0], y0 = acc[i][1], x1 = acc[i][2], y1 = acc[i][3];
    if (!(x1 > x0) || !(y1 > y0)) continue;  // no pixel centre maps into an empty box
    const int64_t xa = std::max<int64_t>(int64_t(std::floor(x0)) - 1, 0);
    const int64_t ya = std::max<int64_t>(int64_t(std::floor(y0)) - 1, 0);
    const int64_t xb = std::min<int64_t>(int64_t(std::ceil(x1)) + 1, im_w);
    const int64_t yb = std::min<int64_t>(int64_t(std::ceil(y1)) + 1, im_h);
    if (xb <= xa || yb <= ya) continue;
    // float32 throughout, in Detectron2's order of operations: (p + 0.5 - x0) / (x1 - x0) * 2 - 1
    auto gx = ((at::arange(xa, xb, f) + 0.5) - x0) / (x1 - x0) * 2 - 1;
    auto gy = ((at::arange(ya, yb, f) + 0.5) - y0) / (y1 - y0) * 2 - 1;
    const int64_t h = yb - ya, w = xb - xa;
    auto grid = at::stack({gx.unsqueeze(0).expand({h, w}), gy.unsqueeze(1).expand({h, w})}, 2).unsqueeze(0);
    auto m = at::grid_sampler(masks[i].unsqueeze(0), grid, /*bilinear*/ 0, /*zeros*/ 0, /*align_corners=*/false)[0][0];
    auto dst = out[i][0].slice(0, ya, yb).slice(1, xa, xb);
    if (threshold > 0) dst.copy_(m.ge(threshold));
    else dst.copy_(m);
  }
  d.masks = out;
}

}  // namespace

void postprocess(Detections& d, std::array<int64_t, 2> resized, std::array<int64_t, 2> original, double threshold,
                 RCNNOptions::MaskConvention convention) {
  auto f = at::TensorOptions().dtype(at::kFloat).device(d.boxes.device());
  auto rh = at::scalar_tensor(double(original[0]), f) / at::scalar_tensor(double(resized[0]), f);
  auto rw = at::scalar_tensor(double(original[1]), f) / at::scalar_tensor(double(resized[1]), f);
  auto b = d.boxes.unbind(1);
  d.boxes = at::stack({b[0] * rw, b[1] * rh, b[2] * rw, b[3] * rh}, 1);
  if (!d.masks.defined()) return;
  if (convention != RCNNOptions::MaskConvention::kTorchvision)
    return paste_grid_sample(d, original[0], original[1], threshold);
  // paste_masks_in_image(padding=1): expand_masks, expand_boxes, one interpolation per box
  const int64_t M = d.masks.size(-1), pad = 1;
  const double scale = double(M + 2 * pad) / double(M);
  auto masks = at::constant_pad_nd(d.masks, {pad, pad, pad, pad});
  auto bx = d.boxes;
  auto w_half = (bx.select(1, 2) - bx.select(1, 0)) * 0.5, h_half = (bx.select(1, 3) - bx.select(1, 1)) * 0.5;
  auto x_c = (bx.select(1, 2) + bx.select(1, 0)) * 0.5, y_c = (bx.select(1, 3) + bx.select(1, 1)) * 0.5;
  w_half = w_half * scale, h_half = h_half * scale;
  auto ib = at::stack({x_c - w_half, y_c - h_half, x_c + w_half, y_c + h_half}, 1).to(at::kLong).cpu();
  const int64_t im_h = original[0], im_w = original[1], n = masks.size(0);
  auto out = at::zeros({n, 1, im_h, im_w}, threshold > 0 ? masks.options().dtype(at::kByte) : masks.options());
  auto acc = ib.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x0b = acc[i][0], y0b = acc[i][1], x1b = acc[i][2], y1b = acc[i][3];
    const int64_t w = std::max<int64_t>(x1b - x0b + 1, 1), h = std::max<int64_t>(y1b - y0b + 1, 1);
    auto m = at::upsample_bilinear2d(masks[i].unsqueeze(0), {h, w}, false)[0][0];
    const int64_t x_0 = std::max<int64_t>(x0b, 0), x_1 = std::min<int64_t>(x1b + 1, im_w);
    const int64_t y_0 = std::max<int64_t>(y0b, 0), y_1 = std::min<int64_t>(y1b + 1, im_h);
    if (x_1 <= x_0 || y_1 <= y_0) continue;
    auto src = m.slice(0, y_0 - y0b, y_1 - y0b).slice(1, x_0 - x0b, x_1 - x0b);
    auto dst = out[i][0].slice(0, y_0, y_1).slice(1, x_0, x_1);
    if (threshold > 0) dst.copy_(src.gt(threshold));
    else dst.copy_(src);
  }
  d.masks = out;
}

const std::vector<std::string>& rcnn_names() {
  static const std::vector<std::string> n = [] {
    std::vector<std::string> v;
    for (auto& a : archs()) v.push_back(a.name);
    return v;
  }();
  return n;
}

bool rcnn_has_mask(const std::string& arch) { return find_arch(arch).mask; }

RCNNDefaults rcnn_defaults(const std::string& arch) { return find_arch(arch).defaults; }

GeneralizedRCNN create_rcnn(const std::string& arch, const RCNNOptions& o) { return GeneralizedRCNN(arch, o); }

std::string load_rcnn_weights(GeneralizedRCNNImpl& m, const io::SafeTensors& file, const std::string& prefix,
                              const std::string& what, const std::string& source) {
  io::SafeTensors st;
  for (auto& [k, v] : file.tensors)
    if (k.rfind(prefix, 0) == 0) st.tensors.emplace_back(k.substr(prefix.size()), v);
  bool detector = false;
  for (auto& [k, v] : st.tensors) detector = detector || k.rfind("backbone.", 0) == 0 || k.rfind("rpn.", 0) == 0;
  if (!detector) {  // a classifier's state dict: the FPN body (its head, fc.* / head.*, is not used)
    io::SafeTensors body;
    for (auto& [k, v] : st.tensors) {
      // the model keeps its own BN counters (below); a torch.save'd state dict has them too
      const bool counter = k.find("num_batches_tracked") != std::string::npos;
      // torchvision's mobilenet_v3_large keeps the body under features.N
      const std::string name = k.rfind("features.", 0) == 0 ? k.substr(9) : k;
      if (k.rfind("fc.", 0) != 0 && k.rfind("head.", 0) != 0 && k.rfind("classifier.", 0) != 0 && !counter)
        body.tensors.emplace_back("backbone.body." + name, v);
    }
    std::set<std::string> keep;  // everything outside the body keeps its initialisation
    for (auto& [k, v] : io::state_dict(m))
      if (k.rfind("backbone.body.", 0) != 0 || k.find("num_batches_tracked") != std::string::npos) keep.insert(k);
    io::load_state_dict(m, body, "", what, keep);
    return fmt::format("Loaded backbone weights from {} ({} tensors)", source, body.tensors.size());
  }
  // A whole detector: predictors of another class count keep their initialisation (as timm's
  // classifier reset); torchvision's frozen-BN files have no num_batches_tracked.
  std::set<std::string> keep;
  for (auto& [k, v] : io::state_dict(m)) {
    const at::Tensor* t = st.find(k);
    if (!t && k.find("num_batches_tracked") != std::string::npos) keep.insert(k);
    if (t && t->sizes() != v.sizes() &&
        (k.rfind("roi_heads.box_predictor.", 0) == 0 || k.rfind("roi_heads.mask_predictor.mask_fcn_logits", 0) == 0))
      keep.insert(k);
  }
  io::SafeTensors use;
  for (auto& [k, v] : st.tensors)
    if (!keep.count(k)) use.tensors.emplace_back(k, v);
  io::load_state_dict(m, use, "", what, keep);
  return fmt::format("Loaded detector weights from {}{}", source,
                     keep.empty() ? "" : fmt::format(" ({} tensors kept at their initialisation)", keep.size()));
}

}  // namespace imgtrain::model_zoo::detection

namespace imgtrain::model_zoo {

void register_detection(Registry<ModelEntry>& r) {
  using namespace detection;
  for (auto& a : archs()) {
    ModelEntry e;
    e.task = "detection";
    e.defaults.input_size = {3, int64_t(a.defaults.min_size), int64_t(a.defaults.max_size)};
    e.defaults.num_classes = 91;
    e.defaults.crop_pct = 1.0;
    e.defaults.first_conv = a.mobilenet() ? "backbone.body.0.0" : "backbone.body.conv1";
    e.defaults.classifier = "roi_heads.box_predictor";
    // channels-last with the fused kernels when training on the CPU in float32: measured faster for
    // fine-tuning (frozen body, 1.36x), from scratch (1.42x), the MobileNetV3 FPN (1.10x) and the
    // narrow CPU recipe (1.27x) (docs/performance.md, "Detectors train channels-last by default")
    e.cpu_training_nhwc_fused = true;
    e.cpu_training_fused = "BatchNorm fused with the residual add and activation, frozen BatchNorm folded";
    const std::string name = a.name;
    e.create_module = [name](const ModelArgs& ma) -> std::shared_ptr<torch::nn::Module> {
      RCNNOptions o;
      o.num_classes = ma.num_classes;
      return create_rcnn(name, o).ptr();
    };
    r.add(a.name, e);
  }
}

}  // namespace imgtrain::model_zoo
