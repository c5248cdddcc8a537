// timm's image augmentations: --aa (RandAugment, AutoAugment, AugMix), --color-jitter and
// --reprob (RandomErasing). The policies are decoded from timm's strings exactly as timm 1.0
// decodes them, and the pixel operations redo PIL's arithmetic (LUTs, float32 blends, 16.16
// fixed-point nearest warps, ...) so an op gives the bytes PIL gives. All randomness comes from
// the caller's generator: the same generator state gives the same image, on any thread.
//
// Images are 8-bit HWC cv::Mat, RGB order (CV_8UC3) or grayscale (CV_8UC1, timm's 'L' mode for
// in_chans 1). Results may share pixels with the input when an op leaves the image unchanged:
// treat inputs and outputs as read-only values.
#pragma once
#include "core/rng.h"

#include <opencv2/core.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace imgtrain::data {

// PIL's resampling filters for Image.transform (it accepts no others).
enum class Interp { Nearest, Bilinear, Bicubic };

// timm's aa hparams. Defaults are timm's _HPARAMS_DEFAULT; timm_aa_hparams() gives what
// create_transform passes for a training run.
struct AugHParams {
  int translate_const = 250;                       // TranslateX/Y pixels at magnitude 10
  double translate_pct = 0.45;                     // Translate*Rel fraction at magnitude 10
  std::array<uint8_t, 3> img_mean{128, 128, 128};  // fill of geometric ops
  std::optional<Interp> interpolation;             // unset: bilinear or bicubic, drawn per op
};

// create_transform's aa_params: translate_const = int(0.45 * min size), img_mean = the dataset
// mean in 0..255 (Python's half-even round), translate_pct 0.3 for AugMix, and the training
// interpolation unless it is 'random'. Interpolations PIL's transform cannot do are a UserError.
AugHParams timm_aa_hparams(std::string_view aa, int img_size_min, const std::vector<double>& mean,
                           std::string_view interpolation);

// One timm AugmentOp as decoded: the op name (a key of timm's NAME_TO_OP), the probability of
// applying it and its magnitude with timm's noise settings.
struct OpSpec {
  std::string name;
  double prob = 0.5;
  double magnitude = 10;
  double magnitude_std = 0;          // > 0: gaussian noise; +inf: uniform in [0, magnitude]
  std::optional<int> magnitude_max;  // timm's mmax; unset (or 0) clamps magnitudes to 10
};

enum class PolicyKind { RandAugment, AutoAugment, AugMix };

struct AugmentPolicy {
  PolicyKind kind = PolicyKind::RandAugment;
  std::string config;  // the --aa string
  AugHParams hparams;
  std::vector<OpSpec> ops;                        // RandAugment, AugMix
  std::vector<std::vector<OpSpec>> sub_policies;  // AutoAugment: one is drawn per image
  int num_layers = 2;                             // RandAugment: ops applied per image
  std::vector<double> choice_weights;             // RandAugment: empty = uniform, with replacement;
                                                  // else weighted, without replacement
  int width = 3;                                  // AugMix chains
  int depth = -1;                                 // AugMix ops per chain, -1 = 1..3 at random
  double alpha = 1.0;                             // AugMix Dirichlet / Beta parameter
  bool blended = false;                           // AugMix blended mode
};

// Decodes --aa as timm does: 'rand...' -> RandAugment ('rand-m9-n2-mstd0.5-mmax10-inc1-p0.5-
// tweights'), 'augmix...' -> AugMix ('augmix-m3-w3-d2-a1-b0-mstd0'), anything else ->
// AutoAugment ('v0', 'v0r', 'original', 'originalr', '3a', optionally '-mstd0.5'). Sections
// without a digit are ignored, as in timm. Strings timm rejects are a UserError.
AugmentPolicy parse_augment(const std::string& config, const AugHParams& hparams = {});

// Every op name timm knows (LEVEL_TO_ARG's keys), in timm's order.
const std::vector<std::string>& augment_op_names();

// The arguments timm's level_fn gives `op` at `magnitude`. `negate` is the outcome of timm's
// _randomly_negate coin; it matters only where op_has_random_sign(op) (for the *Increasing
// enhance ops it flips the offset from 1 before the 0.1 floor, not the result). Integers
// (posterize bits, solarize thresholds) come back as exact doubles. Unknown ops: invalid_argument.
std::vector<double> level_to_args(std::string_view op, double magnitude, const AugHParams& hp, bool negate = false);
bool op_has_random_sign(std::string_view op);
// timm's _randomly_negate coin: true with probability 1/2.
bool draw_negate(std::mt19937_64& rng);
// The magnitude an AugmentOp call uses: noise as configured, then clamped to [0, mmax or 10].
double sample_magnitude(const OpSpec& op, std::mt19937_64& rng);

// Runs op `name` with level arguments `args`. Geometric ops draw their interpolation from `rng`
// unless hp.interpolation is set; GaussianBlurRand draws its radius.
cv::Mat apply_op(const cv::Mat& img, std::string_view name, std::span<const double> args, const AugHParams& hp,
                 std::mt19937_64& rng);
