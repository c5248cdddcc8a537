#include "model_zoo/layers/layers.h"

#include <torch/torch.h>

#include <cmath>

namespace imgtrain::model_zoo {

at::Tensor drop_path(const at::Tensor& x, double p, bool training) {
  if (p == 0.0 || !training) return x;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  auto keep = torch::empty(shape, x.options()).bernoulli_(1.0 - p);
  return x * keep.div_(1.0 - p);
}

}  // namespace imgtrain::model_zoo

namespace imgtrain::model_zoo {
void trunc_normal_(at::Tensor t, double mean, double std, double a, double b) {
  torch::NoGradGuard ng;
  auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double l = cdf((a - mean) / std), u = cdf((b - mean) / std);
  t.uniform_(2 * l - 1, 2 * u - 1).erfinv_().mul_(std * std::sqrt(2.0)).add_(mean).clamp_(a, b);
}
}  // namespace imgtrain::model_zoo
