#include "model_zoo/layers/layers.h"

#include "core/error.h"
#include "ops/norm_act.h"
#include "ops/depthwise.h"
#include "ops/se_gate.h"
#include "ops/winograd.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>

#include <cfenv>
#include <cmath>
#include <optional>

namespace imgtrain::model_zoo {

at::Tensor drop_path_scale(const at::Tensor& x, double p, bool training) {
  if (p == 0.0 || !training) return at::Tensor();
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  return torch::empty(shape, x.options()).bernoulli_(1.0 - p).div_(1.0 - p);
}

at::Tensor drop_path(const at::Tensor& x, double p, bool training) {
  const auto keep = drop_path_scale(x, p, training);
  return keep.defined() ? x * keep : x;
}

void trunc_normal_(at::Tensor t, double mean, double std, double a, double b) {
  torch::NoGradGuard ng;
  auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double l = cdf((a - mean) / std), u = cdf((b - mean) / std);
  // uniform_ returns its lower bound about once in 4 million draws; for the usual wide bounds
  // (timm's +-2 absolute with std .02 is +-100 sigma) erfinv(-1) = -inf would then put a weight at
  // the bound itself, as torch's own trunc_normal_ does. Sampling the open interval avoids it.
  t.uniform_(2 * l - 1, 2 * u - 1);
  if (t.scalar_type() == torch::kFloat32)
    t.clamp_(std::nextafter(float(2 * l - 1), 1.0f), std::nextafter(float(2 * u - 1), -1.0f));
  t.erfinv_().mul_(std * std::sqrt(2.0)).add_(mean).clamp_(a, b);
}

int64_t make_divisible(double v, int64_t divisor, int64_t min_value, double round_limit) {
  if (min_value <= 0) min_value = divisor;
  int64_t n = std::max(min_value, int64_t(v + double(divisor) / 2) / divisor * divisor);
  if (double(n) < round_limit * v) n += divisor;
  return n;
}

int64_t py_round(double v) { return int64_t(std::nearbyint(v)); }  // default FE_TONEAREST: ties to even

at::Tensor apply_act(at::Tensor x, Act a, bool inplace) {
  switch (a) {
    case Act::Identity: return x;
    case Act::ReLU: return inplace ? x.relu_() : x.relu();
    case Act::ReLU6: return inplace ? x.clamp_(0, 6) : x.clamp(0, 6);
    case Act::Swish: return inplace ? torch::silu_(x) : torch::silu(x);
    case Act::HardSwish: return inplace ? torch::hardswish_(x) : torch::hardswish(x);
    case Act::HardSigmoid: return inplace ? torch::hardsigmoid_(x) : torch::hardsigmoid(x);
    case Act::Sigmoid: return inplace ? x.sigmoid_() : x.sigmoid();
    case Act::GELU: return torch::gelu(x);
  }
  return x;
}

namespace {
bool static_same(int64_t k, int64_t stride, int64_t dilation) { return stride == 1 && (dilation * (k - 1)) % 2 == 0; }
torch::nn::Conv2dOptions conv_options(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t groups, bool bias,
                                      const std::string& pad_type, int64_t dilation) {
  int64_t pad = ((stride - 1) + dilation * (k - 1)) / 2;
  if (pad_type == "same") pad = static_same(k, stride, dilation) ? pad : 0;
  return torch::nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).dilation(dilation).groups(groups).bias(bias);
}
// TF 'same': total padding so that out = ceil(in / stride), the extra pixel on the bottom/right.
int64_t same_pad(int64_t size, int64_t k, int64_t s, int64_t d) {
  return std::max<int64_t>((int64_t(std::ceil(double(size) / double(s))) - 1) * s + (k - 1) * d + 1 - size, 0);
}
}  // namespace

ConvImpl::ConvImpl(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t groups, bool bias,
                   const std::string& pad_type, int64_t dilation)
    : torch::nn::Conv2dImpl(conv_options(in, out, k, stride, groups, bias, pad_type, dilation)),
      dynamic_same(pad_type == "same" && !static_same(k, stride, dilation)) {}

at::Tensor ConvImpl::pad_same(const at::Tensor& x) const {
  if (!dynamic_same) return x;
  const auto& o = options;
  const int64_t ph = same_pad(x.size(2), o.kernel_size()->at(0), o.stride()->at(0), o.dilation()->at(0));
  const int64_t pw = same_pad(x.size(3), o.kernel_size()->at(1), o.stride()->at(1), o.dilation()->at(1));
  return (ph || pw) ? torch::constant_pad_nd(x, {pw / 2, pw - pw / 2, ph / 2, ph - ph / 2}) : x;
}

at::Tensor ConvImpl::forward(const at::Tensor& x) {
  if (!dynamic_same) return torch::nn::Conv2dImpl::forward(x);
  return torch::nn::Conv2dImpl::forward(pad_same(x));
}

