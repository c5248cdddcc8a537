#include "ops/ops.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#ifdef IMGTRAIN_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef IMGTRAIN_WITH_CUDA
namespace imgtrain::ops::cuda {  // ops_cuda.cu; each returns the cudaError_t of its launch
#define IMGTRAIN_ROI_ALIGN_DECL(T)                                                                                   \
  int roi_align_forward(const T* in, const T* rois, T* out, int64_t K, int64_t C, int64_t H, int64_t W, int64_t ph,   \
                        int64_t pw, double scale, int64_t sampling, bool aligned, void* stream);                     \
  int roi_align_backward(const T* grad, const T* rois, T* gin, int64_t K, int64_t C, int64_t H, int64_t W,           \
                         int64_t ph, int64_t pw, double scale, int64_t sampling, bool aligned, void* stream);        \
  int nms_mask(const T* boxes, int64_t n, double thr, uint64_t* mask, void* stream);
IMGTRAIN_ROI_ALIGN_DECL(float)
IMGTRAIN_ROI_ALIGN_DECL(double)
#undef IMGTRAIN_ROI_ALIGN_DECL
}  // namespace imgtrain::ops::cuda
#endif

namespace imgtrain::ops {
namespace {

#ifdef IMGTRAIN_WITH_CUDA
void check_launch(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string(what) + ": CUDA error " + std::to_string(err));
}
// RoIAlign's backward on the device sums with atomics (torchvision's kernel does too), so its
// float order varies from run to run; a run that asks for deterministic algorithms gets the host
// kernel instead (each element summed in one fixed order).
bool device_kernel_for(const at::Tensor& t, bool order_matters = false) {
  return t.is_cuda() && !(order_matters && at::globalContext().deterministicAlgorithms());
}
#endif

at::Tensor upcast(const at::Tensor& t) {
  return t.is_floating_point() && t.element_size() < 4 ? t.to(at::kFloat) : t;
}

// A CPU copy of a device input (where the device kernel is not used); CPU tensors as they are.
at::Tensor host(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(at::kCPU); }

// ---- RoIAlign ---------------------------------------------------------------------------------

// The four bilinear taps of the point (y, x) on an h x w map (offsets and weights); false when the
// point lies more than one pixel outside the map (it then contributes nothing).
template <typename T>
struct Taps {
  int64_t yl, yh, xl, xh;
  T w1, w2, w3, w4;
};

template <typename T>
bool bilinear_taps(int64_t h, int64_t w, T y, T x, Taps<T>& t) {
  if (y < -1.0 || y > h || x < -1.0 || x > w) return false;
  if (y <= 0) y = 0;
  if (x <= 0) x = 0;
  t.yl = int64_t(y);
  t.xl = int64_t(x);
  if (t.yl >= h - 1) {
    t.yh = t.yl = h - 1;
    y = T(t.yl);
  } else {
    t.yh = t.yl + 1;
  }
  if (t.xl >= w - 1) {
    t.xh = t.xl = w - 1;
    x = T(t.xl);
  } else {
    t.xh = t.xl + 1;
  }
  const T ly = y - T(t.yl), lx = x - T(t.xl);
  const T hy = T(1. - ly), hx = T(1. - lx);
  t.w1 = hy * hx;
  t.w2 = hy * lx;
  t.w3 = ly * hx;
  t.w4 = ly * lx;
  return true;
}

// One RoI's geometry: start, bin sizes and samples per bin, in the kernel's precision.
template <typename T>
struct RoiGeom {
  int64_t batch;
  T start_h, start_w, bin_h, bin_w;
  int64_t grid_h, grid_w;
  T count;
  T sample_y(int64_t ph, int64_t iy) const {
    return start_h + T(ph) * bin_h + T(float(iy) + .5f) * bin_h / T(grid_h);
  }
  T sample_x(int64_t pw, int64_t ix) const {
    return start_w + T(pw) * bin_w + T(float(ix) + .5f) * bin_w / T(grid_w);
  }
};

template <typename T>
RoiGeom<T> roi_geom(const T* r, double scale, int64_t ph, int64_t pw, int64_t sampling, bool aligned) {
  RoiGeom<T> g;
  g.batch = int64_t(r[0]);
  const T off = aligned ? T(0.5) : T(0.0);
  // the scale is a double: the products are taken in double and rounded once, as torchvision does
  g.start_w = T(double(r[1]) * scale - double(off));
  g.start_h = T(double(r[2]) * scale - double(off));
  const T end_w = T(double(r[3]) * scale - double(off)), end_h = T(double(r[4]) * scale - double(off));
  T rw = end_w - g.start_w, rh = end_h - g.start_h;
  if (!aligned) {  // torchvision's legacy behaviour: RoIs at least 1x1
    rw = std::max(rw, T(1));
    rh = std::max(rh, T(1));
  }
  g.bin_h = rh / T(ph);
  g.bin_w = rw / T(pw);
  g.grid_h = sampling > 0 ? sampling : int64_t(std::ceil(rh / T(ph)));
  g.grid_w = sampling > 0 ? sampling : int64_t(std::ceil(rw / T(pw)));
  g.count = T(std::max<int64_t>(g.grid_h * g.grid_w, 1));
  return g;
}

// A RoI's bilinear taps, the same for every channel: computed once per RoI, in (bin, sample) order.
template <typename T>
void roi_taps(const RoiGeom<T>& g, int64_t H, int64_t W, int64_t ph, int64_t pw, std::vector<Taps<T>>& taps,
              std::vector<uint8_t>& inside) {
  taps.resize(size_t(ph * pw * g.grid_h * g.grid_w));
  inside.assign(taps.size(), 0);
  size_t t = 0;
  for (int64_t i = 0; i < ph; ++i)
    for (int64_t j = 0; j < pw; ++j)
      for (int64_t iy = 0; iy < g.grid_h; ++iy) {
        const T yy = g.sample_y(i, iy);
        for (int64_t ix = 0; ix < g.grid_w; ++ix, ++t) inside[t] = bilinear_taps(H, W, yy, g.sample_x(j, ix), taps[t]);
      }
}

// Forward, NCHW (nhwc = false) or channels-last input and output (nhwc = true): one RoI per task.
// Each output element is the same sum in the same order in both layouts, so they agree bitwise.
template <typename T>
void roi_align_forward_cpu(const at::Tensor& in, const at::Tensor& rois, double scale, int64_t ph, int64_t pw,
                           int64_t sampling, bool aligned, bool nhwc, at::Tensor& out) {
  const int64_t C = in.size(1), H = in.size(2), W = in.size(3), K = rois.size(0);
  const T* x = in.data_ptr<T>();
  const T* r = rois.data_ptr<T>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, K, 1, [&](int64_t k0, int64_t k1) {
    std::vector<Taps<T>> taps;
    std::vector<uint8_t> inside;
    std::vector<T> acc(size_t(nhwc ? C : 0));
    for (int64_t k = k0; k < k1; ++k) {
      const auto g = roi_geom(r + k * 5, scale, ph, pw, sampling, aligned);
      const int64_t per_bin = g.grid_h * g.grid_w;
      roi_taps(g, H, W, ph, pw, taps, inside);
      if (nhwc) {  // a tap reads C consecutive values: the channel loop is the inner one
        const T* img = x + g.batch * H * W * C;
        size_t t2 = 0;
        for (int64_t b = 0; b < ph * pw; ++b) {
          std::fill(acc.begin(), acc.end(), T(0));
          for (int64_t s = 0; s < per_bin; ++s, ++t2) {
            if (!inside[t2]) continue;
            const auto& q = taps[t2];
            const T *p1 = img + (q.yl * W + q.xl) * C, *p2 = img + (q.yl * W + q.xh) * C;
            const T *p3 = img + (q.yh * W + q.xl) * C, *p4 = img + (q.yh * W + q.xh) * C;
            for (int64_t c = 0; c < C; ++c) acc[size_t(c)] += q.w1 * p1[c] + q.w2 * p2[c] + q.w3 * p3[c] + q.w4 * p4[c];
          }
          T* o = y + (k * ph * pw + b) * C;
          for (int64_t c = 0; c < C; ++c) o[c] = acc[size_t(c)] / g.count;
        }
        continue;
      }
      for (int64_t c = 0; c < C; ++c) {
        const T* plane = x + (g.batch * C + c) * H * W;
        T* o = y + (k * C + c) * ph * pw;
        size_t t2 = 0;
        for (int64_t b = 0; b < ph * pw; ++b) {
          T v = 0;
          for (int64_t s = 0; s < per_bin; ++s, ++t2) {
            if (!inside[t2]) continue;
            const auto& q = taps[t2];
            v += q.w1 * plane[q.yl * W + q.xl] + q.w2 * plane[q.yl * W + q.xh] + q.w3 * plane[q.yh * W + q.xl] +
                 q.w4 * plane[q.yh * W + q.xh];
          }
          o[b] = v / g.count;
        }
      }
    }
  });
}

