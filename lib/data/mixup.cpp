#include "data/mixup.h"

#include "core/rng.h"

#include <torch/torch.h>

#include <cmath>

namespace imgtrain::data {
namespace {

struct Params {
  double lam = 1.0;
  bool cutmix = false;
};

// One draw of (lam, use_cutmix) as timm's _params_per_batch / one element of _params_per_elem.
Params draw(const MixupConfig& c, std::mt19937_64& rng) {
  Params p;
  if (uniform(rng, 0, 1) >= c.prob) return p;
  const double cut_alpha = c.cutmix_minmax.empty() ? c.cutmix_alpha : 1.0;
  if (c.mixup_alpha > 0 && cut_alpha > 0) {
    p.cutmix = uniform(rng, 0, 1) < c.switch_prob;
    p.lam = p.cutmix ? sample_beta(cut_alpha, cut_alpha, rng) : sample_beta(c.mixup_alpha, c.mixup_alpha, rng);
  } else if (c.mixup_alpha > 0) {
    p.lam = sample_beta(c.mixup_alpha, c.mixup_alpha, rng);
  } else {
    p.cutmix = true;
    p.lam = sample_beta(cut_alpha, cut_alpha, rng);
  }
  return p;
}

}  // namespace

at::Tensor mixup_target(const at::Tensor& target, int64_t num_classes, const at::Tensor& lam, double smoothing) {
  const double off = smoothing / double(num_classes), on = 1.0 - smoothing + off;
  auto y1 = torch::full({target.size(0), num_classes}, off, torch::TensorOptions().dtype(torch::kFloat32).device(target.device()))
                .scatter_(1, target.view({-1, 1}).to(torch::kLong), on);
  auto y2 = y1.flip(0);
  auto l = lam.to(y1.device(), torch::kFloat32);
  return y1 * l + y2 * (1.0 - l);
}

CutBox cutmix_box(int64_t h, int64_t w, double lam, const std::vector<double>& minmax, bool correct_lam,
                  std::mt19937_64& rng) {
  CutBox b{};
  if (!minmax.empty()) {
    const int64_t ch = randint(rng, int64_t(h * minmax[0]), std::max(int64_t(h * minmax[0]), int64_t(h * minmax[1]) - 1));
    const int64_t cw = randint(rng, int64_t(w * minmax[0]), std::max(int64_t(w * minmax[0]), int64_t(w * minmax[1]) - 1));
    b.yl = randint(rng, 0, h - ch);
    b.xl = randint(rng, 0, w - cw);
    b.yh = b.yl + ch;
    b.xh = b.xl + cw;
  } else {
    const double ratio = std::sqrt(1.0 - lam);
    const int64_t ch = int64_t(double(h) * ratio), cw = int64_t(double(w) * ratio);
    const int64_t cy = randint(rng, 0, h - 1), cx = randint(rng, 0, w - 1);
    b.yl = std::clamp<int64_t>(cy - ch / 2, 0, h);
    b.yh = std::clamp<int64_t>(cy + (ch + 1) / 2, 0, h);
    b.xl = std::clamp<int64_t>(cx - cw / 2, 0, w);
    b.xh = std::clamp<int64_t>(cx + (cw + 1) / 2, 0, w);
  }
  b.lam = lam;
  if (correct_lam || !minmax.empty()) b.lam = 1.0 - double((b.yh - b.yl) * (b.xh - b.xl)) / double(h * w);
  return b;
}

at::Tensor apply_mixup(at::Tensor& x, const at::Tensor& target, const MixupConfig& c, std::mt19937_64& rng) {
  torch::NoGradGuard ng;
  using torch::indexing::Slice;
  const int64_t n = x.size(0), h = x.size(2), w = x.size(3);
  if (c.mode == "batch") {
    Params p = draw(c, rng);
    double lam = p.lam;
    if (lam != 1.0) {
      if (p.cutmix) {
        auto b = cutmix_box(h, w, lam, c.cutmix_minmax, c.correct_lam, rng);
        auto region = x.flip(0).index({Slice(), Slice(), Slice(b.yl, b.yh), Slice(b.xl, b.xh)});
        x.index_put_({Slice(), Slice(), Slice(b.yl, b.yh), Slice(b.xl, b.xh)}, region);
        lam = b.lam;
      } else {
        auto flipped = x.flip(0).mul_(1.0 - lam);
        x.mul_(lam).add_(flipped);
      }
    }
    return mixup_target(target, c.num_classes, torch::tensor(lam), c.label_smoothing);
  }
  // pair / elem: sample i mixes with j = n - 1 - i, from the unmixed batch.
  const bool pair = c.mode == "pair";
  const int64_t count = pair ? n / 2 : n;
  auto orig = x.clone();
  std::vector<float> lams(size_t(n), 1.0f);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = n - i - 1;
    Params p = draw(c, rng);
    double lam = p.lam;
    if (lam != 1.0) {
      if (p.cutmix) {
        auto b = cutmix_box(h, w, lam, c.cutmix_minmax, c.correct_lam, rng);
        auto box = std::vector<at::indexing::TensorIndex>{Slice(), Slice(b.yl, b.yh), Slice(b.xl, b.xh)};
        x[i].index_put_(box, orig[j].index(box));
        if (pair) x[j].index_put_(box, orig[i].index(box));
        lam = b.lam;
      } else {
        x[i] = orig[i] * lam + orig[j] * (1.0 - lam);
        if (pair) x[j] = orig[j] * lam + orig[i] * (1.0 - lam);
      }
    }
    lams[size_t(i)] = float(lam);
    if (pair) lams[size_t(j)] = float(lam);
  }
  return mixup_target(target, c.num_classes, torch::tensor(lams).unsqueeze(1), c.label_smoothing);
}

}  // namespace imgtrain::data