namespace {
// The kernel window [first, first + len) of both spatial dimensions, as a copy in the weight's
// memory format. Its gradient has the weight's shape and memory format, zero outside the window:
// narrow's own backward makes a contiguous (NCHW) one, which AccumulateGrad then copied into a
// channels-last weight's layout (3.3 ms of the README job's 132 ms step).
struct TrimWeight : torch::autograd::Function<TrimWeight> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& w, int64_t f0, int64_t l0,
                            int64_t f1, int64_t l1) {
    const auto format = w.suggest_memory_format();
    ctx->saved_data["window"] = std::vector<int64_t>{f0, l0, f1, l1};
    ctx->saved_data["sizes"] = w.sizes().vec();
    ctx->saved_data["channels_last"] = format == at::MemoryFormat::ChannelsLast;
    return w.narrow(2, f0, l0).narrow(3, f1, l1).contiguous(format);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list g) {
    const auto win = ctx->saved_data["window"].toIntVector();
    const auto format = ctx->saved_data["channels_last"].toBool() ? at::MemoryFormat::ChannelsLast
                                                                  : at::MemoryFormat::Contiguous;
    // (at::zeros takes no memory format)
    auto gw = at::empty(ctx->saved_data["sizes"].toIntVector(), g[0].options().memory_format(format)).zero_();
    gw.narrow(2, win[0], win[1]).narrow(3, win[2], win[3]).copy_(g[0]);
    return {gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor trimmed_conv2d(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  if (x.dim() != 4 || w.dim() != 4 || stride.size() != 2 || padding.size() != 2 || dilation.size() != 2) return {};
  int64_t first[2], len[2], pad[2], out[2];
  bool cut = false;
  for (int d = 0; d < 2; ++d) {
    const int64_t n = x.size(2 + d), k = w.size(2 + d), s = stride[d], p = padding[d], dl = dilation[d];
    if (s < 1 || dl < 1 || p < 0) return {};
    out[d] = (n + 2 * p - dl * (k - 1) - 1) / s + 1;
    if (out[d] < 1) return {};
    // taps that read an input row for some output row: o * s - p + i * dl in [0, n)
    int64_t lo = k, hi = -1;
    for (int64_t i = 0; i < k; ++i)
      for (int64_t o = 0; o < out[d]; ++o) {
        const int64_t r = o * s - p + i * dl;
        if (r >= 0 && r < n) {
          lo = std::min(lo, i), hi = std::max(hi, i);
          break;
        }
      }
    if (hi < 0) return {};  // every tap on padding: a degenerate shape, left to the convolution
    first[d] = lo, len[d] = hi - lo + 1, pad[d] = p - lo * dl;
    // the cut kernel with symmetric padding must give the same outputs at the same places
    if (pad[d] < 0 || (n + 2 * pad[d] - dl * (len[d] - 1) - 1) / s + 1 != out[d]) return {};
    cut = cut || len[d] < k;
  }
  if (!cut) return {};
  const auto wc = at::GradMode::is_enabled() && w.requires_grad()
                      ? TrimWeight::apply(w, first[0], len[0], first[1], len[1])
                      : w.narrow(2, first[0], len[0]).narrow(3, first[1], len[1]);
  if (groups == 1 && out[0] == 1 && out[1] == 1 && pad[0] == 0 && pad[1] == 0 && len[0] == x.size(2) &&
      len[1] == x.size(3) && dilation[0] == 1 && dilation[1] == 1) {
    // flattened in the order of the bytes: (h, w, c) where both are channels-last, so that neither
    // is copied by the reshape (nor the input's gradient on its way back)
    const auto cl = at::MemoryFormat::ChannelsLast;
    const bool nhwc = len[0] * len[1] > 1 && x.is_contiguous(cl) && !x.is_contiguous() && wc.is_contiguous(cl);
    const auto flat = [&](const at::Tensor& t) {
      return (nhwc ? t.permute({0, 2, 3, 1}) : t).reshape({t.size(0), -1});
    };
    return at::linear(flat(x), flat(wc), b).view({x.size(0), w.size(0), 1, 1});
  }
  return at::conv2d(x, wc, b, stride, {pad[0], pad[1]}, dilation, groups);
}

at::Tensor pointwise_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef stride,
                          at::IntArrayRef padding, int64_t groups) {
  if (!at::GradMode::is_enabled() || x.dim() != 4 || w.dim() != 4 || !x.device().is_cpu() ||
      x.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat || at::autocast::is_autocast_enabled(at::kCPU))
    return {};
  if (w.size(2) != 1 || w.size(3) != 1 || groups != 1 || w.size(1) != x.size(1) || stride.size() != 2 ||
      padding.size() != 2 || stride[0] != stride[1] || stride[0] < 1 || stride[0] > 2 || padding[0] != 0 ||
      padding[1] != 0)
    return {};
  const int64_t s = stride[0];
  const int64_t ho = (x.size(2) - 1) / s + 1, wo = (x.size(3) - 1) / s + 1;
  if (ho * wo > kPointwiseGemmMaxPixels || !x.is_contiguous(at::MemoryFormat::ChannelsLast)) return {};
  // [N, H, W, Cin] (a view: channels-last memory; at stride 2 every other row and column, which
  // at::linear gathers) times W^T: [N, Ho, Wo, Cout], seen as channels-last NCHW
  auto xp = x.permute({0, 2, 3, 1});
  if (s > 1) xp = xp.slice(1, 0, std::nullopt, s).slice(2, 0, std::nullopt, s);
  return at::linear(xp, w.reshape({w.size(0), w.size(1)}), b).permute({0, 3, 1, 2});
}

namespace {
// oneDNN's fused convolution ops (the ones torch.compile's CPU backend emits for conv + pointwise),
// looked up once; absent from a LibTorch built without oneDNN, and then nothing is fused on the CPU.
const std::optional<c10::OperatorHandle>& pointwise_op(bool binary) {
  static const auto unary = c10::Dispatcher::singleton().findSchema({"mkldnn::_convolution_pointwise", ""});
  static const auto bin = c10::Dispatcher::singleton().findSchema({"mkldnn::_convolution_pointwise", "binary"});
  return binary ? bin : unary;
}
// Its in-place twin: other = act(conv(x) + other), summed into `other`'s memory. The out-of-place
// op copies `other` first (torch 2.11), ~30% of a ResNet-50 inference step at 2x512 px.
const std::optional<c10::OperatorHandle>& pointwise_inplace_op() {
  static const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_convolution_pointwise_", "binary"});
  return op;
}
// A residual given to conv_bn_act by value that nothing else can read: this one handle (the caller
// moved its own in) on a storage no view shares. Only then may it be overwritten.
bool sole_owner(const at::Tensor& t) {
  return t.use_count() == 1 && t.storage().use_count() == 1 && t.storage_offset() == 0 && !t.requires_grad();
}
// The post-op of an activation: oneDNN's name, its scalars and algorithm; nullopt where oneDNN has
// none (hard sigmoid), and the activation then runs after the convolution.
struct PostOp {
  std::string attr;
  std::vector<double> scalars;
  std::string algorithm;
};
std::optional<PostOp> post_op(Act a) {
  switch (a) {
    case Act::Identity: return PostOp{"none", {}, ""};
    case Act::ReLU: return PostOp{"relu", {}, ""};
    case Act::ReLU6: return PostOp{"hardtanh", {0.0, 6.0}, ""};
    case Act::Swish: return PostOp{"swish", {}, ""};
    case Act::HardSwish: return PostOp{"hardswish", {}, ""};
    case Act::Sigmoid: return PostOp{"sigmoid", {}, ""};
    case Act::GELU: return PostOp{"gelu", {}, "none"};
    case Act::HardSigmoid: return std::nullopt;
  }
  return std::nullopt;
}

bool fusable(const torch::nn::Conv2dImpl& conv, const imgtrain::BatchNorm2dImpl& bn, const at::Tensor& x) {
  if (!bn.fuse_inference || bn.is_training() || c10::GradMode::is_enabled()) return false;
  if (x.scalar_type() != at::kFloat || x.dim() != 4 || at::autocast::is_autocast_enabled(x.device().type())) return false;
  if (!std::holds_alternative<torch::ExpandingArray<2>>(conv.options.padding())) return false;
  if (!std::holds_alternative<torch::enumtype::kZeros>(conv.options.padding_mode())) return false;
  return bn.running_mean.defined() && bn.running_var.defined();
}

std::vector<int64_t> vec(const torch::ExpandingArray<2>& a) { return {a->at(0), a->at(1)}; }

// A dense 3x3 convolution in training with autograd through imgtrain's path (ops::dense_conv_train:
// the weight gradient as GEMMs, Winograd at stride 1), where it applies and the weight (the
// module's, or one folded from it) takes a gradient; else undefined.
at::Tensor dense_train(const at::Tensor& in, const at::Tensor& w, const at::Tensor& b, const std::vector<int64_t>& stride,
                       const std::vector<int64_t>& padding, const std::vector<int64_t>& dilation, int64_t groups) {
  if (!at::GradMode::is_enabled() || !w.requires_grad() || at::autocast::is_autocast_enabled(at::kCPU) ||
      stride[0] != stride[1] || padding[0] != padding[1] || dilation[0] != dilation[1] ||
      !ops::dense_conv_supported(in, w, stride[0], padding[0], dilation[0], groups))
    return {};
  return ops::dense_conv_train(in, w, b, stride[0], padding[0]);
}

// Whether inference runs this convolution by Winograd's F(2x2, 3x3) or F(4x4, 3x3) (ops/winograd.h)
// on channels-last float32 inputs: 3x3, stride 1, padding 1, no dilation or groups, and at least 32
// channels in and out (at 16 oneDNN's direct convolution was faster: bench/winograd_parts.cpp)
bool winograd_shape(const torch::nn::Conv2dImpl& conv, const ConvImpl* zconv, const std::vector<int64_t>& padding,
                    const std::vector<int64_t>& stride, const std::vector<int64_t>& dilation) {
  const auto& w = conv.weight;
  return !zconv && w.dim() == 4 && w.size(2) == 3 && w.size(3) == 3 && w.size(0) >= 32 && w.size(1) >= 32 &&
         conv.options.groups() == 1 && padding == std::vector<int64_t>{1, 1} && stride == std::vector<int64_t>{1, 1} &&
         dilation == std::vector<int64_t>{1, 1} && w.scalar_type() == at::kFloat && w.device().is_cpu();
}

// A plain 3x3 stride-1 convolution in inference without autograd (a detector's FPN, RPN and mask
// head: no BatchNorm to fold, so no conv_bn_act) by Winograd where winograd_shape says, the filters
// packed in float32 on each call (the weights may change between calls: evaluation during
// training); else undefined.
at::Tensor dense_infer(torch::nn::Conv2dImpl& conv, const ConvImpl* zconv, const at::Tensor& in,
                       const std::vector<int64_t>& padding, const std::vector<int64_t>& stride) {
  const auto& w = conv.weight;
  const auto& b = conv.bias;
  if (at::GradMode::is_enabled() || at::autocast::is_autocast_enabled(at::kCPU) || in.dim() != 4 ||
      !winograd_shape(conv, zconv, padding, stride, vec(conv.options.dilation())) ||
      (b.defined() && (b.scalar_type() != at::kFloat || !b.device().is_cpu())))
    return {};
  const int tile = ops::winograd_tile(in.size(0), in.size(2), in.size(3), w.size(1), w.size(0));
  const auto U = ops::winograd_pack_3x3_train(w, false, tile);
  if (!ops::winograd_conv3x3_supported(in, U)) return {};
  return ops::winograd_conv3x3(in, U, b.defined() ? b.contiguous() : at::Tensor(), false);
}

// The module's convolution: in training a GEMM (pointwise_gemm), else trimmed (trimmed_conv2d),
// imgtrain's depthwise training path (depthwise_train) or, in training, the dense one
// (ops::dense_conv_train), in inference with infer_kernels Winograd's (dense_infer), where one applies.
at::Tensor conv_forward(torch::nn::Conv2dImpl& conv, ConvImpl* zconv, const at::Tensor& x, bool infer_kernels = false) {
  const auto& o = conv.options;
  if (std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) &&
      std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode())) {
    auto in = zconv ? zconv->pad_same(x) : x;
    const auto stride = vec(o.stride()), padding = vec(std::get<torch::ExpandingArray<2>>(o.padding()));
    if (conv.is_training()) {  // eval keeps oneDNN's convolution, with or without autograd
      auto y = pointwise_gemm(in, conv.weight, conv.bias, stride, padding, o.groups());
      if (y.defined()) return y;
    }
    auto y = trimmed_conv2d(in, conv.weight, conv.bias, stride, padding, vec(o.dilation()), o.groups());
    if (y.defined()) return y;
    if (auto d = depthwise_train(conv, in); d.defined()) return d;
    if (conv.is_training()) {
      if (auto d = dense_train(in, conv.weight, conv.bias, stride, padding, vec(o.dilation()), o.groups()); d.defined())
        return d;
    } else if (infer_kernels) {
      if (auto d = dense_infer(conv, zconv, in, padding, stride); d.defined()) return d;
    }
  }
  return zconv ? zconv->forward(x) : conv.forward(x);
}

}  // namespace

