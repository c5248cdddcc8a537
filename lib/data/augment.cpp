#include "data/augment.h"

#include "core/error.h"

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numbers>
#include <stdexcept>

namespace imgtrain::data {

namespace {

// timm's _LEVEL_DENOM: magnitudes are on a 0..10 scale.
constexpr double kLevelDenom = 10.0;

// ---- level functions: timm's _LEVEL_TO_ARG, with the sign coin passed in ----------------------
// Each keeps timm's order of floating-point operations so the arguments match to the last bit.

using LevelFn = std::vector<double> (*)(double level, const AugHParams& hp, bool negate);

double signed_(double v, bool negate) { return negate ? -v : v; }

std::vector<double> rotate_level(double level, const AugHParams&, bool neg) {
  return {signed_((level / kLevelDenom) * 30.0, neg)};
}
std::vector<double> enhance_level(double level, const AugHParams&, bool) { return {(level / kLevelDenom) * 1.8 + 0.1}; }
std::vector<double> enhance_increasing_level(double level, const AugHParams&, bool neg) {
  double v = (level / kLevelDenom) * 0.9;
  return {std::max(0.1, 1.0 + signed_(v, neg))};
}
template <int kMin10, int kMax10>  // bounds in tenths: templates take no doubles portably
std::vector<double> minmax_level(double level, const AugHParams&, bool) {
  const double lo = kMin10 / 10.0, hi = kMax10 / 10.0;
  double v = lo + (hi - lo) * (level / kLevelDenom);
  return {std::max(lo, std::min(hi, v))};
}
std::vector<double> shear_level(double level, const AugHParams&, bool neg) {
  return {signed_((level / kLevelDenom) * 0.3, neg)};
}
std::vector<double> translate_abs_level(double level, const AugHParams& hp, bool neg) {
  return {signed_((level / kLevelDenom) * double(hp.translate_const), neg)};
}
std::vector<double> translate_rel_level(double level, const AugHParams& hp, bool neg) {
  return {signed_((level / kLevelDenom) * hp.translate_pct, neg)};
}
double posterize_bits(double level) { return std::trunc((level / kLevelDenom) * 4); }
std::vector<double> posterize_level(double level, const AugHParams&, bool) { return {posterize_bits(level)}; }
std::vector<double> posterize_increasing_level(double level, const AugHParams&, bool) {
  return {4 - posterize_bits(level)};
}
std::vector<double> posterize_original_level(double level, const AugHParams&, bool) {
  return {posterize_bits(level) + 4};
}
double solarize_thresh(double level) { return std::min(256.0, std::trunc((level / kLevelDenom) * 256)); }
std::vector<double> solarize_level(double level, const AugHParams&, bool) { return {solarize_thresh(level)}; }
std::vector<double> solarize_increasing_level(double level, const AugHParams&, bool) {
  return {256 - solarize_thresh(level)};
}
std::vector<double> solarize_add_level(double level, const AugHParams&, bool) {
  return {std::min(128.0, std::trunc((level / kLevelDenom) * 110))};
}

// ---- the op table: timm's NAME_TO_OP + LEVEL_TO_ARG ---------------------------------------------

struct OpContext {
  const AugHParams& hp;
  std::mt19937_64& rng;
};
using OpFn = cv::Mat (*)(const cv::Mat& img, std::span<const double> args, OpContext& ctx);

Interp draw_interp(OpContext& ctx);
pil::Fill fill_of(const OpContext& ctx) { return ctx.hp.img_mean; }

struct OpEntry {
  std::string_view name;
  LevelFn level;     // nullptr: the op takes no argument
  bool random_sign;  // level passes through _randomly_negate
  OpFn run;
};

#define IMGTRAIN_OP(body)                                                        \
  [](const cv::Mat& img, std::span<const double> a, OpContext& ctx) -> cv::Mat { \
    (void)a;                                                                     \
    (void)ctx;                                                                   \
    return body;                                                                 \
  }

const OpEntry kOps[] = {
    {"AutoContrast", nullptr, false, IMGTRAIN_OP(pil::autocontrast(img))},
    {"Equalize", nullptr, false, IMGTRAIN_OP(pil::equalize(img))},
    {"Invert", nullptr, false, IMGTRAIN_OP(pil::invert(img))},
    {"Rotate", rotate_level, true, IMGTRAIN_OP(pil::rotate(img, a[0], draw_interp(ctx), fill_of(ctx)))},
    {"Posterize", posterize_level, false, IMGTRAIN_OP(pil::posterize(img, int(a[0])))},
    {"PosterizeIncreasing", posterize_increasing_level, false, IMGTRAIN_OP(pil::posterize(img, int(a[0])))},
    {"PosterizeOriginal", posterize_original_level, false, IMGTRAIN_OP(pil::posterize(img, int(a[0])))},
    {"Solarize", solarize_level, false, IMGTRAIN_OP(pil::solarize(img, int(a[0])))},
    {"SolarizeIncreasing", solarize_increasing_level, false, IMGTRAIN_OP(pil::solarize(img, int(a[0])))},
    {"SolarizeAdd", solarize_add_level, false, IMGTRAIN_OP(pil::solarize_add(img, int(a[0]), 128))},
    {"Color", enhance_level, false, IMGTRAIN_OP(pil::color(img, a[0]))},
    {"ColorIncreasing", enhance_increasing_level, true, IMGTRAIN_OP(pil::color(img, a[0]))},
    {"Contrast", enhance_level, false, IMGTRAIN_OP(pil::contrast(img, a[0]))},
    {"ContrastIncreasing", enhance_increasing_level, true, IMGTRAIN_OP(pil::contrast(img, a[0]))},
    {"Brightness", enhance_level, false, IMGTRAIN_OP(pil::brightness(img, a[0]))},
    {"BrightnessIncreasing", enhance_increasing_level, true, IMGTRAIN_OP(pil::brightness(img, a[0]))},
    {"Sharpness", enhance_level, false, IMGTRAIN_OP(pil::sharpness(img, a[0]))},
    {"SharpnessIncreasing", enhance_increasing_level, true, IMGTRAIN_OP(pil::sharpness(img, a[0]))},
    {"ShearX", shear_level, true, IMGTRAIN_OP(pil::shear_x(img, a[0], draw_interp(ctx), fill_of(ctx)))},
    {"ShearY", shear_level, true, IMGTRAIN_OP(pil::shear_y(img, a[0], draw_interp(ctx), fill_of(ctx)))},
    {"TranslateX", translate_abs_level, true, IMGTRAIN_OP(pil::translate_x(img, a[0], draw_interp(ctx), fill_of(ctx)))},
    {"TranslateY", translate_abs_level, true, IMGTRAIN_OP(pil::translate_y(img, a[0], draw_interp(ctx), fill_of(ctx)))},
    {"TranslateXRel", translate_rel_level, true,
     IMGTRAIN_OP(pil::translate_x(img, a[0] * img.cols, draw_interp(ctx), fill_of(ctx)))},
    {"TranslateYRel", translate_rel_level, true,
     IMGTRAIN_OP(pil::translate_y(img, a[0] * img.rows, draw_interp(ctx), fill_of(ctx)))},
    // timm turns the level into "how much colour to remove": 1 - level, kept in [0, 1].
    {"Desaturate", minmax_level<5, 10>, false, IMGTRAIN_OP(pil::color(img, std::min(1.0, std::max(0.0, 1.0 - a[0]))))},
    {"GaussianBlur", minmax_level<1, 20>, false, IMGTRAIN_OP(pil::gaussian_blur(img, a[0]))},
    // The level scales the top of a radius drawn in [0.1, 2 * level].
    {"GaussianBlurRand", minmax_level<0, 10>, false,
     IMGTRAIN_OP(pil::gaussian_blur(img, 0.1 + (2.0 * a[0] - 0.1) * uniform01(ctx.rng)))},
};
#undef IMGTRAIN_OP

const OpEntry* find_op(std::string_view name) {
  for (const auto& e : kOps)
    if (e.name == name) return &e;
  return nullptr;
}
const OpEntry& op_or_throw(std::string_view name) {
  if (const auto* e = find_op(name)) return *e;
  throw std::invalid_argument(fmt::format("augment: unknown op '{}'", name));
}

// ---- timm's policy tables ------------------------------------------------------------------------

struct PolicyOp {
  const char* name;
  double prob;
  int magnitude;
};
using SubPolicy = std::vector<PolicyOp>;

// clang-format off
// ImageNet policy 'v0' from the TPU EfficientNet implementation. 'v0r' differs only in using
// PosterizeIncreasing for Posterize, so it is derived below rather than repeated.
const std::vector<SubPolicy> kPolicyV0 = {
    {{"Equalize", 0.8, 1}, {"ShearY", 0.8, 4}},       {{"Color", 0.4, 9}, {"Equalize", 0.6, 3}},
    {{"Color", 0.4, 1}, {"Rotate", 0.6, 8}},          {{"Solarize", 0.8, 3}, {"Equalize", 0.4, 7}},
    {{"Solarize", 0.4, 2}, {"Solarize", 0.6, 2}},     {{"Color", 0.2, 0}, {"Equalize", 0.8, 8}},
    {{"Equalize", 0.4, 8}, {"SolarizeAdd", 0.8, 3}},  {{"ShearX", 0.2, 9}, {"Rotate", 0.6, 8}},
    {{"Color", 0.6, 1}, {"Equalize", 1.0, 2}},        {{"Invert", 0.4, 9}, {"Rotate", 0.6, 0}},
    {{"Equalize", 1.0, 9}, {"ShearY", 0.6, 3}},       {{"Color", 0.4, 7}, {"Equalize", 0.6, 0}},
    {{"Posterize", 0.4, 6}, {"AutoContrast", 0.4, 7}}, {{"Solarize", 0.6, 8}, {"Color", 0.6, 9}},
    {{"Solarize", 0.2, 4}, {"Rotate", 0.8, 9}},       {{"Rotate", 1.0, 7}, {"TranslateYRel", 0.8, 9}},
    {{"ShearX", 0.0, 0}, {"Solarize", 0.8, 4}},       {{"ShearY", 0.8, 0}, {"Color", 0.6, 4}},
    {{"Color", 1.0, 0}, {"Rotate", 0.6, 2}},          {{"Equalize", 0.8, 4}, {"Equalize", 0.0, 8}},
    {{"Equalize", 1.0, 4}, {"AutoContrast", 0.6, 2}}, {{"ShearY", 0.4, 7}, {"SolarizeAdd", 0.6, 7}},
    {{"Posterize", 0.8, 2}, {"Solarize", 0.6, 10}},   {{"Solarize", 0.6, 8}, {"Equalize", 0.6, 1}},
    {{"Color", 0.8, 6}, {"Rotate", 0.4, 5}},
};

// The AutoAugment paper's ImageNet policy. 'originalr' uses PosterizeIncreasing for
// PosterizeOriginal and is otherwise the same.
const std::vector<SubPolicy> kPolicyOriginal = {
    {{"PosterizeOriginal", 0.4, 8}, {"Rotate", 0.6, 9}},
    {{"Solarize", 0.6, 5}, {"AutoContrast", 0.6, 5}},
    {{"Equalize", 0.8, 8}, {"Equalize", 0.6, 3}},
    {{"PosterizeOriginal", 0.6, 7}, {"PosterizeOriginal", 0.6, 6}},
    {{"Equalize", 0.4, 7}, {"Solarize", 0.2, 4}},
    {{"Equalize", 0.4, 4}, {"Rotate", 0.8, 8}},
    {{"Solarize", 0.6, 3}, {"Equalize", 0.6, 7}},
    {{"PosterizeOriginal", 0.8, 5}, {"Equalize", 1.0, 2}},
    {{"Rotate", 0.2, 3}, {"Solarize", 0.6, 8}},
    {{"Equalize", 0.6, 8}, {"PosterizeOriginal", 0.4, 6}},
    {{"Rotate", 0.8, 8}, {"Color", 0.4, 0}},
    {{"Rotate", 0.4, 9}, {"Equalize", 0.6, 2}},
    {{"Equalize", 0.0, 7}, {"Equalize", 0.8, 8}},
    {{"Invert", 0.6, 4}, {"Equalize", 1.0, 8}},
    {{"Color", 0.6, 4}, {"Contrast", 1.0, 8}},
    {{"Rotate", 0.8, 8}, {"Color", 1.0, 2}},
    {{"Color", 0.8, 8}, {"Solarize", 0.8, 7}},
    {{"Sharpness", 0.4, 7}, {"Invert", 0.6, 8}},
    {{"ShearX", 0.6, 5}, {"Equalize", 1.0, 9}},
    {{"Color", 0.4, 0}, {"Equalize", 0.6, 3}},
    {{"Equalize", 0.4, 7}, {"Solarize", 0.2, 4}},
    {{"Solarize", 0.6, 5}, {"AutoContrast", 0.6, 5}},
    {{"Invert", 0.6, 4}, {"Equalize", 1.0, 8}},
    {{"Color", 0.6, 4}, {"Contrast", 1.0, 8}},
    {{"Equalize", 0.8, 8}, {"Equalize", 0.6, 3}},
};

// DeiT III's 3-Augment.
const std::vector<SubPolicy> kPolicy3a = {
    {{"Solarize", 1.0, 5}},
    {{"Desaturate", 1.0, 10}},
    {{"GaussianBlurRand", 1.0, 10}},
};

const std::vector<const char*> kRandTransforms = {
    "AutoContrast", "Equalize", "Invert", "Rotate",  "Posterize", "Solarize",      "SolarizeAdd",  "Color",
    "Contrast",     "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"};
const std::vector<const char*> kRandIncreasingTransforms = {
    "AutoContrast",       "Equalize",           "Invert",  "Rotate", "PosterizeIncreasing",
    "SolarizeIncreasing", "SolarizeAdd",        "ColorIncreasing",   "ContrastIncreasing",
    "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"};
const std::vector<const char*> kRand3a = {"SolarizeIncreasing", "Desaturate", "GaussianBlur"};
const std::vector<std::pair<const char*, double>> kRandWeighted3a = {
    {"SolarizeIncreasing", 6}, {"Desaturate", 6},         {"GaussianBlur", 6},       {"Rotate", 3},
    {"ShearX", 2},             {"ShearY", 2},             {"PosterizeIncreasing", 1}, {"AutoContrast", 1},
    {"ColorIncreasing", 1},    {"SharpnessIncreasing", 1}, {"ContrastIncreasing", 1}, {"BrightnessIncreasing", 1},
    {"Equalize", 1},           {"Invert", 1}};
const std::vector<std::pair<const char*, double>> kRandWeighted0 = {
    {"Rotate", 3},          {"ShearX", 2},          {"ShearY", 2},         {"TranslateXRel", 1},
    {"TranslateYRel", 1},   {"ColorIncreasing", .25}, {"SharpnessIncreasing", 0.25}, {"AutoContrast", 0.25},
    {"SolarizeIncreasing", .05}, {"SolarizeAdd", .05}, {"ContrastIncreasing", .05}, {"BrightnessIncreasing", .05},
    {"Equalize", .05},      {"PosterizeIncreasing", 0.05}, {"Invert", 0.05}};
const std::vector<const char*> kAugMixTransforms = {
    "AutoContrast", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
    "Equalize",     "Rotate",          "PosterizeIncreasing", "SolarizeIncreasing",  "ShearX",
    "ShearY",       "TranslateXRel",   "TranslateYRel"};

// clang-format on

// ---- small helpers ------------------------------------------------------------------------------

void check_u8(const cv::Mat& img, const char* what) {
  if (img.depth() != CV_8U || (img.channels() != 1 && img.channels() != 3) || img.dims != 2)
    throw std::invalid_argument(
        fmt::format("{}: expected an 8-bit 1- or 3-channel image, got type {}", what, img.type()));
}

int64_t randint(std::mt19937_64& rng, int64_t lo, int64_t hi) {  // [lo, hi]
  int64_t n = hi - lo + 1;
  return lo + std::min<int64_t>(n - 1, int64_t(uniform01(rng) * double(n)));
}

Interp draw_interp(OpContext& ctx) {
  if (ctx.hp.interpolation) return *ctx.hp.interpolation;
  return uniform01(ctx.rng) < 0.5 ? Interp::Bilinear : Interp::Bicubic;  // random.choice of two
}

// Python's float % (the result takes the divisor's sign).
double py_mod(double x, double y) {
  double m = std::fmod(x, y);
  if (m != 0) {
    if ((y < 0) != (m < 0)) m += y;
  } else {
    m = std::copysign(0.0, y);
  }
  return m;
}

// Python's round(x, 15): correctly rounded to 15 decimals, which printf also does.
double py_round15(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.15f", x);
  return std::strtod(buf, nullptr);
}

// ---- Python's int() / float() on a --aa value (it always starts with a digit) -------------------

bool digit_part(std::string_view s, size_t& i, std::string& out) {
  if (i >= s.size() || !std::isdigit(static_cast<unsigned char>(s[i]))) return false;
  out += s[i++];
  while (i < s.size()) {
    if (std::isdigit(static_cast<unsigned char>(s[i]))) {
      out += s[i++];
    } else if (s[i] == '_' && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      ++i;  // PEP 515 underscores, as int() and float() accept them
    } else {
      break;
    }
  }
  return true;
}

std::string_view strip(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<int> py_int(std::string_view s) {
  s = strip(s);
  size_t i = 0;
  std::string digits;
  if (!digit_part(s, i, digits) || i != s.size()) return std::nullopt;
  if (digits.size() > 9) return std::nullopt;  // far beyond any sensible setting
  return std::stoi(digits);
}

std::optional<double> py_float(std::string_view s) {
  s = strip(s);
  size_t i = 0;
  std::string num;
  if (!digit_part(s, i, num)) return std::nullopt;
  if (i < s.size() && s[i] == '.') {
    num += s[i++];
    std::string frac;
    if (digit_part(s, i, frac)) num += frac;
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    num += s[i++];
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) num += s[i++];
    std::string exp;
    if (!digit_part(s, i, exp)) return std::nullopt;
    num += exp;
  }
  if (i != s.size()) return std::nullopt;
  return std::strtod(num.c_str(), nullptr);
}

std::vector<std::string> split_dash(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t p = s.find('-', start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

// timm splits a section at its first digit: 'mstd0.5' -> ('mstd', '0.5'). Sections without a
// digit are skipped by timm, hence nullopt.
std::optional<std::pair<std::string, std::string>> key_value(const std::string& section) {
  auto p = std::find_if(section.begin(), section.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (p == section.end()) return std::nullopt;
  return std::pair{std::string(section.begin(), p), std::string(p, section.end())};
}

const char* kAccepted =
    "accepted: rand-<sections> (m<int> n<int> p<float> mstd<float> mmax<int> inc<0|1> t<weights|3a|3aw>), "
    "augmix-<sections> (m<int> w<int> d<int> a<float> b<0|1> mstd<float>), "
    "or an AutoAugment policy v0|v0r|original|originalr|3a with optional -mstd<float>";

[[noreturn]] void bad_aa(const std::string& config, const std::string& why) {
  throw UserError(fmt::format("--aa '{}': {}; {}", config, why, kAccepted));
}

int int_value(const std::string& config, const std::string& key, const std::string& val) {
  auto v = py_int(val);
  if (!v) bad_aa(config, fmt::format("'{}' takes an integer, got '{}'", key, val));
  return *v;
}
double float_value(const std::string& config, const std::string& key, const std::string& val) {
  auto v = py_float(val);
  if (!v) bad_aa(config, fmt::format("'{}' takes a number, got '{}'", key, val));
  return *v;
}

OpSpec make_op(const char* name, double prob, double magnitude, double mstd, std::optional<int> mmax) {
  return OpSpec{name, prob, magnitude, mstd, mmax};
}

AugmentPolicy parse_rand(const std::string& config, const std::vector<std::string>& secs, AugmentPolicy pol) {
  if (secs[0] != "rand") bad_aa(config, fmt::format("unknown RandAugment variant '{}'", secs[0]));
  double magnitude = kLevelDenom;
  int num_layers = 2;
  bool increasing = false;
  double prob = 0.5;
  std::optional<std::string> transforms;
  std::optional<double> mstd;  // timm's hparams.setdefault: the first occurrence wins
  std::optional<int> mmax;
  for (size_t i = 1; i < secs.size(); ++i) {
    const auto& c = secs[i];
    if (!c.empty() && c[0] == 't') {
      if (!transforms) transforms = c.substr(1);
      continue;
    }
    auto kv = key_value(c);
    if (!kv) continue;
    const auto& [key, val] = *kv;
    if (key == "mstd") {
      double v = float_value(config, key, val);
      if (v > 100) v = std::numeric_limits<double>::infinity();  // timm: > 100 means uniform
      if (!mstd) mstd = v;
    } else if (key == "mmax") {
      int v = int_value(config, key, val);
      if (!mmax) mmax = v;
    } else if (key == "inc") {
      increasing = int_value(config, key, val) != 0;
    } else if (key == "m") {
      magnitude = int_value(config, key, val);
    } else if (key == "n") {
      num_layers = int_value(config, key, val);
    } else if (key == "p") {
      prob = float_value(config, key, val);
    } else if (key == "w") {
      bad_aa(config, "unknown RandAugment section '" + c + "' (timm removed 'w'; weighted choice is 'tweights')");
    } else {
      bad_aa(config, "unknown RandAugment section '" + c + "'");
    }
  }
  pol.kind = PolicyKind::RandAugment;
  pol.num_layers = num_layers;
  const std::vector<std::pair<const char*, double>>* weighted = nullptr;
  const std::vector<const char*>* names = increasing ? &kRandIncreasingTransforms : &kRandTransforms;
  if (transforms) {  // timm's rand_augment_choices: unknown names fall back to the default set
    if (*transforms == "weights")
      weighted = &kRandWeighted0;
    else if (*transforms == "3aw")
      weighted = &kRandWeighted3a;
    else if (*transforms == "3a")
      names = &kRand3a;
  }
  auto add = [&](const char* n) { pol.ops.push_back(make_op(n, prob, magnitude, mstd.value_or(0), mmax)); };
  if (weighted) {
    double sum = 0;
    for (const auto& [n, w] : *weighted) sum += w;
    for (const auto& [n, w] : *weighted) {
      add(n);
      pol.choice_weights.push_back(w / sum);
    }
  } else {
    for (const char* n : *names) add(n);
  }
  if (num_layers < 0) bad_aa(config, "'n' must be >= 0");
  if (weighted && size_t(num_layers) > pol.ops.size())  // numpy: weighted choice is without replacement
    bad_aa(config, fmt::format("'n' {} exceeds the {} weighted ops, which are drawn without replacement", num_layers,
                               pol.ops.size()));
  return pol;
}

AugmentPolicy parse_augmix(const std::string& config, const std::vector<std::string>& secs, AugmentPolicy pol) {
  if (secs[0] != "augmix") bad_aa(config, fmt::format("unknown AugMix variant '{}'", secs[0]));
  int magnitude = 3;
  std::optional<double> mstd;
  pol.kind = PolicyKind::AugMix;
  for (size_t i = 1; i < secs.size(); ++i) {
    auto kv = key_value(secs[i]);
    if (!kv) continue;
    const auto& [key, val] = *kv;
    if (key == "mstd") {
      double v = float_value(config, key, val);
      if (!mstd) mstd = v;
    } else if (key == "m") {
      magnitude = int_value(config, key, val);
    } else if (key == "w") {
      pol.width = int_value(config, key, val);
    } else if (key == "d") {
      pol.depth = int_value(config, key, val);
    } else if (key == "a") {
      pol.alpha = float_value(config, key, val);
    } else if (key == "b") {
      pol.blended = int_value(config, key, val) != 0;
    } else {
      bad_aa(config, "unknown AugMix section '" + secs[i] + "'");
    }
  }
  // AugMix samples magnitudes uniformly unless told otherwise.
  double std_ = mstd.value_or(std::numeric_limits<double>::infinity());
  for (const char* n : kAugMixTransforms) pol.ops.push_back(make_op(n, 1.0, magnitude, std_, std::nullopt));
  if (pol.width < 1) bad_aa(config, "'w' must be >= 1");
  if (!(pol.alpha > 0)) bad_aa(config, "'a' must be > 0");
  return pol;
}

AugmentPolicy parse_auto(const std::string& config, const std::vector<std::string>& secs, AugmentPolicy pol) {
  std::optional<double> mstd;
  for (size_t i = 1; i < secs.size(); ++i) {
    auto kv = key_value(secs[i]);
    if (!kv) continue;
    if (kv->first != "mstd") bad_aa(config, "unknown AutoAugment section '" + secs[i] + "'");
    double v = float_value(config, kv->first, kv->second);
    if (!mstd) mstd = v;
  }
  const std::string& name = secs[0];
  const std::vector<SubPolicy>* table = nullptr;
  const char* posterize_from = nullptr;  // the r variants swap this op for PosterizeIncreasing
  if (name == "v0") {
    table = &kPolicyV0;
  } else if (name == "v0r") {
    table = &kPolicyV0;
    posterize_from = "Posterize";
  } else if (name == "original") {
    table = &kPolicyOriginal;
  } else if (name == "originalr") {
    table = &kPolicyOriginal;
    posterize_from = "PosterizeOriginal";
  } else if (name == "3a") {
    table = &kPolicy3a;
  } else {
    bad_aa(config, fmt::format("unknown augmentation '{}'", name));
  }
  pol.kind = PolicyKind::AutoAugment;
  for (const auto& sp : *table) {
    std::vector<OpSpec> ops;
    for (const auto& op : sp) {
      const char* n = posterize_from && std::string_view(op.name) == posterize_from ? "PosterizeIncreasing" : op.name;
      ops.push_back(make_op(n, op.prob, op.magnitude, mstd.value_or(0), std::nullopt));
    }
    pol.sub_policies.push_back(std::move(ops));
  }
  return pol;
}

// ---- 8-bit pixel plumbing -------------------------------------------------------------------------

using Lut = std::array<uint8_t, 256>;

// PIL's Image.point with one table per band (or one for all); tables are clipped to 0..255.
cv::Mat apply_luts(const cv::Mat& img, const std::vector<Lut>& luts) {
  const int ch = img.channels();
  cv::Mat out(img.size(), img.type());
  for (int y = 0; y < img.rows; ++y) {
    const uint8_t* in = img.ptr<uint8_t>(y);
    uint8_t* o = out.ptr<uint8_t>(y);
    if (luts.size() == 1) {
      const Lut& l = luts[0];
      for (int i = 0; i < img.cols * ch; ++i) o[i] = l[in[i]];
    } else {
      for (int x = 0; x < img.cols; ++x)
        for (int c = 0; c < ch; ++c) o[x * ch + c] = luts[c][in[x * ch + c]];
    }
  }
  return out;
}

Lut lut_of(auto&& f) {
  Lut l;
  for (int i = 0; i < 256; ++i) l[i] = uint8_t(std::clamp<int64_t>(f(i), 0, 255));
  return l;
}

std::vector<std::array<int64_t, 256>> histograms(const cv::Mat& img) {
  const int ch = img.channels();
  std::vector<std::array<int64_t, 256>> h(ch);
  for (auto& a : h) a.fill(0);
  for (int y = 0; y < img.rows; ++y) {
    const uint8_t* in = img.ptr<uint8_t>(y);
    for (int x = 0; x < img.cols; ++x)
      for (int c = 0; c < ch; ++c) ++h[c][in[x * ch + c]];
  }
  return h;
}

// PIL's convert("L"): ITU-R 601-2 luma in 16.16 fixed point.
cv::Mat to_luma(const cv::Mat& img) {
  if (img.channels() == 1) return img;
  cv::Mat out(img.size(), CV_8UC1);
  for (int y = 0; y < img.rows; ++y) {
    const uint8_t* in = img.ptr<uint8_t>(y);
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < img.cols; ++x) {
      const uint8_t* p = in + 3 * x;
      o[x] = uint8_t((uint32_t(p[0]) * 19595 + uint32_t(p[1]) * 38470 + uint32_t(p[2]) * 7471 + 0x8000) >> 16);
    }
  }
  return out;
}

cv::Mat replicate(const cv::Mat& gray, int channels) {
  if (channels == 1) return gray;
  cv::Mat out;
  cv::merge(std::vector<cv::Mat>{gray, gray, gray}, out);
  return out;
}

cv::Mat filled(cv::Size size, int type, pil::Fill fill) {
  return cv::Mat(size, type, cv::Scalar(fill[0], fill[1], fill[2]));
}

// PIL's ImageFilter.SMOOTH (3x3 kernel 1 1 1 / 1 5 1 / 1 1 1, scale 13) in float32 with PIL's
// rounding bias; the outermost rows and columns are copied, as PIL leaves them.
cv::Mat smooth(const cv::Mat& img) {
  cv::Mat out = img.clone();
  if (img.rows < 3 || img.cols < 3) return out;
  const int ch = img.channels();
  const float k = 1.0f / 13.0f, k5 = 5.0f / 13.0f;
  for (int y = 1; y < img.rows - 1; ++y) {
    const uint8_t* up = img.ptr<uint8_t>(y - 1);
    const uint8_t* mid = img.ptr<uint8_t>(y);
    const uint8_t* down = img.ptr<uint8_t>(y + 1);
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 1; x < img.cols - 1; ++x)
      for (int c = 0; c < ch; ++c) {
        const int i = x * ch + c;
        float ss = 0.5f;  // PIL's +0.5 so the truncation below rounds
        ss += float(down[i - ch]) * k + float(down[i]) * k + float(down[i + ch]) * k;
        ss += float(mid[i - ch]) * k + float(mid[i]) * k5 + float(mid[i + ch]) * k;
        ss += float(up[i - ch]) * k + float(up[i]) * k + float(up[i + ch]) * k;
        ss = std::min(255.0f, std::max(0.0f, ss));
        o[i] = uint8_t(ss);
      }
  }
  return out;
}

// PIL's box radius for a Gaussian of `radius` made of `passes` box blurs (Gwosdek et al. 2011),
// in PIL's mix of float and double arithmetic.
float box_radius_for_gaussian(float radius, int passes) {
  float sigma2 = radius * radius / float(passes);
  float L = float(std::sqrt(12.0 * double(sigma2) + 1.0));
  float l = float(std::floor((double(L) - 1.0) / 2.0));
  float a = (2 * l + 1) * (l * (l + 1) - 3 * sigma2);
  a /= 6 * (sigma2 - (l + 1) * (l + 1));
  return l + a;
}

// One line of PIL's extended box blur: integer weights in 8.24 fixed point, with the fractional
// radius as a weight on the two pixels just outside the box, and edges extended.
void box_blur_line(const uint8_t* in, uint8_t* out, int n, float float_radius) {
  const int radius = int(float_radius);
  const uint32_t ww = uint32_t(float(1 << 24) / (float_radius * 2 + 1));
  const uint32_t fw = (uint32_t(1 << 24) - uint32_t(radius * 2 + 1) * ww) / 2;
  const int last = n - 1;
  const int edge_a = std::min(radius + 1, n);
  const int edge_b = std::max(n - radius - 1, 0);
  uint32_t acc = uint32_t(in[0]) * uint32_t(radius + 1);
  for (int x = 0; x < edge_a - 1; ++x) acc += in[x];
  acc += uint32_t(in[last]) * uint32_t(radius - edge_a + 1);
  auto step = [&](int x, int sub, int add, int left, int right) {
    acc += uint32_t(int(in[add]) - int(in[sub]));
    uint32_t bulk = acc * ww + (uint32_t(in[left]) + uint32_t(in[right])) * fw;
    out[x] = uint8_t((bulk + (1u << 23)) >> 24);
  };
  if (edge_a <= edge_b) {
    for (int x = 0; x < edge_a; ++x) step(x, 0, x + radius, 0, x + radius + 1);
    for (int x = edge_a; x < edge_b; ++x) step(x, x - radius - 1, x + radius, x - radius - 1, x + radius + 1);
    for (int x = edge_b; x <= last; ++x) step(x, x - radius - 1, last, x - radius - 1, last);
  } else {
    for (int x = 0; x < edge_b; ++x) step(x, 0, x + radius, 0, x + radius + 1);
    for (int x = edge_b; x < edge_a; ++x) step(x, 0, last, 0, last);
    for (int x = edge_a; x <= last; ++x) step(x, x - radius - 1, last, x - radius - 1, last);
  }
}

// ---- PIL's affine sampling ---------------------------------------------------------------------

// PIL's COORD: truncation, with everything left of 0 mapped to -1 (out of range).
int64_t coord(double v) {
  if (v < 0.0) return -1;
  if (v >= 2147483647.0) return std::numeric_limits<int64_t>::max();
  return int64_t(v);
}
int pil_floor(double v) { return v < 0.0 ? int(std::floor(v)) : int(v); }

std::vector<const uint8_t*> row_ptrs(const cv::Mat& m) {
  std::vector<const uint8_t*> rows(size_t(m.rows));
  for (int y = 0; y < m.rows; ++y) rows[size_t(y)] = m.ptr<uint8_t>(y);
  return rows;
}

inline void copy_px(const uint8_t* p, uint8_t* dst, int ch) {
  if (ch == 3) {
    dst[0] = p[0];
    dst[1] = p[1];
    dst[2] = p[2];
  } else {
    dst[0] = p[0];
  }
}

// Nearest, pure translation / scale: PIL pretabulates the columns (ImagingScaleAffine).
void nearest_scale(const cv::Mat& src, cv::Mat& out, const std::array<double, 6>& a) {
  const int ch = src.channels(), w = out.cols, h = out.rows;
  std::vector<int> xin(w, 0);
  int xmin = w, xmax = 0;
  double xo = a[2] + a[0] * 0.5;
  for (int x = 0; x < w; ++x) {
    int64_t xi = coord(xo);
    if (xi >= 0 && xi < src.cols) {
      xmax = x + 1;
      xmin = std::min(xmin, x);
      xin[x] = int(xi);
    }
    xo += a[0];
  }
  double yo = a[5] + a[4] * 0.5;
  for (int y = 0; y < h; ++y) {
    int64_t yi = coord(yo);
    if (yi >= 0 && yi < src.rows) {
      uint8_t* o = out.ptr<uint8_t>(y);
      const uint8_t* in = src.ptr<uint8_t>(int(yi));
      for (int x = xmin; x < xmax; ++x) copy_px(in + xin[x] * ch, o + x * ch, ch);
    }
    yo += a[4];
  }
}

bool fits_fixed(const std::array<double, 6>& a, double x, double y) {
  return std::fabs(x * a[0] + y * a[1] + a[2]) < 32768.0 && std::fabs(x * a[3] + y * a[4] + a[5]) < 32768.0;
}

// Nearest, general affine: PIL steps through the output in 16.16 fixed point (affine_fixed).
void nearest_fixed(const cv::Mat& src, cv::Mat& out, const std::array<double, 6>& a) {
  const int ch = src.channels();
  const auto rows = row_ptrs(src);
  auto fix = [](double v) { return int32_t(pil_floor(v * 65536.0 + 0.5)); };
  const int32_t a0 = fix(a[0]), a1 = fix(a[1]), a3 = fix(a[3]), a4 = fix(a[4]);
  int32_t a2 = fix(a[2] + a[0] * 0.5 + a[1] * 0.5);
  int32_t a5 = fix(a[5] + a[3] * 0.5 + a[4] * 0.5);
  for (int y = 0; y < out.rows; ++y) {
    int32_t xx = a2, yy = a5;
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < out.cols; ++x) {
      int32_t xi = xx >> 16, yi = yy >> 16;
      if (xi >= 0 && xi < src.cols && yi >= 0 && yi < src.rows) copy_px(rows[size_t(yi)] + xi * ch, o + x * ch, ch);
      xx += a0;
      yy += a3;
    }
    a2 += a1;
    a5 += a4;
  }
}

// Nearest, when fixed point would overflow: PIL accumulates doubles instead.
void nearest_float(const cv::Mat& src, cv::Mat& out, const std::array<double, 6>& a) {
  const int ch = src.channels();
  double xo = a[2] + a[1] * 0.5 + a[0] * 0.5;
  double yo = a[5] + a[4] * 0.5 + a[3] * 0.5;
  for (int y = 0; y < out.rows; ++y) {
    double xx = xo, yy = yo;
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < out.cols; ++x) {
      int64_t xi = coord(xx), yi = coord(yy);
      if (xi >= 0 && xi < src.cols && yi >= 0 && yi < src.rows)
        copy_px(src.ptr<uint8_t>(int(yi)) + xi * ch, o + x * ch, ch);
      xx += a[0];
      yy += a[3];
    }
    xo += a[1];
    yo += a[4];
  }
}

// Bilinear and bicubic: PIL's generic transform. A sample point outside the image gives the fill;
// inside, neighbours past the edge are clamped to it (not mixed with the fill). PIL reuses the
// previous row's value for rows past the bottom, which equals clamping for every reachable
// sample point; we keep PIL's form anyway.
template <int kCh, bool kCubic>
void filtered_impl(const cv::Mat& src, cv::Mat& out, const std::array<double, 6>& a) {
  const int w = src.cols, h = src.rows;
  const auto rows = row_ptrs(src);
  auto xclip = [w](int x) { return x < 0 ? 0 : x < w ? x : w - 1; };
  auto yclip = [h](int y) { return y < 0 ? 0 : y < h ? y : h - 1; };
  auto cubic_1d = [](double v1, double v2, double v3, double v4, double d) {
    double p1 = v2;
    double p2 = -v1 + v3;
    double p3 = 2 * (v1 - v2) + v3 - v4;
    double p4 = -v1 + v2 - v3 + v4;
    return p1 + d * (p2 + d * (p3 + d * p4));
  };
  for (int y = 0; y < out.rows; ++y) {
    uint8_t* o = out.ptr<uint8_t>(y);
    for (int x = 0; x < out.cols; ++x) {
      double xin = a[0] * (x + 0.5) + a[1] * (y + 0.5) + a[2];
      double yin = a[3] * (x + 0.5) + a[4] * (y + 0.5) + a[5];
      if (xin < 0.0 || xin >= w || yin < 0.0 || yin >= h) continue;  // keeps the fill
      xin -= 0.5;
      yin -= 0.5;
      const int xi = pil_floor(xin), yi = pil_floor(yin);
      const double dx = xin - xi, dy = yin - yi;
      uint8_t* px = o + x * kCh;
      if constexpr (!kCubic) {
        const int x0 = xclip(xi) * kCh, x1 = xclip(xi + 1) * kCh;
        const uint8_t* r0 = rows[size_t(yclip(yi))];
        const uint8_t* r1 = (yi + 1 >= 0 && yi + 1 < h) ? rows[size_t(yi + 1)] : nullptr;
        for (int c = 0; c < kCh; ++c) {
          double v1 = double(r0[x0 + c]) + (double(r0[x1 + c]) - double(r0[x0 + c])) * dx;
          double v2 = r1 ? double(r1[x0 + c]) + (double(r1[x1 + c]) - double(r1[x0 + c])) * dx : v1;
          px[c] = uint8_t(v1 + (v2 - v1) * dy);
        }
      } else {
        const int bx = xi - 1, by = yi - 1;
        const int xs[4] = {xclip(bx) * kCh, xclip(bx + 1) * kCh, xclip(bx + 2) * kCh, xclip(bx + 3) * kCh};
        const uint8_t* rs[4] = {rows[size_t(yclip(by))], nullptr, nullptr, nullptr};
        for (int k = 1; k < 4; ++k) rs[k] = (by + k >= 0 && by + k < h) ? rows[size_t(by + k)] : nullptr;
        for (int c = 0; c < kCh; ++c) {
          auto along_x = [&](const uint8_t* r) {
            return cubic_1d(r[xs[0] + c], r[xs[1] + c], r[xs[2] + c], r[xs[3] + c], dx);
          };
          double v[4];
          v[0] = along_x(rs[0]);
          for (int k = 1; k < 4; ++k) v[k] = rs[k] ? along_x(rs[k]) : v[k - 1];
          double val = cubic_1d(v[0], v[1], v[2], v[3], dy);
          px[c] = val <= 0.0 ? 0 : val >= 255.0 ? 255 : uint8_t(val);
        }
      }
    }
  }
}

void filtered(const cv::Mat& src, cv::Mat& out, const std::array<double, 6>& a, bool cubic) {
  if (src.channels() == 3)
    cubic ? filtered_impl<3, true>(src, out, a) : filtered_impl<3, false>(src, out, a);
  else
    cubic ? filtered_impl<1, true>(src, out, a) : filtered_impl<1, false>(src, out, a);
}

}  // namespace