// dst[i] += src[i] * w / count: torchvision's expression and rounding (a product, then a
// quotient, then the sum: nothing to contract), over one tap's channels of a channels-last map.
// The pointers do not overlap, so the loop vectorises (SIMD clones picked at load time).
template <typename T>
inline void scatter_tap(T* __restrict dst, const T* __restrict src, T w, T count, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i] * w / count;
}
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void scatter_tap(float* __restrict dst, const float* __restrict src, float w, float count, int64_t n) {
  scatter_tap<float>(dst, src, w, count, n);
}

// Backward, on channels-last maps (the caller converts NCHW ones: a tap's channels are then one
// vector). Channels are independent: each thread owns whole channels, so every element's gradient
// is summed in the same (RoI, bin, sample) order whatever the thread count and layout.
template <typename T>
void roi_align_backward_cpu(const at::Tensor& grad, const at::Tensor& rois, double scale, int64_t ph, int64_t pw,
                            int64_t sampling, bool aligned, at::Tensor& gin) {
  const int64_t C = gin.size(1), H = gin.size(2), W = gin.size(3), K = rois.size(0);
  const T* go = grad.data_ptr<T>();
  const T* r = rois.data_ptr<T>();
  T* gi = gin.data_ptr<T>();
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    std::vector<Taps<T>> taps;
    std::vector<uint8_t> inside;
    for (int64_t k = 0; k < K; ++k) {
      const auto g = roi_geom(r + k * 5, scale, ph, pw, sampling, aligned);
      const int64_t per_bin = g.grid_h * g.grid_w;
      roi_taps(g, H, W, ph, pw, taps, inside);
      T* img = gi + g.batch * H * W * C;
      size_t t2 = 0;
      for (int64_t b = 0; b < ph * pw; ++b) {
        const T* o = go + (k * ph * pw + b) * C;
        for (int64_t s = 0; s < per_bin; ++s, ++t2) {
          if (!inside[t2]) continue;
          const auto& q = taps[t2];
          // corner by corner (two corners are one pixel at the map's edge): per element, the
          // same four additions in the same order as one loop over the four
          scatter_tap(img + (q.yl * W + q.xl) * C + c0, o + c0, q.w1, g.count, c1 - c0);
          scatter_tap(img + (q.yl * W + q.xh) * C + c0, o + c0, q.w2, g.count, c1 - c0);
          scatter_tap(img + (q.yh * W + q.xl) * C + c0, o + c0, q.w3, g.count, c1 - c0);
          scatter_tap(img + (q.yh * W + q.xh) * C + c0, o + c0, q.w4, g.count, c1 - c0);
        }
      }
    }
  });
}