at::Tensor conv_module_forward(torch::nn::Conv2dImpl& conv, const at::Tensor& x, bool infer_kernels) {
  return conv_forward(conv, dynamic_cast<ConvImpl*>(&conv), x, infer_kernels);
}

at::Tensor depthwise_train(torch::nn::Conv2dImpl& conv, const at::Tensor& x) {
  const auto& o = conv.options;
  const auto& w = conv.weight;
  // the cheap tests first: this runs for every convolution of a training step
  if (!conv.is_training() || o.groups() == 1 || w.dim() != 4 || w.size(1) != 1 || w.size(2) < 5 ||
      !at::GradMode::is_enabled() || !std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) ||
      !std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()))
    return {};
  const auto stride = vec(o.stride()), pad = vec(std::get<torch::ExpandingArray<2>>(o.padding()));
  const auto dil = vec(o.dilation());
  if (stride[0] != stride[1] || pad[0] != pad[1] || dil[0] != dil[1] ||
      !ops::depthwise_conv_supported(x, w, stride[0], pad[0], dil[0], o.groups()))
    return {};
  return ops::depthwise_conv_train(x, w, conv.bias, stride[0], pad[0]);
}

namespace {

// Training fusion: act(bn(y) + residual) as one kernel when bn asks for it (set_training_fusion)
// and the kernel takes the input; else undefined and the caller runs the modules. The running
// statistics and num_batches_tracked move exactly as torch's BatchNorm2d moves them.
at::Tensor train_fused(imgtrain::BatchNorm2dImpl& bn, const at::Tensor& y, Act act, const at::Tensor& residual) {
  if (!bn.fuse_train || !bn.is_training() || bn.frozen || bn.sync || !bn.weight.defined() || !bn.bias.defined() ||
      !bn.options.track_running_stats() || !bn.running_mean.defined())
    return {};
  ops::NormAct a;
  switch (act) {
    case Act::Identity: a = ops::NormAct::None; break;
    case Act::ReLU: a = ops::NormAct::ReLU; break;
    case Act::ReLU6: a = ops::NormAct::ReLU6; break;
    case Act::Swish: a = ops::NormAct::SiLU; break;
    case Act::HardSwish: a = ops::NormAct::HardSwish; break;
    default: return {};
  }
  if (!ops::batch_norm_act_supported(y, residual) || bn.weight.scalar_type() != y.scalar_type()) return {};
  double momentum;
  {
    at::NoGradGuard no_grad;  // the counter moves outside autograd, as in torch
    bn.num_batches_tracked.add_(1);
    momentum = bn.options.momentum() ? *bn.options.momentum() : 1.0 / double(bn.num_batches_tracked.item<int64_t>());
  }
  return ops::batch_norm_act_train(y, bn.weight, bn.bias, bn.running_mean, bn.running_var, momentum,
                                   bn.options.eps(), a, residual);
}

// Training fusion of a frozen BatchNorm (torchvision's FrozenBatchNorm2d: constants): folded into
// the convolution, act(conv(x, w * scale, bias * scale + shift) + residual), so that neither the
// forward's two passes over the output (x * scale + shift) nor the backward's one run. The gradient
// reaches the convolution's weight through w * scale. Undefined where the convolution's padding is
// not a plain size; the caller then runs the modules.
at::Tensor frozen_folded(torch::nn::Conv2dImpl& conv, imgtrain::BatchNorm2dImpl& bn, const at::Tensor& input, Act act,
                         const at::Tensor& residual) {
  if (!bn.fuse_train || !bn.frozen || !bn.weight.defined() || !bn.bias.defined() || !bn.running_mean.defined())
    return {};
  if (!std::holds_alternative<torch::ExpandingArray<2>>(conv.options.padding())) return {};
  if (!std::holds_alternative<torch::enumtype::kZeros>(conv.options.padding_mode())) return {};
  at::Tensor scale, shift;
  {
    at::NoGradGuard no_grad;  // constants, as FrozenBatchNorm2d's buffers
    scale = bn.weight * (bn.running_var + bn.frozen_eps).rsqrt();
    shift = bn.bias - bn.running_mean * scale;
  }
  auto w = conv.weight * scale.reshape({-1, 1, 1, 1});
  auto b = conv.bias.defined() ? conv.bias * scale + shift : shift;
  const auto& o = conv.options;
  const auto stride = vec(o.stride()), padding = vec(std::get<torch::ExpandingArray<2>>(o.padding())),
             dilation = vec(o.dilation());
  auto y = trimmed_conv2d(input, w, b, stride, padding, dilation, o.groups());
  if (!y.defined() && conv.is_training()) y = dense_train(input, w, b, stride, padding, dilation, o.groups());
  if (!y.defined()) y = at::conv2d(input, w, b, stride, padding, dilation, o.groups());
  if (residual.defined()) y.add_(residual);
  return apply_act(y, act, true);
}

}  // namespace