// timm's AugmentOp.__call__: the probability coin, the magnitude, the level args, the op.
cv::Mat apply_op(const cv::Mat& img, const OpSpec& op, const AugHParams& hp, std::mt19937_64& rng);
// RandAugment's choice of ops for one image (indices into policy.ops), drawn before any op runs.
std::vector<size_t> draw_rand_augment_ops(const AugmentPolicy& policy, std::mt19937_64& rng);
// The whole policy on one image.
cv::Mat apply_augment(const cv::Mat& img, const AugmentPolicy& policy, std::mt19937_64& rng);
// AugMix's final step (blended=False): sum of weights[i] * chains[i] in float32, clipped and
// truncated to 8 bits, then PIL-blended with the original by m.
cv::Mat augmix_mix(const cv::Mat& img, const std::vector<cv::Mat>& chains, std::span<const float> weights, float m);

// PIL's operations, as timm's op functions call them.
namespace pil {
using Fill = std::array<uint8_t, 3>;
cv::Mat invert(const cv::Mat& img);
cv::Mat posterize(const cv::Mat& img, int bits);  // bits >= 8: unchanged; bits <= 0: black
cv::Mat solarize(const cv::Mat& img, int threshold);
cv::Mat solarize_add(const cv::Mat& img, int add, int threshold = 128);
cv::Mat autocontrast(const cv::Mat& img);
cv::Mat equalize(const cv::Mat& img);
// Image.blend: im1 + alpha * (im2 - im1) in float32, truncated; clipped when extrapolating.
cv::Mat blend(const cv::Mat& im1, const cv::Mat& im2, float alpha);
cv::Mat color(const cv::Mat& img, double factor);  // ImageEnhance.Color (saturation)
cv::Mat contrast(const cv::Mat& img, double factor);
cv::Mat brightness(const cv::Mat& img, double factor);
cv::Mat sharpness(const cv::Mat& img, double factor);
cv::Mat gaussian_blur(const cv::Mat& img, double radius);  // ImageFilter.GaussianBlur (3 box passes)
// Image.transform(size, AFFINE, m): output pixel (x, y) samples input at m applied to
// (x + 0.5, y + 0.5); samples outside the input take `fill`.
cv::Mat affine(const cv::Mat& img, const std::array<double, 6>& m, Interp interp, Fill fill);
cv::Mat rotate(const cv::Mat& img, double degrees, Interp interp, Fill fill);  // counter-clockwise
cv::Mat shear_x(const cv::Mat& img, double factor, Interp interp, Fill fill);
cv::Mat shear_y(const cv::Mat& img, double factor, Interp interp, Fill fill);
cv::Mat translate_x(const cv::Mat& img, double pixels, Interp interp, Fill fill);
cv::Mat translate_y(const cv::Mat& img, double pixels, Interp interp, Fill fill);
}  // namespace pil

// torchvision's ColorJitter as timm builds it from --color-jitter v: brightness, contrast and
// saturation factors uniform in [max(0, 1 - v), 1 + v], applied in a random order; a 0 turns
// that part off. (timm passes no hue for a float --color-jitter.)
struct ColorJitterConfig {
  double brightness = 0.4;
  double contrast = 0.4;
  double saturation = 0.4;
};
struct ColorJitterParams {
  std::array<int, 3> order{0, 1, 2};  // 0 brightness, 1 contrast, 2 saturation
  std::optional<double> brightness, contrast, saturation;
};
ColorJitterParams draw_color_jitter(const ColorJitterConfig& cfg, std::mt19937_64& rng);
cv::Mat apply_color_jitter(const cv::Mat& img, const ColorJitterParams& params);
cv::Mat color_jitter(const cv::Mat& img, const ColorJitterConfig& cfg, std::mt19937_64& rng);

// timm's RandomErasing on one normalized image (CV_32FC3 or CV_32FC1, HWC), in place.
enum class EraseMode { Const, Rand, Pixel };        // zeros | one normal value per channel | per pixel
EraseMode parse_erase_mode(std::string_view mode);  // timm's --remode; others are a UserError
struct RandomErasingConfig {
  double probability = 0.5;
  double min_area = 0.02;
  double max_area = 1.0 / 3.0;
  double min_aspect = 0.3;
  std::optional<double> max_aspect;  // unset: 1 / min_aspect
  EraseMode mode = EraseMode::Const;
  int min_count = 1;
  int max_count = 1;  // timm's --recount; < min_count means min_count
};
// Returns the erased rectangles (empty when the probability coin said no).
std::vector<cv::Rect> random_erasing(cv::Mat& img, const RandomErasingConfig& cfg, std::mt19937_64& rng);
// The same draws without an image: where to erase and with what, so the pixels can be written
// wherever the image lives (a GPU batch). values: `channels` numbers for const / rand (the fill
// of each channel), rect.height x rect.width x channels (HWC) for pixel.
struct ErasePatch {
  cv::Rect rect;
  std::vector<float> values;
};
std::vector<ErasePatch> plan_random_erasing(int img_h, int img_w, int channels, const RandomErasingConfig& cfg,
                                            std::mt19937_64& rng);

}  // namespace imgtrain::data