void check_roi_align(const at::Tensor& input, const at::Tensor& rois, int64_t ph, int64_t pw) {
  if (input.dim() != 4) throw std::invalid_argument("roi_align: input must be [N, C, H, W]");
  if (rois.dim() != 2 || rois.size(1) != 5) throw std::invalid_argument("roi_align: rois must be [K, 5]");
  if (ph <= 0 || pw <= 0) throw std::invalid_argument("roi_align: the output size must be positive");
}

struct RoiAlignArgs {
  double scale;
  int64_t ph, pw, sampling;
  bool aligned;
};

// A 4-d map laid out channels-last (and not also NCHW-contiguous, as 1x1 maps or one channel are).
bool channels_last(const at::Tensor& t) {
  return t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous();
}

at::Tensor roi_align_forward(const at::Tensor& input, const at::Tensor& rois, const RoiAlignArgs& a) {
#ifdef IMGTRAIN_WITH_CUDA
  if (device_kernel_for(input)) {
    c10::cuda::CUDAGuard guard(input.device());
    auto x = input.contiguous();
    auto r = rois.to(input.device(), x.scalar_type()).contiguous();
    auto out = at::zeros({r.size(0), x.size(1), a.ph, a.pw}, x.options());
    if (r.size(0) && x.numel())
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "roi_align_forward_cuda", [&] {
        check_launch(cuda::roi_align_forward(x.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                             r.size(0), x.size(1), x.size(2), x.size(3), a.ph, a.pw, a.scale,
                                             a.sampling, a.aligned, c10::cuda::getCurrentCUDAStream().stream()),
                     "roi_align forward");
      });
    return out;
  }