// ---- public: hparams, parsing, level args ----------------------------------------------------------

AugHParams timm_aa_hparams(std::string_view aa, int img_size_min, const std::vector<double>& mean,
                           std::string_view interpolation) {
  AugHParams hp;
  hp.translate_const = int(img_size_min * 0.45);
  for (int c = 0; c < 3; ++c) {
    double m = mean.empty() ? 0.5 : mean[std::min<size_t>(c, mean.size() - 1)];
    hp.img_mean[c] = uint8_t(std::clamp(std::nearbyint(255.0 * m), 0.0, 255.0));  // round half even
  }
  if (aa.starts_with("augmix")) hp.translate_pct = 0.3;
  if (interpolation == "bilinear")
    hp.interpolation = Interp::Bilinear;
  else if (interpolation == "bicubic")
    hp.interpolation = Interp::Bicubic;
  else if (interpolation == "nearest")
    hp.interpolation = Interp::Nearest;
  else if (interpolation != "random" && !interpolation.empty())
    throw UserError(
        fmt::format("interpolation '{}' with --aa '{}': the augmentations' transforms take only "
                    "random, nearest, bilinear or bicubic",
                    interpolation, aa));
  return hp;
}

AugmentPolicy parse_augment(const std::string& config, const AugHParams& hparams) {
  if (config.empty()) throw UserError(fmt::format("--aa '': empty; {}", kAccepted));
  AugmentPolicy pol;
  pol.config = config;
  pol.hparams = hparams;
  auto secs = split_dash(config);
  // create_transform dispatches on the prefix, then each parser checks the first section.
  if (config.starts_with("rand")) return parse_rand(config, secs, std::move(pol));
  if (config.starts_with("augmix")) return parse_augmix(config, secs, std::move(pol));
  return parse_auto(config, secs, std::move(pol));
}