at::Tensor conv_bn_act(torch::nn::Conv2dImpl& conv, imgtrain::BatchNorm2dImpl& bn, const at::Tensor& x, Act act,
                       at::Tensor residual) {
  auto* zconv = dynamic_cast<ConvImpl*>(&conv);
  if (!fusable(conv, bn, x)) {
    if (auto folded = frozen_folded(conv, bn, zconv ? zconv->pad_same(x) : x, act, residual); folded.defined())
      return folded;
    auto y = conv_forward(conv, zconv, x);
    if (auto fused = train_fused(bn, y, act, residual); fused.defined()) return fused;
    y = bn.forward(y);
    if (residual.defined()) y.add_(residual);
    return apply_act(y, act, true);
  }
  const auto& o = conv.options;
  const auto padding = vec(std::get<torch::ExpandingArray<2>>(o.padding()));
  const auto stride = vec(o.stride()), dilation = vec(o.dilation());
  const auto input = zconv ? zconv->pad_same(x) : x;
  const bool onednn = input.device().is_cpu() && pointwise_op(false) && pointwise_op(true);
  if (!bn.folded_weight.defined()) {  // fold once: the caches live until set_inference_fusion
    const double eps = bn.frozen ? bn.frozen_eps : bn.options.eps();
    auto scale = (bn.running_var + eps).rsqrt();
    if (bn.weight.defined()) scale = scale * bn.weight;
    auto shift = -bn.running_mean * scale;
    if (bn.bias.defined()) shift = shift + bn.bias;
    if (conv.bias.defined()) shift = shift + conv.bias * scale;
    auto w = (conv.weight * scale.reshape({-1, 1, 1, 1})).contiguous(conv.weight.suggest_memory_format());
    // F(4x4, 3x3) or F(2x2, 3x3) chosen for the first input's shape (other shapes still work)
    if (onednn && winograd_shape(conv, zconv, padding, stride, dilation) && input.dim() == 4)
      bn.winograd_weight = ops::winograd_pack_3x3(
          w, ops::winograd_tile(input.size(0), input.size(2), input.size(3), w.size(1), w.size(0)));
    // oneDNN's own weight layout for this convolution, made once (for the first input's shape;
    // other shapes still work) instead of on every call: +10-45% on EfficientNet-B0 and
    // MobileNetV3 at batch 8 against dense weights (docs/performance.md)
    if (onednn) {
      static const auto reorder = c10::Dispatcher::singleton().findSchema({"mkldnn::_reorder_convolution_weight", ""});
      if (reorder) {
        torch::jit::Stack st{w, padding, stride, dilation, o.groups(), input.sizes().vec()};
        reorder->callBoxed(&st);
        w = st[0].toTensor();
      }
    }
    bn.folded_weight = w;
    bn.folded_bias = shift.contiguous();
  }
  if (!onednn) {
    auto y = at::conv2d(input, bn.folded_weight, bn.folded_bias, stride, padding, dilation, o.groups());
    if (residual.defined()) y.add_(residual);
    return apply_act(y, act, true);
  }
  // 3x3 stride-1 convolutions of channels-last float32 maps (and residuals): Winograd's F(2x2, 3x3),
  // 1.2-1.8x oneDNN's direct convolution at ResNet's widths (docs/performance.md)
  if (bn.winograd_weight.defined() && (act == Act::Identity || act == Act::ReLU) &&
      ops::winograd_conv3x3_supported(input, bn.winograd_weight, residual)) {
    const bool in_place = residual.defined() && sole_owner(residual);
    return ops::winograd_conv3x3(input, bn.winograd_weight, bn.folded_bias, act == Act::ReLU, residual, in_place);
  }
  const auto post = post_op(act);
  // oneDNN's fused add fails ("could not create a memory") when the maps are 1x1 (NCHW and NHWC
  // then describe the same bytes): there the add and activation run after the convolution.
  auto ambiguous = [](const at::Tensor& t) {
    return t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
  };
  if (residual.defined() && (ambiguous(input) || ambiguous(residual))) {
    torch::jit::Stack st{input, bn.folded_weight, bn.folded_bias, padding, stride, dilation, o.groups(),
                         std::string("none"), c10::List<std::optional<at::Scalar>>(), std::string()};
    pointwise_op(false)->callBoxed(&st);
    return apply_act(st[0].toTensor().add_(residual), act, true);
  }
  const bool act_fused = post && (!residual.defined() || act == Act::Identity || act == Act::ReLU);
  const std::string attr = act_fused ? post->attr : "none";
  c10::List<std::optional<at::Scalar>> scalars;
  if (act_fused)
    for (double v : post->scalars) scalars.push_back(at::Scalar(v));
  const std::string algorithm = act_fused ? post->algorithm : "";
  at::Tensor y;
  if (residual.defined() && (act == Act::Identity || act == Act::ReLU) && pointwise_inplace_op() &&
      sole_owner(residual) && residual.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    torch::jit::Stack st{residual, input, bn.folded_weight, bn.folded_bias, padding, stride, dilation, o.groups(),
                         std::string("add"), c10::IValue(), act == Act::ReLU ? c10::IValue(std::string("relu")) : c10::IValue(),
                         c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    residual.reset();  // the stack's handle is the only one while the op writes
    pointwise_inplace_op()->callBoxed(&st);
    return st[0].toTensor();
  }
  if (residual.defined()) {
    // other = residual, binary "add", then the unary post-op (oneDNN takes ReLU or none there)
    torch::jit::Stack st{input, residual, bn.folded_weight, bn.folded_bias, padding, stride, dilation, o.groups(),
                         std::string("add"), c10::IValue(), attr == "none" ? c10::IValue() : c10::IValue(attr),
                         c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    pointwise_op(true)->callBoxed(&st);
    y = st[0].toTensor();
  } else {
    torch::jit::Stack st{input, bn.folded_weight, bn.folded_bias, padding, stride, dilation, o.groups(), attr, scalars,
                         algorithm};
    pointwise_op(false)->callBoxed(&st);
    y = st[0].toTensor();
  }
  return act_fused ? y : apply_act(y, act, true);
}

namespace {
const std::optional<c10::OperatorHandle>& linear_op(bool binary) {
  static const auto unary = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  static const auto bin = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", "binary"});
  return binary ? bin : unary;
}
}  // namespace

namespace {
// Whether a convolution with these options and a k x k kernel pads nothing: zeros given, or
// 'valid'; 'same' pads nothing only for a 1x1 kernel
bool pads_nothing(const torch::nn::detail::ConvNdOptions<2>& o, int64_t k) {
  if (const auto* pad = std::get_if<torch::ExpandingArray<2>>(&o.padding())) return !(*pad)->at(0) && !(*pad)->at(1);
  return std::holds_alternative<torch::enumtype::kValid>(o.padding()) || k == 1;
}
}  // namespace

at::Tensor pooled_conv1x1(const torch::nn::Conv2dImpl& conv, const at::Tensor& pooled) {
  const auto& w = conv.weight;
  const auto& o = conv.options;
  if (c10::GradMode::is_enabled() || pooled.dim() != 2 || !pooled.device().is_cpu() ||
      pooled.scalar_type() != at::kFloat || w.scalar_type() != at::kFloat || at::autocast::is_autocast_enabled(at::kCPU))
    return {};
  if (w.dim() != 4 || w.size(2) != 1 || w.size(3) != 1 || w.size(1) != pooled.size(1) || o.groups() != 1 ||
      o.stride()->at(0) != 1 || o.stride()->at(1) != 1)
    return {};
  if (!pads_nothing(o, 1)) return {};
  return at::linear(pooled, w.view({w.size(0), w.size(1)}), conv.bias);
}

bool linear_fusable(const at::Tensor& x) {
  return !c10::GradMode::is_enabled() && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
         !at::autocast::is_autocast_enabled(at::kCPU) && linear_op(false) && linear_op(true);
}

namespace {
const at::Tensor& packed_weight(const at::Tensor& w, int64_t rows, LinearPack* pack) {
  if (!pack) return w;
  if (pack->packed.defined() && pack->from.matches(w)) return pack->packed;
  static const auto reorder = c10::Dispatcher::singleton().findSchema({"mkldnn::_reorder_linear_weight", ""});
  if (!reorder) return w;
  torch::jit::Stack st{w.detach(), rows};
  reorder->callBoxed(&st);
  pack->packed = st[0].toTensor();
  pack->from.take(w);
  return pack->packed;
}
int64_t rows_of(const at::Tensor& x) { return x.numel() / std::max<int64_t>(x.size(-1), 1); }
}  // namespace

at::Tensor linear_act(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, Act act, LinearPack* pack) {
  const auto post = post_op(act);
  if (!post || !linear_fusable(x) || act == Act::HardSwish || act == Act::ReLU6)  // oneDNN linear: not these
    return apply_act(at::linear(x, w, b), act, true);
  c10::List<std::optional<at::Scalar>> scalars;
  for (double v : post->scalars) scalars.push_back(at::Scalar(v));
  torch::jit::Stack st{x.contiguous(), packed_weight(w, rows_of(x), pack), b, post->attr, scalars,
                       post->algorithm.empty() ? c10::IValue() : c10::IValue(post->algorithm)};
  linear_op(false)->callBoxed(&st);
  return st[0].toTensor();
}

at::Tensor linear_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& residual,
                      LinearPack* pack) {
  if (!linear_fusable(x) || residual.scalar_type() != at::kFloat) return at::linear(x, w, b) + residual;
  torch::jit::Stack st{x.contiguous(), residual.contiguous(), packed_weight(w, rows_of(x), pack), b,
                       std::string("add")};
  linear_op(true)->callBoxed(&st);
  return st[0].toTensor();
}

at::Tensor patch_conv_linear(const torch::nn::Conv2dImpl& conv, const at::Tensor& x, PatchLinearCache* cache) {
  const auto& w = conv.weight;
  const auto& o = conv.options;
  if (!linear_fusable(x) || x.dim() != 4 || x.numel() == 0 || w.dim() != 4 || w.scalar_type() != at::kFloat ||
      o.groups() != 1 || w.size(1) != x.size(1))
    return {};
  const int64_t k = w.size(2);
  if (w.size(3) != k || o.stride()->at(0) != k || o.stride()->at(1) != k || o.dilation()->at(0) != 1 ||
      o.dilation()->at(1) != 1 || x.size(2) % k || x.size(3) % k)
    return {};
  if (!pads_nothing(o, k)) return {};
  const int64_t n = x.size(0), c = x.size(1), ho = x.size(2) / k, wo = x.size(3) / k;
  const bool cl = !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
  if (!cache->weight.defined() || !cache->from.matches(w) || cache->channels_last != cl) {
    at::NoGradGuard no_grad;
    cache->weight = cl ? w.permute({0, 2, 3, 1}).reshape({w.size(0), -1}).contiguous()
                       : w.reshape({w.size(0), -1}).contiguous();
    cache->channels_last = cl;
    cache->from.take(w);
  }
  const auto patches =
      cl ? x.permute({0, 2, 3, 1}).view({n, ho, k, wo, k, c}).permute({0, 1, 3, 2, 4, 5}).reshape({n * ho * wo, -1})
         : x.contiguous().view({n, c, ho, k, wo, k}).permute({0, 2, 4, 1, 3, 5}).reshape({n * ho * wo, -1});
  return linear_act(patches, cache->weight, conv.bias, Act::Identity, &cache->pack)
      .view({n, ho, wo, w.size(0)})
      .permute({0, 3, 1, 2});
}

at::Tensor patch_conv(torch::nn::Conv2dImpl& conv, const at::Tensor& x, PatchLinearCache* cache, bool fuse) {
  if (fuse)
    if (auto y = patch_conv_linear(conv, x, cache); y.defined()) return y;
  return conv.forward(x);
}

ConvBnActImpl::ConvBnActImpl(int64_t in, int64_t out, int64_t k, int64_t stride, Act act_, const std::string& pad_type,
                             double bn_eps, bool skip, double drop_path_rate)
    : act(act_), has_skip(skip && stride == 1 && in == out), dpr(drop_path_rate) {
  conv = register_module("conv", Conv(in, out, k, stride, 1, false, pad_type));
  bn1 = register_module("bn1", imgtrain::BatchNorm2d(torch::nn::BatchNormOptions(out).eps(bn_eps)));
}

at::Tensor ConvBnActImpl::forward(at::Tensor x) {
  auto shortcut = x;
  x = conv_bn_act(*conv, *bn1, x, act);
  return has_skip ? drop_path(x, dpr, is_training()).add_(shortcut) : x;
}

SqueezeExciteImpl::SqueezeExciteImpl(int64_t channels, int64_t reduced, Act act_, Act gate_) : act(act_), gate(gate_) {
  conv_reduce = register_module("conv_reduce", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, reduced, 1)));
  conv_expand = register_module("conv_expand", torch::nn::Conv2d(torch::nn::Conv2dOptions(reduced, channels, 1)));
}