#endif
  // channels-last maps are read as they are and give a channels-last result (no copy to NCHW)
  const bool nhwc = channels_last(input);
  auto x = host(input).contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  auto r = host(rois).to(x.scalar_type()).contiguous();
  // every element is written by the kernel: no zero fill
  auto out = at::empty({r.size(0), x.size(1), a.ph, a.pw}, x.options(),
                       nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  if (r.size(0) && x.numel())
    AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "roi_align_forward", [&] {
      roi_align_forward_cpu<scalar_t>(x, r, a.scale, a.ph, a.pw, a.sampling, a.aligned, nhwc, out);
    });
  return out.to(input.device());
}

// The input gradient, channels-last where the forward's input was (nhwc; host kernels only).
at::Tensor roi_align_backward(const at::Tensor& grad, const at::Tensor& rois, at::IntArrayRef in_shape,
                              const RoiAlignArgs& a, const at::Device& dev, bool nhwc) {
#ifdef IMGTRAIN_WITH_CUDA
  if (device_kernel_for(grad, /*order_matters=*/true)) {
    c10::cuda::CUDAGuard guard(grad.device());
    auto g = grad.contiguous();
    auto r = rois.to(grad.device(), g.scalar_type()).contiguous();
    auto gin = at::zeros(in_shape, g.options());
    if (r.size(0) && gin.numel())
      AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "roi_align_backward_cuda", [&] {
        check_launch(cuda::roi_align_backward(g.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), gin.data_ptr<scalar_t>(),
                                              r.size(0), gin.size(1), gin.size(2), gin.size(3), a.ph, a.pw, a.scale,
                                              a.sampling, a.aligned, c10::cuda::getCurrentCUDAStream().stream()),
                     "roi_align backward");
      });
    return gin;
  }
#endif
  // summed channels-last whatever the maps' layout (the same bits: each element's order does not
  // depend on it), handed back in the maps' layout
  auto g = host(grad).contiguous(at::MemoryFormat::ChannelsLast);
  auto r = host(rois).to(g.scalar_type()).contiguous();
  auto gin = at::empty(in_shape, g.options(), at::MemoryFormat::ChannelsLast).zero_();
  if (r.size(0) && gin.numel())
    AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "roi_align_backward", [&] {
      roi_align_backward_cpu<scalar_t>(g, r, a.scale, a.ph, a.pw, a.sampling, a.aligned, gin);
    });
  return (nhwc ? gin : gin.contiguous()).to(dev);
}

