#include "ops/se_gate.h"
#include "ops/kernel_util.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/conv2d.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/hardsigmoid.h>
#include <ATen/ops/hardsigmoid_backward.h>
#include <ATen/ops/hardswish.h>
#include <ATen/ops/hardswish_backward.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sigmoid_backward.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/threshold_backward.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef IMGTRAIN_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace imgtrain::ops::cuda {  // se_gate_cuda.cu; each returns the cudaError_t of its launch
template <typename T>
int se_gate_grad(const T* g, const T* x, T* out, int64_t N, int64_t C, int64_t HW, bool cl, cudaStream_t stream);
template <typename T>
int se_input_grad(const T* g, T* gx, const T* mul, const T* add, int64_t N, int64_t C, int64_t HW, bool cl,
                  cudaStream_t stream);
}  // namespace imgtrain::ops::cuda
#endif

namespace imgtrain::ops {
namespace {


constexpr int64_t kChunk = 1024;   // NCHW: elements per float partial sum
constexpr int64_t kRows = 64;      // channels-last: pixels per float partial sum
constexpr int kLanes = 16;         // independent float accumulators along a plane

// sum of g[i] * x[i], i < n: kLanes float accumulators over chunks of kChunk, the chunks added in
// double in order (a fixed order: the same bits for any thread count)
template <typename T>
double plane_dot(const T* g, const T* x, int64_t n) {
  double total = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    T lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += g[c0 + i + l] * x[c0 + i + l];
    for (; i < len; ++i) lanes[0] += g[c0 + i] * x[c0 + i];
    T s = 0;
    for (int l = 0; l < kLanes; ++l) s += lanes[l];
    total += double(s);
  }
  return total;
}

// acc[c] += g[r, c] * x[r, c] over `rows` rows of C values
template <typename T>
void rows_dot(const T* g, const T* x, int64_t rows, int64_t C, T* acc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < C; ++c) acc[c] += g[r * C + c] * x[r * C + c];
}

// out[i] = g[i] * a + b
template <typename T>
void plane_axpb(const T* g, T* out, int64_t n, T a, T b) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] * a + b;
}

// out[r, c] = g[r, c] * a[c] + b[c]
template <typename T>
void rows_axpb(const T* g, T* out, int64_t rows, int64_t C, const T* a, const T* b) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < C; ++c) out[r * C + c] = g[r * C + c] * a[c] + b[c];
}

IMGTRAIN_CLONES double plane_dot_f(const float* g, const float* x, int64_t n) { return plane_dot(g, x, n); }
IMGTRAIN_CLONES void rows_dot_f(const float* g, const float* x, int64_t rows, int64_t C, float* acc) {
  rows_dot(g, x, rows, C, acc);
}
IMGTRAIN_CLONES void plane_axpb_f(const float* g, float* out, int64_t n, float a, float b) {
  plane_axpb(g, out, n, a, b);
}
IMGTRAIN_CLONES void rows_axpb_f(const float* g, float* out, int64_t rows, int64_t C, const float* a,
                                    const float* b) {
  rows_axpb(g, out, rows, C, a, b);
}
double plane_dot_k(const float* g, const float* x, int64_t n) { return plane_dot_f(g, x, n); }
double plane_dot_k(const double* g, const double* x, int64_t n) { return plane_dot(g, x, n); }
void rows_dot_k(const float* g, const float* x, int64_t rows, int64_t C, float* acc) { rows_dot_f(g, x, rows, C, acc); }
void rows_dot_k(const double* g, const double* x, int64_t rows, int64_t C, double* acc) { rows_dot(g, x, rows, C, acc); }
void plane_axpb_k(const float* g, float* out, int64_t n, float a, float b) { plane_axpb_f(g, out, n, a, b); }
void plane_axpb_k(const double* g, double* out, int64_t n, double a, double b) { plane_axpb(g, out, n, a, b); }
void rows_axpb_k(const float* g, float* out, int64_t rows, int64_t C, const float* a, const float* b) {
  rows_axpb_f(g, out, rows, C, a, b);
}
void rows_axpb_k(const double* g, double* out, int64_t rows, int64_t C, const double* a, const double* b) {
  rows_axpb(g, out, rows, C, a, b);
}

