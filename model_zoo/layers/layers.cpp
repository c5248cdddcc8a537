#include "model_zoo/layers/layers.h"

#include "core/error.h"

#include <torch/torch.h>

#include <algorithm>

#include <cfenv>
#include <cmath>

namespace imgtrain::model_zoo {

at::Tensor drop_path(const at::Tensor& x, double p, bool training) {
  if (p == 0.0 || !training) return x;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  auto keep = torch::empty(shape, x.options()).bernoulli_(1.0 - p);
  return x * keep.div_(1.0 - p);
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

at::Tensor ConvImpl::forward(const at::Tensor& x) {
  if (!dynamic_same) return torch::nn::Conv2dImpl::forward(x);
  const auto& o = options;
  const int64_t ph = same_pad(x.size(2), o.kernel_size()->at(0), o.stride()->at(0), o.dilation()->at(0));
  const int64_t pw = same_pad(x.size(3), o.kernel_size()->at(1), o.stride()->at(1), o.dilation()->at(1));
  auto padded = (ph || pw) ? torch::constant_pad_nd(x, {pw / 2, pw - pw / 2, ph / 2, ph - ph / 2}) : x;
  return torch::nn::Conv2dImpl::forward(padded);
}

ConvBnActImpl::ConvBnActImpl(int64_t in, int64_t out, int64_t k, int64_t stride, Act act_, const std::string& pad_type,
                             double bn_eps, bool skip, double drop_path_rate)
    : act(act_), has_skip(skip && stride == 1 && in == out), dpr(drop_path_rate) {
  conv = register_module("conv", Conv(in, out, k, stride, 1, false, pad_type));
  bn1 = register_module("bn1", imgtrain::BatchNorm2d(torch::nn::BatchNormOptions(out).eps(bn_eps)));
}

at::Tensor ConvBnActImpl::forward(at::Tensor x) {
  auto shortcut = x;
  x = apply_act(bn1(conv(x)), act, true);
  return has_skip ? drop_path(x, dpr, is_training()).add_(shortcut) : x;
}

SqueezeExciteImpl::SqueezeExciteImpl(int64_t channels, int64_t reduced, Act act_, Act gate_) : act(act_), gate(gate_) {
  conv_reduce = register_module("conv_reduce", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, reduced, 1)));
  conv_expand = register_module("conv_expand", torch::nn::Conv2d(torch::nn::Conv2dOptions(reduced, channels, 1)));
}

at::Tensor SqueezeExciteImpl::forward(const at::Tensor& x) {
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