struct RoiAlignFn : public torch::autograd::Function<RoiAlignFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& rois,
                            double scale, int64_t ph, int64_t pw, int64_t sampling, bool aligned) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["ph"] = ph;
    ctx->saved_data["pw"] = pw;
    ctx->saved_data["sampling"] = sampling;
    ctx->saved_data["aligned"] = aligned;
    ctx->saved_data["shape"] = input.sizes().vec();
    ctx->saved_data["nhwc"] = channels_last(input);
    ctx->save_for_backward({rois});
    at::AutoDispatchBelowADInplaceOrView guard;
    return roi_align_forward(input, rois, {scale, ph, pw, sampling, aligned});
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto rois = ctx->get_saved_variables()[0];
    const RoiAlignArgs a{ctx->saved_data["scale"].toDouble(), ctx->saved_data["ph"].toInt(),
                         ctx->saved_data["pw"].toInt(), ctx->saved_data["sampling"].toInt(),
                         ctx->saved_data["aligned"].toBool()};
    const auto shape = ctx->saved_data["shape"].toIntVector();
    auto gin = roi_align_backward(grads[0], rois, shape, a, grads[0].device(), ctx->saved_data["nhwc"].toBool());
    return {gin, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// MultiScaleRoIAlign's gather in one autograd node: RoI k is pooled from feats[levels[k]] into row k
// of one output. The same kernels per level as roi_align; what it saves is the scatter into a
// zeroed result level by level, whose backward cloned the whole gradient once per level.
struct MultiLevelRoiAlignFn : public torch::autograd::Function<MultiLevelRoiAlignFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList feats, const at::Tensor& rois,
                            const at::Tensor& levels, const std::vector<double>& scales, int64_t ph, int64_t pw,
                            int64_t sampling, bool aligned) {
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["ph"] = ph;
    ctx->saved_data["pw"] = pw;
    ctx->saved_data["sampling"] = sampling;
    ctx->saved_data["aligned"] = aligned;
    for (size_t l = 0; l < feats.size(); ++l) {
      ctx->saved_data["shape" + std::to_string(l)] = feats[l].sizes().vec();
      ctx->saved_data["nhwc" + std::to_string(l)] = channels_last(feats[l]);
    }
    ctx->save_for_backward({rois, levels});
    at::AutoDispatchBelowADInplaceOrView guard;
    // every row is written by one level (each RoI has one)
    auto out = at::empty({rois.size(0), feats[0].size(1), ph, pw}, feats[0].options(),
                         channels_last(feats[0]) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    for (size_t l = 0; l < feats.size(); ++l) {
      const auto idx = at::where(levels.eq(int64_t(l)))[0];
      if (idx.numel() == 0) continue;
      if (idx.numel() == rois.size(0))  // every RoI on this level (e.g. MobileNetV3's FPN): no gather
        return roi_align_forward(feats[l], rois, {scales[l], ph, pw, sampling, aligned});
      out.index_copy_(0, idx,
                      roi_align_forward(feats[l], rois.index_select(0, idx), {scales[l], ph, pw, sampling, aligned}));
    }
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &rois = saved[0], &levels = saved[1];
    const auto scales = ctx->saved_data["scales"].toDoubleVector();
    const int64_t ph = ctx->saved_data["ph"].toInt(), pw = ctx->saved_data["pw"].toInt();
    const int64_t sampling = ctx->saved_data["sampling"].toInt();
    const bool aligned = ctx->saved_data["aligned"].toBool();
    torch::autograd::variable_list out;
    for (size_t l = 0; l < scales.size(); ++l) {
      const auto idx = at::where(levels.eq(int64_t(l)))[0];
      if (idx.numel() == 0) {
        out.emplace_back();  // no RoI read this level: no gradient (zero)
        continue;
      }
      const auto shape = ctx->saved_data["shape" + std::to_string(l)].toIntVector();
      const bool all = idx.numel() == rois.size(0);
      out.push_back(roi_align_backward(all ? grads[0] : grads[0].index_select(0, idx),
                                       all ? rois : rois.index_select(0, idx), shape,
                                       {scales[l], ph, pw, sampling, aligned}, grads[0].device(),
                                       ctx->saved_data["nhwc" + std::to_string(l)].toBool()));
    }
    for (int i = 0; i < 7; ++i) out.emplace_back();  // rois, levels, scales, ph, pw, sampling, aligned
    return out;
  }
};

// ---- NMS --------------------------------------------------------------------------------------

// Marks the boxes b in [from, n) (score order) that overlap box a by more than thr: torchvision's
// IoU expression, computed for every b (a box already suppressed stays so; skipping it saved
// nothing once the loop runs as vectors). `thr` is the threshold as a T that compares with a T
// IoU as the double threshold does (see nms_cpu).
template <typename T>
inline void suppress_row(const T* __restrict x1, const T* __restrict y1, const T* __restrict x2,
                         const T* __restrict y2, const T* __restrict areas, int64_t a, int64_t from, int64_t n, T thr,
                         uint8_t* __restrict sup) {
  const T ax1 = x1[a], ay1 = y1[a], ax2 = x2[a], ay2 = y2[a], aa = areas[a];
  for (int64_t b = from; b < n; ++b) {
    const T w = std::max(T(0), std::min(ax2, x2[b]) - std::max(ax1, x1[b]));
    const T h = std::max(T(0), std::min(ay2, y2[b]) - std::max(ay1, y1[b]));
    const T inter = w * h;
    sup[b] |= uint8_t(inter / (aa + areas[b] - inter) > thr);
  }
}
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void suppress_row_f(const float* __restrict x1, const float* __restrict y1, const float* __restrict x2,
                    const float* __restrict y2, const float* __restrict areas, int64_t a, int64_t from, int64_t n,
                    float thr, uint8_t* __restrict sup) {
  suppress_row<float>(x1, y1, x2, y2, areas, a, from, n, thr, sup);
}

