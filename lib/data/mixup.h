// timm's Mixup / CutMix on a normalised float NCHW batch (timm's `Mixup`, the non-prefetcher
// path): per batch, per pair or per element, mixing each sample with its mirror in the batch
// (index B - 1 - i), and the matching soft targets with label smoothing. Randomness comes from
// a generator the caller seeds (imgtrain: seed, epoch, batch index), so runs are reproducible.
#pragma once
#include <ATen/core/Tensor.h>

#include <random>
#include <string>
#include <vector>

namespace imgtrain::data {

struct MixupConfig {
  double mixup_alpha = 0.0;
  double cutmix_alpha = 0.0;
  std::vector<double> cutmix_minmax;  // empty, or {min, max}: box sides as fractions of the image
  double prob = 1.0;
  double switch_prob = 0.5;
  std::string mode = "batch";  // batch | pair | elem
  bool correct_lam = true;
  double label_smoothing = 0.1;
  int64_t num_classes = 1000;
  bool active() const { return mixup_alpha > 0 || cutmix_alpha > 0 || !cutmix_minmax.empty(); }
};

// timm's mixup_target: smoothed one-hot targets mixed with their mirror, lam per batch [1] or
// per sample [B, 1].
at::Tensor mixup_target(const at::Tensor& target, int64_t num_classes, const at::Tensor& lam, double smoothing);

struct CutBox {
  int64_t yl, yh, xl, xh;
  double lam;  // corrected for the clipped area when asked
};
// timm's cutmix_bbox_and_lam for an image of h x w.
CutBox cutmix_box(int64_t h, int64_t w, double lam, const std::vector<double>& minmax, bool correct_lam,
                  std::mt19937_64& rng);

// Mixes `x` (float [B, C, H, W], B even) in place and returns the soft targets [B, num_classes].
at::Tensor apply_mixup(at::Tensor& x, const at::Tensor& target, const MixupConfig& cfg, std::mt19937_64& rng);

}  // namespace imgtrain::data
