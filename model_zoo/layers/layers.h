// Shared building blocks used by several model families (timm/layers): stochastic depth,
// initialisers, channel rounding, activations, convolutions with timm's padding rules (including
// TF 'same'), squeeze-and-excite, and layer norm over the channels of NCHW tensors.
#pragma once
#include <torch/nn/module.h>
#include "core/batch_norm.h"
#include <ATen/ops/linear.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

namespace imgtrain::model_zoo {

// Stochastic depth per sample (timm's drop_path): in training, zero whole samples of the residual
// branch with probability p and scale the survivors by 1 / (1 - p).
at::Tensor drop_path(const at::Tensor& x, double p, bool training);
// drop_path's per-sample factor ([N, 1, ...], 0 or 1 / (1 - p), drawn as drop_path draws it), or
// undefined where drop_path returns x as it is.
at::Tensor drop_path_scale(const at::Tensor& x, double p, bool training);

// torch.nn.init.trunc_normal_ (inverse-CDF sampling): normal(mean, std) truncated to [a, b],
// except that no sample lands exactly on a bound far out in the tails (see layers.cpp).
void trunc_normal_(at::Tensor t, double mean, double std, double a, double b);

// timm's make_divisible: nearest multiple of `divisor`, at least min_value (default divisor), and
// never more than 10% below v.
int64_t make_divisible(double v, int64_t divisor = 8, int64_t min_value = 0, double round_limit = 0.9);
// Python's round() on a double (halves to even), which timm uses for some channel counts.
int64_t py_round(double v);

// Activations by timm's names; `inplace` where timm's layer is in place.
enum class Act { Identity, ReLU, ReLU6, Swish, HardSwish, HardSigmoid, Sigmoid, GELU };
at::Tensor apply_act(at::Tensor x, Act a, bool inplace = false);

// A Conv2d created as timm's create_conv2d(padding=pad_type) creates it: pad_type "" is symmetric
// padding ((stride - 1) + dilation * (k - 1)) / 2; "same" is TF 'same' padding, static when
// stride 1 makes it symmetric, otherwise computed per input (timm's Conv2dSame). The parameters
// are `weight` (and `bias`), as timm's.
struct ConvImpl : torch::nn::Conv2dImpl {
  ConvImpl(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t groups = 1, bool bias = false,
           const std::string& pad_type = "", int64_t dilation = 1);
  at::Tensor forward(const at::Tensor& x);
  // The input padded as TF 'same' asks for this size (x itself when the padding is static).
  at::Tensor pad_same(const at::Tensor& x) const;
  bool dynamic_same = false;
};
TORCH_MODULE(Conv);

// A zero-padded convolution in which some kernel rows or columns meet only padding, for every
// output (a 3x3 kernel over 1x1 maps: only its centre tap sees the input), run with those taps cut
// away: the same sums without the products with zeros. Where the kept window is the whole input and
// gives one output pixel it is a Linear over the flattened input (a ResNet's last stage at
// 28 px: 13.9 ms -> 3.4 ms per 3x3 convolution, forward and backward). The gradient of a cut tap
// is exactly zero, as it is through the full kernel. Undefined where no tap can be cut (then run
// the convolution as it is). Float rounding may differ from the full kernel (other summation order).
at::Tensor trimmed_conv2d(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef stride,
                          at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// A 1x1 convolution (stride 1 or 2, no padding, one group) in training (autograd on) over a
// channels-last float32 CPU map giving at most kPointwiseGemmMaxPixels output pixels (14x14), as the
// matrix product it is: at::linear over the [N, H, W, C] view (at stride 2 every other row and
// column, gathered by the product's reshape; a ResNet's downsampling shortcut), MKL's GEMM for the
// forward and both gradients, the output a channels-last [N, Cout, Ho, Wo] view. On small maps the
// GEMM beat oneDNN's convolution, whose weight reorders weigh more there (ResNet-50's last two stages, EfficientNet's and MobileNetV3's
// last blocks: docs/performance.md "1x1 convolutions over small maps as GEMMs"). Undefined where
// that does not apply. Float rounding differs from the convolution's (another summation order).
constexpr int64_t kPointwiseGemmMaxPixels = 196;
at::Tensor pointwise_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::IntArrayRef stride,
                          at::IntArrayRef padding, int64_t groups);

// The module's forward as the zoo's blocks run it: in training through imgtrain's paths where one
// applies (pointwise_gemm, trimmed_conv2d, depthwise_train, the dense 3x3 path of
// ops::dense_conv_train), in inference without autograd and with infer_kernels (the caller's
// inference fusion: set_inference_fusion, --fuse-bn) Winograd's for 3x3 stride-1 convolutions of
// channels-last float32 maps (ops/winograd.h), else the module's own forward. For layers outside
// the zoo's blocks (detection's FPN and heads).
at::Tensor conv_module_forward(torch::nn::Conv2dImpl& conv, const at::Tensor& x, bool infer_kernels = false);

// A depthwise 5x5 or 7x7 convolution (zero padding, square stride and padding) in training with
// autograd, through imgtrain's weight gradient (ops::depthwise_conv_train: ATen's took 4-20x longer
// at EfficientNet's and ConvNeXt's shapes on the CPU; at 3x3 the two are level, so ATen's stays).
// Undefined where that does not apply: then run the module.
at::Tensor depthwise_train(torch::nn::Conv2dImpl& conv, const at::Tensor& x);

// act(bn(conv(x)) + residual), the residual optional (undefined): the one call through which the
// zoo's blocks run a convolution followed by BatchNorm. Normally exactly the modules in sequence
// (bitwise what the separate calls give), except that a convolution with taps that meet only
// padding runs trimmed (trimmed_conv2d) and, in training (the module in train mode, autograd on),
// a 1x1 convolution over a small channels-last map runs as a GEMM (pointwise_gemm). With inference
// fusion on (set_inference_fusion), in eval mode without autograd, on float32 inputs outside
// autocast, the BatchNorm is folded into the convolution (w * g / sqrt(var + eps), b - mean * g /
// sqrt(var + eps)) and on the CPU the bias, residual add and activation run as oneDNN post-ops of
// the convolution (torch.compile's CPU fusions) with the weights laid out for oneDNN once: one pass
// over the output instead of three or four, and no weight reorder per call. Results then differ
// from the unfused path by float rounding only (tests bound it). A residual handed over
// with std::move, that no other tensor or view shares, is summed into in place there (its memory
// becomes the output): a block gives its shortcut away this way when nothing reads it after.
at::Tensor conv_bn_act(torch::nn::Conv2dImpl& conv, imgtrain::BatchNorm2dImpl& bn, const at::Tensor& x,
                       Act act = Act::Identity, at::Tensor residual = {});

// Inference fusion of a Linear (set_inference_fusion, eval mode, no autograd): whether it applies to
// `x` (float32 on the CPU outside autocast, with oneDNN's linear ops present), then
// act(x W^T + b) and x W^T + b + residual as one oneDNN call each (mkldnn::_linear_pointwise, the
// ops torch.compile's CPU backend emits). Outside those conditions both run the ATen ops.
// With a LinearPack the fused call reads the weight in oneDNN's own layout, made on the first call
// and again only when the weight changes (in place: its version moves; or replaced): oneDNN's
// linear otherwise reorders a plain weight on every call (4-9% of its time at ViT-S's shapes).
// What a cached tensor was made from: that tensor (held, so its address is never reused), its
// storage pointer and its version (an in-place change moves it). A parameter replaced or changed in
// place no longer matches.
struct TensorStamp {
  at::Tensor source;
  const void* data = nullptr;
  uint32_t version = 0;
  bool matches(const at::Tensor& t) const {
    return source.defined() && source.is_same(t) && data == t.data_ptr() && version == t._version();
  }
  void take(const at::Tensor& t) {
    source = t;
    data = t.data_ptr();
    version = uint32_t(t._version());
  }
};
struct LinearPack {
  at::Tensor packed;
  TensorStamp from;  // the weight it was made from
};
bool linear_fusable(const at::Tensor& x);
// Inference without autograd, CPU float32: a 1x1 convolution (stride 1, no padding, one group) of
// a pooled map given as [N, C], as the Linear it is ([N, out]); oneDNN's convolution call costs
// more than the work there (EfficientNet-B0's squeeze-and-excite blocks: inference 106 -> 131
// samples/s at batch 8, 2 threads). Undefined where that does not apply.
at::Tensor pooled_conv1x1(const torch::nn::Conv2dImpl& conv, const at::Tensor& pooled);
at::Tensor linear_act(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, Act act,
                      LinearPack* pack = nullptr);
at::Tensor linear_add(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& residual,
                      LinearPack* pack = nullptr);

// A convolution whose kernel is its stride (no padding, one group, no dilation: ViT's patch
// embedding, ConvNeXt's stem and downsampling) is a Linear over non-overlapping patches. Under the
// conditions of linear_fusable and with H, W multiples of the kernel: the patches gathered in x's
// memory order (NCHW: each patch as the weight's [C, k, k]; channels-last: as [k, k, C], the weight
// permuted to match, once) and one oneDNN linear with the packed weight. Returns the conv's
// [N, out, H/k, W/k] in channels-last memory (the linear's rows: no reorder out of oneDNN's
// blocked layout, which the convolution pays, and the [N, H/k * W/k, out] tokens ViT wants are a
// view). Undefined where it does not apply. The cache follows the weight (replaced or in place).
struct PatchLinearCache {
  TensorStamp from;  // conv.weight
  bool channels_last = false;
  at::Tensor weight;  // [out, C k k] in the patches' order
  LinearPack pack;
};
at::Tensor patch_conv_linear(const torch::nn::Conv2dImpl& conv, const at::Tensor& x, PatchLinearCache* cache);
// conv(x): through patch_conv_linear where `fuse` (inference fusion on, eval mode) and it applies.
at::Tensor patch_conv(torch::nn::Conv2dImpl& conv, const at::Tensor& x, PatchLinearCache* cache, bool fuse);

// A Linear as Python's nn.Linear (timm's) runs it: at::linear, which takes a contiguous input of
// any rank as one addmm with the bias added inside the GEMM. torch::nn::Linear's C++ forward
// (torch::nn::functional::linear) does that for 2-D inputs only and otherwise runs matmul and then
// adds the bias: one more pass over the output, and a separate sum for the bias gradient.
inline at::Tensor linear(const torch::nn::LinearImpl& l, const at::Tensor& x) { return at::linear(x, l.weight, l.bias); }

// Convolution, BatchNorm, activation (timm's ConvBnAct block: modules conv, bn1), with a residual
// when `skip` is asked and the shapes allow it.
struct ConvBnActImpl : torch::nn::Module {
  ConvBnActImpl(int64_t in, int64_t out, int64_t k, int64_t stride, Act act, const std::string& pad_type = "",
                double bn_eps = 1e-5, bool skip = false, double drop_path_rate = 0.0);
  at::Tensor forward(at::Tensor x);
  Conv conv{nullptr};
  imgtrain::BatchNorm2d bn1{nullptr};
  Act act;
  bool has_skip;
  double dpr;
};
TORCH_MODULE(ConvBnAct);

// Squeeze-and-excite as timm's _efficientnet_blocks.SqueezeExcite: mean over H, W, 1x1 reduce,
// activation, 1x1 expand, gate (sigmoid or hard sigmoid); modules conv_reduce, conv_expand.
// With training fusion on (set_training_fusion), training forwards that record autograd run as
// one function (ops::se_gate_train) where it takes the input and the activations.
// Inference fusion (set_inference_fusion): the two 1x1 convolutions of the pooled map as GEMMs on
// [N, C] (pooled_conv1x1).
struct SqueezeExciteImpl : torch::nn::Module, imgtrain::TrainingFusion, imgtrain::InferenceFusion {
  SqueezeExciteImpl(int64_t channels, int64_t reduced, Act act, Act gate);
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Conv2d conv_reduce{nullptr}, conv_expand{nullptr};
  Act act, gate;
};
TORCH_MODULE(SqueezeExcite);

// timm's LayerNorm2d: layer norm over the channels of an NCHW tensor (parameters weight, bias).
struct LayerNorm2dImpl : torch::nn::LayerNormImpl {
  LayerNorm2dImpl(int64_t channels, double eps = 1e-6);
  at::Tensor forward(const at::Tensor& x);
};
TORCH_MODULE(LayerNorm2d);

// timm's SelectAdaptivePool2d: global pooling over H and W by name — avg, max, avgmax (their
// mean) or catavgmax (both, concatenated: twice the channels) — to B x C (x 1 x 1 with keepdim).
at::Tensor global_pool(const at::Tensor& x, const std::string& type, bool keepdim = false);
int64_t pool_feat_mult(const std::string& type);
// The model's pool type: `requested` ("" = the model's default), checked against what it supports;
// `from` names where the request came from in the error (ModelArgs::global_pool_from).
std::string resolve_global_pool(const std::string& model, const std::string& requested, const std::string& dflt,
                                const std::vector<std::string>& supported, const std::string& from = "--gp");

// timm's efficientnet_init_weights (_init_weight_goog, fix_group_fanout): convolutions
// normal(0, sqrt(2 / fan_out)) with fan_out = k*k*out/groups, BatchNorm ones/zeros, Linear
// uniform(+-1/sqrt(out)), biases zero.
void init_weights_goog(torch::nn::Module& m);

}  // namespace imgtrain::model_zoo