at::Tensor SqueezeExciteImpl::forward(const at::Tensor& x) {
  if (fuse_train && is_training() && at::GradMode::is_enabled() && ops::se_gate_supported(x, conv_reduce->weight)) {
    std::optional<ops::SeAct> a;
    switch (act) {
      case Act::ReLU: a = ops::SeAct::ReLU; break;
      case Act::ReLU6: a = ops::SeAct::ReLU6; break;
      case Act::Swish: a = ops::SeAct::SiLU; break;
      case Act::HardSwish: a = ops::SeAct::HardSwish; break;
      case Act::GELU: a = ops::SeAct::GELU; break;
      default: break;
    }
    if (a && (gate == Act::Sigmoid || gate == Act::HardSigmoid))
      return ops::se_gate_train(x, conv_reduce->weight, conv_reduce->bias, conv_expand->weight, conv_expand->bias, *a,
                                gate == Act::Sigmoid ? ops::SeGate::Sigmoid : ops::SeGate::HardSigmoid);
  }
  if (fuse_infer && !is_training() && x.dim() == 4) {
    const auto pooled = x.mean({2, 3});
    if (auto s = pooled_conv1x1(*conv_reduce, pooled); s.defined())
      if (auto e = pooled_conv1x1(*conv_expand, apply_act(s, act, true)); e.defined())
        return x * apply_act(e, gate, true).view({x.size(0), x.size(1), 1, 1});
  }
  auto s = conv_expand(apply_act(conv_reduce(x.mean({2, 3}, /*keepdim=*/true)), act, true));
  return x * apply_act(s, gate, true);
}