// torchvision's CPU NMS (greedy, by decreasing score, ties in input order), on the boxes copied
// into score order so that a kept box's row of IoUs runs as vectors.
template <typename T>
at::Tensor nms_cpu(const at::Tensor& dets, const at::Tensor& scores, double thr) {
  const auto order_t = std::get<1>(scores.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  const auto sorted = dets.index_select(0, order_t);
  const auto x1t = sorted.select(1, 0).contiguous(), y1t = sorted.select(1, 1).contiguous();
  const auto x2t = sorted.select(1, 2).contiguous(), y2t = sorted.select(1, 3).contiguous();
  const auto areas_t = (x2t - x1t) * (y2t - y1t);
  const int64_t n = dets.size(0);
  const T *x1 = x1t.data_ptr<T>(), *y1 = y1t.data_ptr<T>(), *x2 = x2t.data_ptr<T>(), *y2 = y2t.data_ptr<T>();
  const T* areas = areas_t.data_ptr<T>();
  const int64_t* order = order_t.data_ptr<int64_t>();
  // torchvision compares the T IoU with the double threshold; for a T value v, v > thr exactly when
  // v > the largest T not above thr
  T t = T(thr);
  if (double(t) > thr) t = std::nextafter(t, -std::numeric_limits<T>::infinity());
  std::vector<uint8_t> suppressed(size_t(n), 0);
  std::vector<int64_t> keep;
  for (int64_t a = 0; a < n; ++a) {
    if (suppressed[size_t(a)]) continue;
    keep.push_back(order[a]);
    if constexpr (std::is_same_v<T, float>)
      suppress_row_f(x1, y1, x2, y2, areas, a, a + 1, n, t, suppressed.data());
    else
      suppress_row<T>(x1, y1, x2, y2, areas, a, a + 1, n, t, suppressed.data());
  }
  return torch::tensor(keep, torch::kLong);
}

}  // namespace

at::Tensor box_area(const at::Tensor& boxes) {
  const auto b = upcast(boxes);
  return (b.select(-1, 2) - b.select(-1, 0)) * (b.select(-1, 3) - b.select(-1, 1));
}

at::Tensor box_iou(const at::Tensor& boxes1, const at::Tensor& boxes2) {
  const auto a1 = box_area(boxes1), a2 = box_area(boxes2);
  const auto lt = at::max(boxes1.unsqueeze(-2).narrow(-1, 0, 2), boxes2.unsqueeze(-3).narrow(-1, 0, 2));
  const auto rb = at::min(boxes1.unsqueeze(-2).narrow(-1, 2, 2), boxes2.unsqueeze(-3).narrow(-1, 2, 2));
  const auto wh = upcast(rb - lt).clamp_min(0);
  const auto inter = wh.select(-1, 0) * wh.select(-1, 1);
  const auto uni = a1.unsqueeze(-1) + a2.unsqueeze(-2) - inter;
  return inter / uni;
}

at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  if (boxes.dim() != 2 || boxes.size(1) != 4) throw std::invalid_argument("nms: boxes must be [N, 4]");
  if (scores.dim() != 1 || scores.size(0) != boxes.size(0))
    throw std::invalid_argument("nms: scores must be [N] for N boxes");
  if (boxes.numel() == 0) return at::empty({0}, boxes.options().dtype(at::kLong));
#ifdef IMGTRAIN_WITH_CUDA
  if (device_kernel_for(boxes)) {
    // torchvision's scheme: the overlap bit mask on the device, the greedy pass on the host
    c10::cuda::CUDAGuard guard(boxes.device());
    auto b = upcast(boxes);
    const auto order = std::get<1>(upcast(scores).to(b.device()).sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
    auto sorted = b.index_select(0, order).contiguous();
    const int64_t n = sorted.size(0), blocks = (n + 63) / 64;
    auto mask = at::zeros({n * blocks}, b.options().dtype(at::kLong));
    AT_DISPATCH_FLOATING_TYPES(sorted.scalar_type(), "nms_cuda", [&] {
      check_launch(cuda::nms_mask(sorted.data_ptr<scalar_t>(), n, iou_threshold,
                                  reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>()),
                                  c10::cuda::getCurrentCUDAStream().stream()),
                   "nms");
    });
    const auto host_mask = mask.to(at::kCPU);
    const auto* m = reinterpret_cast<const uint64_t*>(host_mask.data_ptr<int64_t>());
    std::vector<uint64_t> removed(size_t(blocks), 0);
    std::vector<int64_t> kept;
    for (int64_t i = 0; i < n; ++i) {
      if (removed[size_t(i / 64)] >> (i % 64) & 1) continue;
      kept.push_back(i);
      for (int64_t c = i / 64; c < blocks; ++c) removed[size_t(c)] |= m[i * blocks + c];
    }
    return order.index_select(0, torch::tensor(kept, torch::kLong).to(b.device()));
  }
