#include "model_zoo/layers/layers.h"

#include <torch/torch.h>

namespace imgtrain::model_zoo {

at::Tensor drop_path(const at::Tensor& x, double p, bool training) {
  if (p == 0.0 || !training) return x;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  auto keep = torch::empty(shape, x.options()).bernoulli_(1.0 - p);
  return x * keep.div_(1.0 - p);
}

}  // namespace imgtrain::model_zoo