bool channels_last(const at::Tensor& x) {
  return !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// ggate[n, c] = sum over H, W of g * x (g in x's layout)
template <typename T>
at::Tensor gate_grad(const at::Tensor& g, const at::Tensor& x) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  auto out = at::empty({N, C, 1, 1}, x.options().memory_format(at::MemoryFormat::Contiguous));
  T* op = out.data_ptr<T>();
  const T *gp = g.data_ptr<T>(), *xp = x.data_ptr<T>();
#ifdef IMGTRAIN_WITH_CUDA
  if (x.is_cuda()) {
    c10::cuda::CUDAGuard guard(x.device());
    check_cuda(cuda::se_gate_grad<T>(gp, xp, op, N, C, HW, channels_last(x), c10::cuda::getCurrentCUDAStream().stream()),
               "squeeze-and-excite gate gradient");
    return out;
  }
#endif
  if (!channels_last(x)) {
    at::parallel_for(0, N * C, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, HW)), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) op[p] = T(plane_dot_k(gp + p * HW, xp + p * HW, HW));
    });
    return out;
  }
  const int64_t per_n = (HW + kRows - 1) / kRows, blocks = N * per_n;
  std::vector<T> part(size_t(blocks * C), T(0));
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b / per_n, r0 = (b % per_n) * kRows, off = (n * HW + r0) * C;
      rows_dot_k(gp + off, xp + off, std::min(kRows, HW - r0), C, part.data() + b * C);
    }
  });
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<double> acc(static_cast<size_t>(C));
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t b = n * per_n; b < (n + 1) * per_n; ++b)
        for (int64_t c = 0; c < C; ++c) acc[c] += double(part[b * C + c]);
      for (int64_t c = 0; c < C; ++c) op[n * C + c] = T(acc[c]);
    }
  });
  return out;
}

// gx = g * gate[n, c] + pooled_grad[n, c] / (H * W), in x's layout
template <typename T>
at::Tensor input_grad(const at::Tensor& g, const at::Tensor& x, const at::Tensor& gate, const at::Tensor& pooled_grad) {
  const int64_t N = x.size(0), C = x.size(1), HW = x.size(2) * x.size(3);
  auto gx = at::empty_like(x);
  // the mean's gradient as autograd makes it: the pooled gradient divided by H * W in T
  const auto add = (pooled_grad.reshape({N, C}) / double(HW)).contiguous();
  const auto mul = gate.reshape({N, C}).contiguous();
  const T *gp = g.data_ptr<T>(), *ap = mul.data_ptr<T>(), *bp = add.data_ptr<T>();
  T* op = gx.data_ptr<T>();
#ifdef IMGTRAIN_WITH_CUDA
  if (x.is_cuda()) {
    c10::cuda::CUDAGuard guard(x.device());
    check_cuda(cuda::se_input_grad<T>(gp, op, ap, bp, N, C, HW, channels_last(x), c10::cuda::getCurrentCUDAStream().stream()),
               "squeeze-and-excite input gradient");
    return gx;
  }
#endif
  if (!channels_last(x)) {
    at::parallel_for(0, N * C, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, HW)), [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) plane_axpb_k(gp + p * HW, op + p * HW, HW, ap[p], bp[p]);
    });
    return gx;
  }
  const int64_t per_n = (HW + kRows - 1) / kRows;
  at::parallel_for(0, N * per_n, std::max<int64_t>(1, 32768 / (kRows * C)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b / per_n, r0 = (b % per_n) * kRows, off = (n * HW + r0) * C;
      rows_axpb_k(gp + off, op + off, std::min(kRows, HW - r0), C, ap + n * C, bp + n * C);
    }
  });
  return gx;
}

at::Tensor act_forward(const at::Tensor& z, SeAct a) {
  switch (a) {
    case SeAct::ReLU: return at::relu(z);
    case SeAct::ReLU6: return at::clamp(z, 0, 6);
    case SeAct::SiLU: return at::silu(z);
    case SeAct::HardSwish: return at::hardswish(z);
    case SeAct::GELU: return at::gelu(z);
  }
  return z;
}