LayerNorm2dImpl::LayerNorm2dImpl(int64_t channels, double eps)
    : torch::nn::LayerNormImpl(torch::nn::LayerNormOptions({channels}).eps(eps)) {}

at::Tensor LayerNorm2dImpl::forward(const at::Tensor& x) {
  return torch::nn::LayerNormImpl::forward(x.permute({0, 2, 3, 1})).permute({0, 3, 1, 2});
}

at::Tensor global_pool(const at::Tensor& x, const std::string& type, bool keepdim) {
  if (type == "avg") return x.mean({2, 3}, keepdim);
  auto mx = x.amax({2, 3}, keepdim);
  if (type == "max") return mx;
  auto avg = x.mean({2, 3}, keepdim);
  if (type == "avgmax") return (avg + mx) * 0.5;
  return torch::cat({avg, mx}, 1);  // catavgmax
}

int64_t pool_feat_mult(const std::string& type) { return type == "catavgmax" ? 2 : 1; }

std::string resolve_global_pool(const std::string& model, const std::string& requested, const std::string& dflt,
                                const std::vector<std::string>& supported, const std::string& from) {
  const std::string t = requested.empty() ? dflt : requested;
  if (std::find(supported.begin(), supported.end(), t) == supported.end()) {
    std::string list;
    for (auto& s : supported) list += (list.empty() ? "" : ", ") + s;
    throw UserError(fmt::format("{} '{}': {} supports {}", from, t, model, list));
  }
  return t;
}

void init_weights_goog(torch::nn::Module& root) {
  torch::NoGradGuard ng;
  for (auto& m : root.modules(/*include_self=*/false)) {
    if (auto* c = m->as<torch::nn::Conv2dImpl>()) {
      const auto& k = *c->options.kernel_size();
      const double fan_out = double(k[0] * k[1] * c->options.out_channels()) / double(c->options.groups());
      c->weight.normal_(0.0, std::sqrt(2.0 / fan_out));
      if (c->bias.defined()) c->bias.zero_();
    } else if (auto* b = m->as<torch::nn::BatchNorm2dImpl>()) {
      b->weight.fill_(1.0);
      b->bias.zero_();
    } else if (auto* l = m->as<torch::nn::LinearImpl>()) {
      const double r = 1.0 / std::sqrt(double(l->weight.size(0)));
      l->weight.uniform_(-r, r);
      l->bias.zero_();
    }
  }
}

}  // namespace imgtrain::model_zoo
