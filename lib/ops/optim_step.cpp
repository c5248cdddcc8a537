#include "ops/optim_step.h"
#include "ops/kernel_util.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/sqrt.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <vector>

// Compiled with -ffp-contract=off (lib/CMakeLists.txt): a std::fma below is where ATen's kernels
// contract a product and a sum into one rounding (measured on torch 2.11's CPU kernels: add with
// alpha, lerp, addcmul), every other product and sum rounds on its own, as ATen's do. Square
// roots are ATen's own (at::sqrt_out on a tile of a few thousand elements that stays in cache):
// ATen's CPU sqrt is not the correctly rounded one (torch 2.11's float sqrt differs from it in
// about one element in five, by an ulp), but gives an element the same bits wherever it sits in
// a tensor of any length (checked), so a tile's roots are the loop's.
namespace imgtrain::ops {
namespace {

constexpr int64_t kGrain = 32768;
constexpr int64_t kTile = 8192;  // elements per square-root call

// Each ATen op of the loop, with the scalar as that op converts it (to the tensor's dtype). The
// `1` functions write what a tile's square roots are taken of into r; the `2` functions read the
// roots from r.
template <typename T>
IMGTRAIN_AI void rmsprop1_t(const T* p, const T* g, T* sq, T* r, int64_t n, T one_minus_alpha, T eps, T wd, bool decay) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = decay ? std::fma(p[i], wd, g[i]) : g[i];                   // grad.add(p, wd)
    const T s = std::fma(gi * gi - sq[i], one_minus_alpha, sq[i]);          // sq.add_(g.pow(2) - sq, 1 - alpha)
    sq[i] = s;
    r[i] = s + eps;                                                          // sq.add(eps), then .sqrt_()
  }
}

template <typename T>
IMGTRAIN_AI void rmsprop2_t(T* p, const T* g, T* buf, const T* r, int64_t n, T lr, T neg_lr, T wd, T momentum,
                            bool decay) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = decay ? std::fma(p[i], wd, g[i]) : g[i];                   // p is unchanged since rmsprop1
    const T avg = r[i];
    if (buf) {
      const T b = buf[i] * momentum + (lr * gi) / avg;                       // buf.mul_(m).addcdiv_(g, avg, lr)
      buf[i] = b;
      p[i] = p[i] - b;                                                       // p.sub_(buf)
    } else {
      p[i] = p[i] + (neg_lr * gi) / avg;                                     // p.addcdiv_(g, avg, -lr)
    }
  }
}

template <typename T>
IMGTRAIN_AI void lars_t(T* p, const T* g, T* buf, int64_t n, bool first, T neg_lr, T wd, T trust, T momentum,
                        bool nesterov, bool decay) {
  for (int64_t i = 0; i < n; ++i) {
    const T d = decay ? std::fma(p[i], wd, g[i]) * trust : g[i];             // grad.add(p, wd).mul_(trust)
    T u = d;
    if (buf) {
      const T b = first ? d : buf[i] * momentum + d;                         // buf.mul_(m).add_(d)
      buf[i] = b;
      u = nesterov ? std::fma(b, momentum, d) : b;                           // d.add(buf, m)
    }
    p[i] = std::fma(u, neg_lr, p[i]);                                        // p.add_(u, -lr)
  }
}

template <typename T>
IMGTRAIN_AI void lamb1_t(const T* g, T* m, T* v, T* r, int64_t n, T clip, T w1, T b2, T one_minus_b2) {
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i] / clip;                                                // grad / clip
    m[i] = std::fma(w1, gi - m[i], m[i]);                                    // m.lerp_(g, 1 - b1), weight < 0.5
    const T vi = std::fma(one_minus_b2 * gi, gi, v[i] * b2);                 // v.mul_(b2).addcmul_(g, g, 1 - b2)
    v[i] = vi;
    r[i] = vi;                                                               // v.sqrt()
  }
}