const std::vector<std::string>& augment_op_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& e : kOps) v.emplace_back(e.name);
    return v;
  }();
  return names;
}

std::vector<double> level_to_args(std::string_view op, double magnitude, const AugHParams& hp, bool negate) {
  const auto& e = op_or_throw(op);
  if (!e.level) return {};
  return e.level(magnitude, hp, negate);
}

bool op_has_random_sign(std::string_view op) { return op_or_throw(op).random_sign; }

bool draw_negate(std::mt19937_64& rng) { return uniform01(rng) > 0.5; }

double sample_magnitude(const OpSpec& op, std::mt19937_64& rng) {
  double m = op.magnitude;
  if (op.magnitude_std > 0) {
    if (std::isinf(op.magnitude_std))
      m = m * uniform01(rng);  // random.uniform(0, magnitude)
    else
      m = sample_gauss(m, op.magnitude_std, rng);
  }
  // timm's `magnitude_max or _LEVEL_DENOM`: a 0 (or absent) mmax means 10.
  const double upper = op.magnitude_max.value_or(0) ? double(*op.magnitude_max) : kLevelDenom;
  return std::max(0.0, std::min(m, upper));
}

// ---- public: applying ------------------------------------------------------------------------------

cv::Mat apply_op(const cv::Mat& img, std::string_view name, std::span<const double> args, const AugHParams& hp,
                 std::mt19937_64& rng) {
  check_u8(img, "apply_op");
  const auto& e = op_or_throw(name);
  size_t want = e.level ? 1 : 0;
  if (args.size() != want)
    throw std::invalid_argument(fmt::format("augment: op '{}' takes {} argument(s), got {}", name, want, args.size()));
  OpContext ctx{hp, rng};
  return e.run(img, args, ctx);
}