#endif
  auto b = host(upcast(boxes)).contiguous();
  auto s = host(upcast(scores)).to(b.scalar_type()).contiguous();
  at::Tensor keep;
  AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "nms", [&] { keep = nms_cpu<scalar_t>(b, s, iou_threshold); });
  return keep.to(boxes.device());
}

at::Tensor batched_nms(const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs, double iou_threshold) {
  if (boxes.numel() == 0) return at::empty({0}, boxes.options().dtype(at::kLong));
  const int64_t limit = boxes.device().is_cpu() ? 4000 : 100000;
  if (boxes.numel() > limit) {
    // torchvision's _batched_nms_vanilla: NMS per category, the kept ones by decreasing score
    auto keep_mask = at::zeros_like(scores, scores.options().dtype(at::kBool));
    const auto classes = std::get<0>(at::_unique(idxs));
    for (int64_t c = 0; c < classes.size(0); ++c) {
      const auto cur = at::where(idxs == classes[c])[0];
      const auto k = nms(boxes.index_select(0, cur), scores.index_select(0, cur), iou_threshold);
      keep_mask.index_put_({cur.index_select(0, k)}, true);
    }
    const auto keep = at::where(keep_mask)[0];
    return keep.index_select(0, std::get<1>(scores.index_select(0, keep).sort(/*dim=*/0, /*descending=*/true)));
  }
  // the coordinate trick: boxes of different categories moved apart so they never overlap
  const auto max_coordinate = boxes.max();
  const auto offsets = idxs.to(boxes) * (max_coordinate + at::ones({}, boxes.options()));
  return nms(boxes + offsets.unsqueeze(1), scores, iou_threshold);
}

at::Tensor roi_align(const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_h,
                     int64_t pooled_w, int64_t sampling_ratio, bool aligned) {
  check_roi_align(input, rois, pooled_h, pooled_w);
  if (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble)
    return RoiAlignFn::apply(input, rois, spatial_scale, pooled_h, pooled_w, sampling_ratio, aligned);
  // half / bfloat16 (autocast's outputs): float32 inside, the input's dtype out
  return RoiAlignFn::apply(input.to(at::kFloat), rois.to(at::kFloat), spatial_scale, pooled_h, pooled_w,
                           sampling_ratio, aligned)
      .to(input.scalar_type());
}

at::Tensor multiscale_roi_align(at::TensorList feats, const at::Tensor& rois, const at::Tensor& levels,
                                const std::vector<double>& scales, int64_t pooled_h, int64_t pooled_w,
                                int64_t sampling_ratio, bool aligned) {
  if (feats.empty() || feats.size() != scales.size())
    throw std::invalid_argument("multiscale_roi_align: one scale per feature map is needed");
  for (auto& f : feats) check_roi_align(f, rois, pooled_h, pooled_w);
  if (levels.dim() != 1 || levels.size(0) != rois.size(0))
    throw std::invalid_argument("multiscale_roi_align: levels must be [K], one per RoI");
  const auto lv = levels.to(at::kLong);
  if (lv.numel() && (lv.min().item<int64_t>() < 0 || lv.max().item<int64_t>() >= int64_t(feats.size())))
    throw std::invalid_argument("multiscale_roi_align: a level is outside the feature maps given");
  const auto type = feats[0].scalar_type();
  if (type == at::kFloat || type == at::kDouble)
    return MultiLevelRoiAlignFn::apply(feats, rois, lv, scales, pooled_h, pooled_w, sampling_ratio, aligned);
  // half / bfloat16 (autocast's outputs): float32 inside, the first map's dtype out, as roi_align
  std::vector<at::Tensor> f32;
  for (auto& f : feats) f32.push_back(f.to(at::kFloat));
  return MultiLevelRoiAlignFn::apply(f32, rois.to(at::kFloat), lv, scales, pooled_h, pooled_w, sampling_ratio,
                                     aligned)
      .to(type);
}

}  // namespace imgtrain::ops