template <typename T>
IMGTRAIN_AI void lamb2_t(const T* p, const T* m, const T* r, T* u, int64_t n, T bc1, T sqrt_bc2, T eps, T wd,
                         bool decay) {
  for (int64_t i = 0; i < n; ++i) {
    const T ui = (m[i] / bc1) / (r[i] / sqrt_bc2 + eps);                     // (m / bc1).div_(v.sqrt() / sqrt(bc2) + eps)
    u[i] = decay ? std::fma(p[i], wd, ui) : ui;                              // update.add_(p, wd)
  }
}

template <typename T>
IMGTRAIN_AI void lamb_apply_t(T* p, const T* u, int64_t n, T neg_lr, T trust, bool scale) {
  for (int64_t i = 0; i < n; ++i) p[i] = std::fma(scale ? u[i] * trust : u[i], neg_lr, p[i]);  // update.mul_(trust); p.add_
}

#define IMGTRAIN_STEP_ENTRIES(T, ATTR)                                                                              \
  ATTR void rmsprop1(const T* p, const T* g, T* sq, T* r, int64_t n, T oma, T eps, T wd, bool decay) {              \
    rmsprop1_t<T>(p, g, sq, r, n, oma, eps, wd, decay);                                                             \
  }                                                                                                                 \
  ATTR void rmsprop2(T* p, const T* g, T* buf, const T* r, int64_t n, T lr, T neg_lr, T wd, T mom, bool decay) {    \
    rmsprop2_t<T>(p, g, buf, r, n, lr, neg_lr, wd, mom, decay);                                                     \
  }                                                                                                                 \
  ATTR void lars(T* p, const T* g, T* buf, int64_t n, bool first, T neg_lr, T wd, T trust, T mom, bool nesterov,    \
                 bool decay) {                                                                                      \
    lars_t<T>(p, g, buf, n, first, neg_lr, wd, trust, mom, nesterov, decay);                                        \
  }                                                                                                                 \
  ATTR void lamb1(const T* g, T* m, T* v, T* r, int64_t n, T clip, T w1, T b2, T omb2) {                            \
    lamb1_t<T>(g, m, v, r, n, clip, w1, b2, omb2);                                                                  \
  }                                                                                                                 \
  ATTR void lamb2(const T* p, const T* m, const T* r, T* u, int64_t n, T bc1, T sbc2, T eps, T wd, bool decay) {    \
    lamb2_t<T>(p, m, r, u, n, bc1, sbc2, eps, wd, decay);                                                           \
  }                                                                                                                 \
  ATTR void lamb3(T* p, const T* u, int64_t n, T neg_lr, T trust, bool scale) {                                     \
    lamb_apply_t<T>(p, u, n, neg_lr, trust, scale);                                                                 \
  }
IMGTRAIN_STEP_ENTRIES(float, IMGTRAIN_CLONES)
IMGTRAIN_STEP_ENTRIES(double, )

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Runs f(begin, end) over the parameter's elements in memory order, split among the threads.
template <typename F>
void over_elements(const at::Tensor& p, F f) {
  at::parallel_for(0, p.numel(), kGrain, f);
}

// Runs f(begin, end, roots) over tiles of at most kTile elements, where f calls roots(r) once
// for its tile's buffer r: ATen's square root of r in place.
template <typename T, typename F>
void over_tiles(const at::Tensor& p, F f) {
  over_elements(p, [&](int64_t b, int64_t e) {
    std::vector<T> r(std::min(kTile, e - b));
    for (int64_t t = b; t < e; t += kTile) {
      const int64_t len = std::min(kTile, e - t);
      f(t, t + len, r.data(), [&](T* data) {
        auto v = at::from_blob(data, {len}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
        at::sqrt_out(v, v);
      });
    }
  });
}

}  // namespace

bool optim_step_supported(const at::Tensor& p, std::initializer_list<at::Tensor> others) {
  if (!p.defined() || !p.device().is_cpu() || p.layout() != at::kStrided || !p.is_non_overlapping_and_dense() ||
      (p.scalar_type() != at::kFloat && p.scalar_type() != at::kDouble))
    return false;
  for (auto& t : others)
    if (t.defined() && (!t.device().is_cpu() || t.layout() != at::kStrided || t.scalar_type() != p.scalar_type() ||
                        t.sizes() != p.sizes() || t.strides() != p.strides()))
      return false;
  return true;
}