cv::Mat apply_op(const cv::Mat& img, const OpSpec& op, const AugHParams& hp, std::mt19937_64& rng) {
  const auto& e = op_or_throw(op.name);
  if (op.prob < 1.0 && uniform01(rng) > op.prob) return img;
  double m = sample_magnitude(op, rng);
  bool neg = e.random_sign && draw_negate(rng);
  auto args = level_to_args(op.name, m, hp, neg);
  return apply_op(img, op.name, args, hp, rng);
}

cv::Mat augmix_mix(const cv::Mat& img, const std::vector<cv::Mat>& chains, std::span<const float> weights, float m) {
  check_u8(img, "augmix_mix");
  if (chains.size() != weights.size()) throw std::invalid_argument("augmix_mix: one weight per chain");
  const int n = img.rows * img.cols * img.channels();
  std::vector<float> mixed(size_t(n), 0.0f);
  for (size_t k = 0; k < chains.size(); ++k) {
    cv::Mat ch = chains[k].isContinuous() ? chains[k] : chains[k].clone();
    const uint8_t* p = ch.ptr<uint8_t>(0);
    for (int i = 0; i < n; ++i) mixed[i] += weights[k] * float(p[i]);
  }
  cv::Mat mixed8(img.size(), img.type());
  uint8_t* o = mixed8.ptr<uint8_t>(0);
  for (int i = 0; i < n; ++i) o[i] = uint8_t(std::min(255.0f, std::max(0.0f, mixed[i])));  // clip, truncate
  return pil::blend(img, mixed8, m);
}

