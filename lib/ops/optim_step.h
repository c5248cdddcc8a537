// One-pass CPU steps for the optimizers ATen has no fused kernel for: timm's RMSpropTF, the
// element-wise part of LARS (after its two norms) and LAMB (before and after its two norms).
// Each reads a parameter, its gradient and its state once and writes them once, where the loop of
// ATen ops the optimizer is written as (lib/optim) makes 9-15 passes and several full-size
// temporaries. Every element takes exactly the roundings of those ATen ops (a product and sum
// ATen's kernels contract into one fused multiply-add is one std::fma here, a product then a sum
// that they round apart stays two roundings), so the result is bitwise the loop's (unit test),
// and, element-wise, independent of the thread count. Dense float32 / float64 tensors on the CPU
// whose gradient and state tensors have the parameter's dtype, sizes and strides.
#pragma once
#include <ATen/core/Tensor.h>

namespace imgtrain::ops {

// Whether the step kernels take p with these tensors (undefined ones are skipped).
bool optim_step_supported(const at::Tensor& p, std::initializer_list<at::Tensor> others);

// timm's RMSpropTF for one parameter, in place:
//   g = grad (+ wd * p); sq += (g*g - sq) * (1 - alpha); avg = sqrt(sq + eps)
//   momentum > 0: buf = buf * momentum + lr * g / avg; p -= buf
//   else:         p += -lr * g / avg
// buf is unused (may be undefined) when momentum is 0.
void rmsprop_tf_step(at::Tensor& p, const at::Tensor& grad, at::Tensor& square_avg, at::Tensor& buf, double lr,
                     double alpha, double eps, double weight_decay, double momentum);

// SGD with momentum on the gradient d = (grad + wd * p) * trust (wd 0: d = grad, trust unused),
// as LARS takes it after computing its trust ratio:
//   first: buf = d, else buf = buf * momentum + d; update = nesterov ? d + momentum * buf : buf
//   (momentum 0: update = d); p += -lr * update.
void lars_sgd_step(at::Tensor& p, const at::Tensor& grad, at::Tensor& buf, bool first, double lr, double weight_decay,
                   double trust, double momentum, bool nesterov);

// LAMB's moments and raw update for one parameter: g = grad / clip; m = lerp(m, g, 1 - b1);
// v = v * b2 + (1 - b2) * g * g; update = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) (+ wd * p).
// Writes update (allocated like p).
void lamb_moments(const at::Tensor& p, const at::Tensor& grad, at::Tensor& m, at::Tensor& v, at::Tensor& update,
                  double clip, double b1, double b2, double bc1, double bc2, double eps, double weight_decay);

// p += -lr * (scale_update ? update * trust : update).
void lamb_apply(at::Tensor& p, const at::Tensor& update, double lr, bool scale_update, double trust);

}  // namespace imgtrain::ops