// the activation's gradient as torch's autograd computes it (ReLU from its result, the others
// from their input; clamp(0, 6) passes the gradient where 0 <= z <= 6, as clamp's backward does)
at::Tensor act_backward(const at::Tensor& grad, const at::Tensor& z, const at::Tensor& a_out, SeAct a) {
  switch (a) {
    case SeAct::ReLU: return at::threshold_backward(grad, a_out, 0);
    case SeAct::ReLU6: return grad * at::logical_and(z >= 0, z <= 6);
    case SeAct::SiLU: return at::silu_backward(grad, z);
    case SeAct::HardSwish: return at::hardswish_backward(grad, z);
    case SeAct::GELU: return at::gelu_backward(grad, z);
  }
  return grad;
}

at::Tensor conv1x1(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) { return at::conv2d(x, w, b); }

// dL/d(input), dL/d(weight), dL/d(bias) of a 1x1 convolution with bias, as autograd's
// ConvolutionBackward computes them
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1x1_backward(const at::Tensor& grad, const at::Tensor& input,
                                                                const at::Tensor& w) {
  return at::convolution_backward(grad, input, w, std::vector<int64_t>{w.size(0)}, {1, 1}, {0, 0}, {1, 1}, false,
                                  {0, 0}, 1, {true, true, true});
}

struct SeFunction : torch::autograd::Function<SeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                            const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2, int64_t act,
                            int64_t gate) {
    const auto pooled = x.mean({2, 3}, /*keepdim=*/true);
    const auto z = conv1x1(pooled, w1, b1);
    const auto a = act_forward(z, SeAct(act));
    const auto s = conv1x1(a, w2, b2);
    const auto gt = SeGate(gate) == SeGate::Sigmoid ? at::sigmoid(s) : at::hardsigmoid(s);
    ctx->save_for_backward({x, w1, w2, pooled, z, a, s, gt});
    ctx->saved_data["act"] = act;
    ctx->saved_data["gate"] = gate;
    return x * gt;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto v = ctx->get_saved_variables();
    const auto &x = v[0], &w1 = v[1], &w2 = v[2], &pooled = v[3], &z = v[4], &a = v[5], &s = v[6], &gt = v[7];
    const auto act = SeAct(ctx->saved_data["act"].toInt());
    const auto gate = SeGate(ctx->saved_data["gate"].toInt());
    const auto g = channels_last(x) ? grads[0].contiguous(at::MemoryFormat::ChannelsLast) : grads[0].contiguous();
    const bool dbl = x.scalar_type() == at::kDouble;
    const auto ggate = dbl ? gate_grad<double>(g, x) : gate_grad<float>(g, x);
    const auto gs = gate == SeGate::Sigmoid ? at::sigmoid_backward(ggate, gt) : at::hardsigmoid_backward(ggate, s);
    auto [ga, gw2, gb2] = conv1x1_backward(gs, a, w2);
    const auto gz = act_backward(ga, z, a, act);
    auto [gpooled, gw1, gb1] = conv1x1_backward(gz, pooled, w1);
    auto gx = dbl ? input_grad<double>(g, x, gt, gpooled) : input_grad<float>(g, x, gt, gpooled);
    return {gx, gw1, gb1, gw2, gb2, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool se_gate_supported(const at::Tensor& x, const at::Tensor& w_reduce) {
#ifdef IMGTRAIN_WITH_CUDA
  const bool device_ok = x.defined() && (x.device().is_cpu() || x.device().is_cuda());
#else
  const bool device_ok = x.defined() && x.device().is_cpu();
#endif
  if (!device_ok || x.dim() != 4 || x.numel() == 0 || w_reduce.device() != x.device()) return false;
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kDouble) return false;
  if (w_reduce.scalar_type() != x.scalar_type()) return false;
  return x.is_contiguous() || x.is_contiguous(at::MemoryFormat::ChannelsLast);
}

at::Tensor se_gate_train(const at::Tensor& x, const at::Tensor& w_reduce, const at::Tensor& b_reduce,
                         const at::Tensor& w_expand, const at::Tensor& b_expand, SeAct act, SeGate gate) {
  return SeFunction::apply(x, w_reduce, b_reduce, w_expand, b_expand, int64_t(act), int64_t(gate));
}

}  // namespace imgtrain::ops