std::vector<size_t> draw_rand_augment_ops(const AugmentPolicy& pol, std::mt19937_64& rng) {
  std::vector<size_t> chosen;
  if (pol.choice_weights.empty()) {
    for (int i = 0; i < pol.num_layers; ++i) chosen.push_back(size_t(randint(rng, 0, int64_t(pol.ops.size()) - 1)));
    return chosen;
  }
  // Weighted without replacement: each pick renormalises over the ops not yet picked, which is
  // the distribution numpy's choice(replace=False, p=w) has.
  std::vector<double> w = pol.choice_weights;
  for (int i = 0; i < pol.num_layers; ++i) {
    double total = 0;
    for (double v : w) total += v;
    double u = uniform01(rng) * total, cum = 0;
    size_t pick = w.size();
    for (size_t j = 0; j < w.size(); ++j) {
      if (w[j] <= 0) continue;
      cum += w[j];
      pick = j;
      if (cum > u) break;
    }
    if (pick == w.size()) throw std::invalid_argument("draw_rand_augment_ops: more layers than weighted ops");
    chosen.push_back(pick);
    w[pick] = 0;
  }
  return chosen;
}

cv::Mat apply_augment(const cv::Mat& img, const AugmentPolicy& pol, std::mt19937_64& rng) {
  check_u8(img, "apply_augment");
  const auto& hp = pol.hparams;
  switch (pol.kind) {
    case PolicyKind::AutoAugment: {
      const auto& sub = pol.sub_policies[size_t(randint(rng, 0, int64_t(pol.sub_policies.size()) - 1))];
      cv::Mat out = img;
      for (const auto& op : sub) out = apply_op(out, op, hp, rng);
      return out;
    }
    case PolicyKind::RandAugment: {
      std::vector<size_t> chosen = draw_rand_augment_ops(pol, rng);
      cv::Mat out = img;
      for (size_t i : chosen) out = apply_op(out, pol.ops[i], hp, rng);
      return out;
    }
    case PolicyKind::AugMix: {
      std::vector<float> ws = sample_dirichlet(pol.alpha, pol.width, rng);
      const float m = float(sample_beta(pol.alpha, pol.alpha, rng));
      auto chain = [&](const cv::Mat& from) {
        int depth = pol.depth > 0 ? pol.depth : int(randint(rng, 1, 3));
        std::vector<size_t> ops;
        for (int d = 0; d < depth; ++d) ops.push_back(size_t(randint(rng, 0, int64_t(pol.ops.size()) - 1)));
        cv::Mat aug = from;
        for (size_t i : ops) aug = apply_op(aug, pol.ops[i], hp, rng);
        return aug;
      };
      if (!pol.blended) {
        std::vector<cv::Mat> chains;
        for (int k = 0; k < pol.width; ++k) chains.push_back(chain(img));
        return augmix_mix(img, chains, ws, m);
      }
      // Blended mode: the mixing weights are turned into a sequence of pairwise blends, in float32
      // like timm's numpy arithmetic.
      std::vector<float> rws(ws.size());
      float cump = 1.0f;
      for (size_t k = ws.size(); k-- > 0;) {
        float alpha = (ws[k] * m) / cump;
        cump *= (1.0f - alpha);
        rws[k] = alpha;
      }
      cv::Mat out = img;
      for (float w : rws) out = pil::blend(out, chain(img), w);
      return out;
    }
  }
  return img;
}

