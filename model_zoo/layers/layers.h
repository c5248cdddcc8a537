// Shared building blocks used by several model families.
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace imgtrain::model_zoo {

// Stochastic depth per sample (timm's drop_path): in training, zero whole samples of the residual
// branch with probability p and scale the survivors by 1 / (1 - p).
at::Tensor drop_path(const at::Tensor& x, double p, bool training);

}  // namespace imgtrain::model_zoo

namespace imgtrain::model_zoo {
// torch.nn.init.trunc_normal_ (inverse-CDF sampling): normal(mean, std) truncated to [a, b].
void trunc_normal_(at::Tensor t, double mean, double std, double a, double b);
}  // namespace imgtrain::model_zoo