// Offsets below index each tensor from its first element in memory (dense, same strides as p):
// data_ptr points at the element of index 0, which for a dense tensor with non-negative strides
// is the lowest address.
void rmsprop_tf_step(at::Tensor& p, const at::Tensor& grad, at::Tensor& square_avg, at::Tensor& buf, double lr,
                     double alpha, double eps, double weight_decay, double momentum) {
  RECORD_FUNCTION("imgtrain::rmsprop_tf_step", std::vector<c10::IValue>());
  const bool use_buf = momentum > 0;
  TORCH_CHECK(optim_step_supported(p, {grad, square_avg, use_buf ? buf : at::Tensor()}), "rmsprop_tf_step: unsupported");
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "rmsprop_tf_step", [&] {
    using T = scalar_t;
    T *P = ptr<T>(p), *S = ptr<T>(square_avg), *B = use_buf ? ptr<T>(buf) : nullptr;
    const T* G = ptr<T>(grad);
    const bool decay = weight_decay != 0;
    over_tiles<T>(p, [&](int64_t b, int64_t e, T* r, auto roots) {
      rmsprop1(P + b, G + b, S + b, r, e - b, T(1.0 - alpha), T(eps), T(weight_decay), decay);
      roots(r);
      rmsprop2(P + b, G + b, B ? B + b : nullptr, r, e - b, T(lr), T(-lr), T(weight_decay), T(momentum), decay);
    });
  });
}

void lars_sgd_step(at::Tensor& p, const at::Tensor& grad, at::Tensor& buf, bool first, double lr, double weight_decay,
                   double trust, double momentum, bool nesterov) {
  RECORD_FUNCTION("imgtrain::lars_sgd_step", std::vector<c10::IValue>());
  const bool use_buf = momentum != 0;
  TORCH_CHECK(optim_step_supported(p, {grad, use_buf ? buf : at::Tensor()}), "lars_sgd_step: unsupported");
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "lars_sgd_step", [&] {
    using T = scalar_t;
    T *P = ptr<T>(p), *B = use_buf ? ptr<T>(buf) : nullptr;
    const T* G = ptr<T>(grad);
    over_elements(p, [&](int64_t b, int64_t e) {
      lars(P + b, G + b, B ? B + b : nullptr, e - b, first, T(-lr), T(weight_decay), T(trust), T(momentum), nesterov,
           weight_decay != 0);
    });
  });
}

void lamb_moments(const at::Tensor& p, const at::Tensor& grad, at::Tensor& m, at::Tensor& v, at::Tensor& update,
                  double clip, double b1, double b2, double bc1, double bc2, double eps, double weight_decay) {
  RECORD_FUNCTION("imgtrain::lamb_moments", std::vector<c10::IValue>());
  TORCH_CHECK(optim_step_supported(p, {grad, m, v, update}) && 1.0 - b1 < 0.5, "lamb_moments: unsupported");
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "lamb_moments", [&] {
    using T = scalar_t;
    const T *P = ptr<T>(p), *G = ptr<T>(grad);
    T *M = ptr<T>(m), *V = ptr<T>(v), *U = ptr<T>(update);
    over_tiles<T>(p, [&](int64_t b, int64_t e, T* r, auto roots) {
      lamb1(G + b, M + b, V + b, r, e - b, T(clip), T(1.0 - b1), T(b2), T(1.0 - b2));
      roots(r);
      lamb2(P + b, M + b, r, U + b, e - b, T(bc1), T(std::sqrt(bc2)), T(eps), T(weight_decay), weight_decay != 0);
    });
  });
}

void lamb_apply(at::Tensor& p, const at::Tensor& update, double lr, bool scale_update, double trust) {
  RECORD_FUNCTION("imgtrain::lamb_apply", std::vector<c10::IValue>());
  TORCH_CHECK(optim_step_supported(p, {update}), "lamb_apply: unsupported");
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "lamb_apply", [&] {
    using T = scalar_t;
    T* P = ptr<T>(p);
    const T* U = ptr<T>(update);
    over_elements(p, [&](int64_t b, int64_t e) { lamb3(P + b, U + b, e - b, T(-lr), T(trust), scale_update); });
  });
}

}  // namespace imgtrain::ops