// ---- PIL operations ------------------------------------------------------------------------------

namespace pil {

cv::Mat invert(const cv::Mat& img) {
  check_u8(img, "invert");
  return apply_luts(img, {lut_of([](int i) { return 255 - i; })});
}

cv::Mat posterize(const cv::Mat& img, int bits) {
  check_u8(img, "posterize");
  if (bits >= 8) return img;
  // Pillow < 13 computed the mask for any bits; 13 rejects bits < 1, which timm reaches at
  // PosterizeIncreasing magnitude 10. We keep the older, intended result: nothing kept, black.
  const int mask = bits <= 0 ? 0 : ~((1 << (8 - bits)) - 1);
  return apply_luts(img, {lut_of([mask](int i) { return i & mask; })});
}

cv::Mat solarize(const cv::Mat& img, int threshold) {
  check_u8(img, "solarize");
  return apply_luts(img, {lut_of([threshold](int i) { return i < threshold ? i : 255 - i; })});
}

cv::Mat solarize_add(const cv::Mat& img, int add, int threshold) {
  check_u8(img, "solarize_add");
  return apply_luts(img, {lut_of([&](int i) { return i < threshold ? std::min(255, i + add) : i; })});
}

cv::Mat autocontrast(const cv::Mat& img) {
  check_u8(img, "autocontrast");
  std::vector<Lut> luts;
  for (const auto& h : histograms(img)) {
    int lo = 0, hi = 255;
    while (lo < 255 && !h[lo]) ++lo;
    while (hi > 0 && !h[hi]) --hi;
    if (hi <= lo) {
      luts.push_back(lut_of([](int i) { return i; }));
    } else {
      const double scale = 255.0 / (hi - lo), offset = -lo * scale;
      luts.push_back(lut_of([&](int i) { return int64_t(i * scale + offset); }));  // int() truncates
    }
  }
  return apply_luts(img, luts);
}

cv::Mat equalize(const cv::Mat& img) {
  check_u8(img, "equalize");
  std::vector<Lut> luts;
  for (const auto& h : histograms(img)) {
    int64_t total = 0, last = 0, used = 0;
    for (int64_t v : h)
      if (v) {
        total += v;
        last = v;
        ++used;
      }
    const int64_t step = used <= 1 ? 0 : (total - last) / 255;
    if (!step) {
      luts.push_back(lut_of([](int i) { return i; }));
      continue;
    }
    Lut l;
    int64_t n = step / 2;
    for (int i = 0; i < 256; ++i) {
      l[i] = uint8_t(std::min<int64_t>(255, n / step));  // Image.point clips the table
      n += h[i];
    }
    luts.push_back(l);
  }
  return apply_luts(img, luts);
}

cv::Mat blend(const cv::Mat& im1, const cv::Mat& im2, float alpha) {
  check_u8(im1, "blend");
  if (im1.size() != im2.size() || im1.type() != im2.type())
    throw std::invalid_argument("blend: images differ in shape");
  if (alpha == 0.0f) return im1.clone();
  if (alpha == 1.0f) return im2.clone();
  const bool inside = alpha >= 0 && alpha <= 1.0f;
  cv::Mat out(im1.size(), im1.type());
  const int n = im1.cols * im1.channels();
  for (int y = 0; y < im1.rows; ++y) {
    const uint8_t* a = im1.ptr<uint8_t>(y);
    const uint8_t* b = im2.ptr<uint8_t>(y);
    uint8_t* o = out.ptr<uint8_t>(y);
    // Interpolation stays within the two inputs; extrapolation is clipped, as PIL does.
    if (inside) {
      for (int x = 0; x < n; ++x) o[x] = uint8_t(float(int(a[x])) + alpha * float(int(b[x]) - int(a[x])));
    } else {
      for (int x = 0; x < n; ++x) {
        float v = float(int(a[x])) + alpha * float(int(b[x]) - int(a[x]));
        o[x] = uint8_t(std::min(255.0f, std::max(0.0f, v)));
      }
    }
  }
  return out;
}

cv::Mat color(const cv::Mat& img, double factor) {
  check_u8(img, "color");
  if (img.channels() == 1) return img.clone();  // PIL blends the image with itself
  return blend(replicate(to_luma(img), 3), img, float(factor));
}

cv::Mat contrast(const cv::Mat& img, double factor) {
  check_u8(img, "contrast");
  const auto h = histograms(to_luma(img))[0];
  int64_t sum = 0, count = 0;
  for (int i = 0; i < 256; ++i) {
    sum += i * h[i];
    count += h[i];
  }
  const double mean = count ? double(sum) / double(count) : 0.0;
  const auto m = uint8_t(int(mean + 0.5));
  return blend(filled(img.size(), img.type(), {m, m, m}), img, float(factor));
}

cv::Mat brightness(const cv::Mat& img, double factor) {
  check_u8(img, "brightness");
  return blend(cv::Mat::zeros(img.size(), img.type()), img, float(factor));
}

cv::Mat sharpness(const cv::Mat& img, double factor) {
  check_u8(img, "sharpness");
  return blend(smooth(img), img, float(factor));
}

cv::Mat gaussian_blur(const cv::Mat& img, double radius) {
  check_u8(img, "gaussian_blur");
  if (radius == 0) return img.clone();
  if (radius < 0) throw std::invalid_argument("gaussian_blur: radius must be >= 0");
  const float box = box_radius_for_gaussian(float(radius), 3);
  cv::Mat out = img.clone();
  if (box == 0) return out;
  const int ch = img.channels();
  std::vector<uint8_t> in_line, out_line;
  // Three horizontal passes over every row, then three vertical ones over every column.
  for (int y = 0; y < out.rows; ++y) {
    uint8_t* row = out.ptr<uint8_t>(y);
    for (int c = 0; c < ch; ++c) {
      in_line.resize(out.cols);
      out_line.resize(out.cols);
      for (int x = 0; x < out.cols; ++x) in_line[x] = row[x * ch + c];
      for (int pass = 0; pass < 3; ++pass) {
        box_blur_line(in_line.data(), out_line.data(), out.cols, box);
        std::swap(in_line, out_line);
      }
      for (int x = 0; x < out.cols; ++x) row[x * ch + c] = in_line[x];
    }
  }
  for (int x = 0; x < out.cols; ++x)
    for (int c = 0; c < ch; ++c) {
      in_line.resize(out.rows);
      out_line.resize(out.rows);
      for (int y = 0; y < out.rows; ++y) in_line[y] = out.ptr<uint8_t>(y)[x * ch + c];
      for (int pass = 0; pass < 3; ++pass) {
        box_blur_line(in_line.data(), out_line.data(), out.rows, box);
        std::swap(in_line, out_line);
      }
      for (int y = 0; y < out.rows; ++y) out.ptr<uint8_t>(y)[x * ch + c] = in_line[y];
    }
  return out;
}

cv::Mat affine(const cv::Mat& img, const std::array<double, 6>& a, Interp interp, Fill fill) {
  check_u8(img, "affine");
  cv::Mat out = filled(img.size(), img.type(), fill);
  if (interp == Interp::Nearest) {
    // PIL's three nearest-neighbour engines round differently; each is reproduced.
    const double w = img.cols, h = img.rows;
    if (a[1] == 0 && a[3] == 0)
      nearest_scale(img, out, a);
    else if (fits_fixed(a, 0, 0) && fits_fixed(a, w, h) && fits_fixed(a, 0, h) && fits_fixed(a, w, 0))
      nearest_fixed(img, out, a);
    else
      nearest_float(img, out, a);
  } else {
    filtered(img, out, a, interp == Interp::Bicubic);
  }
  return out;
}

cv::Mat rotate(const cv::Mat& img, double degrees, Interp interp, Fill fill) {
  check_u8(img, "rotate");
  const double angle = py_mod(degrees, 360.0);
  // Image.rotate's exact fast paths.
  if (angle == 0) return img.clone();
  cv::Mat out;
  if (angle == 180) {
    cv::rotate(img, out, cv::ROTATE_180);
    return out;
  }
  if ((angle == 90 || angle == 270) && img.cols == img.rows) {
    cv::rotate(img, out, angle == 90 ? cv::ROTATE_90_COUNTERCLOCKWISE : cv::ROTATE_90_CLOCKWISE);
    return out;
  }
  const double cx = img.cols / 2.0, cy = img.rows / 2.0;
  const double rad = -(angle * (std::numbers::pi / 180.0));
  std::array<double, 6> m = {py_round15(std::cos(rad)),  py_round15(std::sin(rad)), 0.0,
                             py_round15(-std::sin(rad)), py_round15(std::cos(rad)), 0.0};
  const double c = m[0] * -cx + m[1] * -cy + m[2];
  const double f = m[3] * -cx + m[4] * -cy + m[5];
  m[2] = c + cx;
  m[5] = f + cy;
  return affine(img, m, interp, fill);
}

cv::Mat shear_x(const cv::Mat& img, double factor, Interp interp, Fill fill) {
  return affine(img, {1, factor, 0, 0, 1, 0}, interp, fill);
}
cv::Mat shear_y(const cv::Mat& img, double factor, Interp interp, Fill fill) {
  return affine(img, {1, 0, 0, factor, 1, 0}, interp, fill);
}
cv::Mat translate_x(const cv::Mat& img, double pixels, Interp interp, Fill fill) {
  return affine(img, {1, 0, pixels, 0, 1, 0}, interp, fill);
}
cv::Mat translate_y(const cv::Mat& img, double pixels, Interp interp, Fill fill) {
  return affine(img, {1, 0, 0, 0, 1, pixels}, interp, fill);
}

}  // namespace pil

// ---- ColorJitter -------------------------------------------------------------------------------------

ColorJitterParams draw_color_jitter(const ColorJitterConfig& cfg, std::mt19937_64& rng) {
  ColorJitterParams p;
  for (int i = 2; i > 0; --i) std::swap(p.order[i], p.order[size_t(randint(rng, 0, i))]);  // randperm
  auto factor = [&](double v, const char* what) -> std::optional<double> {
    if (v < 0) throw UserError(fmt::format("--color-jitter {}: {} jitter must be >= 0", v, what));
    if (v == 0) return std::nullopt;  // torchvision turns a (1, 1) range off
    const double lo = std::max(0.0, 1.0 - v), hi = 1.0 + v;
    return lo + (hi - lo) * uniform01(rng);
  };
  p.brightness = factor(cfg.brightness, "brightness");
  p.contrast = factor(cfg.contrast, "contrast");
  p.saturation = factor(cfg.saturation, "saturation");
  return p;
}

cv::Mat apply_color_jitter(const cv::Mat& img, const ColorJitterParams& p) {
  check_u8(img, "color_jitter");
  cv::Mat out = img;
  for (int which : p.order) {
    if (which == 0 && p.brightness) out = pil::brightness(out, *p.brightness);
    if (which == 1 && p.contrast) out = pil::contrast(out, *p.contrast);
    if (which == 2 && p.saturation) out = pil::color(out, *p.saturation);
  }
  return out;
}

cv::Mat color_jitter(const cv::Mat& img, const ColorJitterConfig& cfg, std::mt19937_64& rng) {
  return apply_color_jitter(img, draw_color_jitter(cfg, rng));
}

// ---- RandomErasing -------------------------------------------------------------------------------------

EraseMode parse_erase_mode(std::string_view mode) {
  std::string m(mode);
  std::transform(m.begin(), m.end(), m.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  if (m == "const" || m.empty()) return EraseMode::Const;
  if (m == "rand") return EraseMode::Rand;
  if (m == "pixel") return EraseMode::Pixel;
  throw UserError(fmt::format("--remode '{}': accepted: const, rand, pixel", mode));
}

std::vector<ErasePatch> plan_random_erasing(int img_h, int img_w, int ch, const RandomErasingConfig& cfg,
                                            std::mt19937_64& rng) {
  std::vector<ErasePatch> patches;
  if (uniform01(rng) > cfg.probability) return patches;
  const double area = double(img_h) * img_w;
  const double log_lo = std::log(cfg.min_aspect), log_hi = std::log(cfg.max_aspect.value_or(1.0 / cfg.min_aspect));
  const int max_count = std::max(cfg.min_count, cfg.max_count);
  const int count = cfg.min_count == max_count ? cfg.min_count : int(randint(rng, cfg.min_count, max_count));
  for (int k = 0; k < count; ++k) {
    for (int attempt = 0; attempt < 10; ++attempt) {
      double target = (cfg.min_area + (cfg.max_area - cfg.min_area) * uniform01(rng)) * area / count;
      double aspect = std::exp(log_lo + (log_hi - log_lo) * uniform01(rng));
      // int(round(x)) in Python rounds half to even, as nearbyint does.
      int h = int(std::nearbyint(std::sqrt(target * aspect)));
      int w = int(std::nearbyint(std::sqrt(target / aspect)));
      if (w < img_w && h < img_h) {
        int top = int(randint(rng, 0, img_h - h));
        int left = int(randint(rng, 0, img_w - w));
        ErasePatch p{cv::Rect(left, top, w, h), {}};
        if (cfg.mode == EraseMode::Pixel) {  // one normal value per pixel and channel, in HWC order
          p.values.resize(size_t(h) * size_t(w) * size_t(ch));
          for (auto& v : p.values) v = float(sample_gauss(0, 1, rng));
        } else {
          p.values.assign(size_t(ch), 0.0f);
          if (cfg.mode == EraseMode::Rand)
            for (auto& v : p.values) v = float(sample_gauss(0, 1, rng));
        }
        patches.push_back(std::move(p));
        break;
      }
    }
  }
  return patches;
}

std::vector<cv::Rect> random_erasing(cv::Mat& img, const RandomErasingConfig& cfg, std::mt19937_64& rng) {
  if (img.depth() != CV_32F || (img.channels() != 1 && img.channels() != 3))
    throw std::invalid_argument(fmt::format("random_erasing: expected CV_32FC1 or CV_32FC3, got type {}", img.type()));
  const int ch = img.channels();
  std::vector<cv::Rect> rects;
  for (auto& p : plan_random_erasing(img.rows, img.cols, ch, cfg, rng)) {
    const bool per_pixel = p.values.size() != size_t(ch);
    for (int y = 0; y < p.rect.height; ++y) {
      float* row = img.ptr<float>(p.rect.y + y) + size_t(p.rect.x) * ch;
      for (int x = 0; x < p.rect.width; ++x)
        for (int c = 0; c < ch; ++c)
          row[x * ch + c] = per_pixel ? p.values[(size_t(y) * p.rect.width + x) * ch + c] : p.values[c];
    }
    rects.push_back(p.rect);
  }
  return rects;
}

}  // namespace imgtrain::data
