// Compares imgtrain's augmentations (lib/data/augment.h) with timm / PIL / torchvision, on
// references written by tests/parity/make_aug_refs.py OUT_DIR, and checks the random parts
// (which cannot match Python's generator draw for draw) by their distributions.
#include "data/augment.h"

#include "core/error.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>

#ifndef IMGTRAIN_AUG_REFS_DIR
#define IMGTRAIN_AUG_REFS_DIR IMGTRAIN_PARITY_DIR "/augment"
#endif

using namespace imgtrain;
using namespace imgtrain::data;
using nlohmann::json;

namespace {

const std::string kRefs = IMGTRAIN_AUG_REFS_DIR;
const pil::Fill kFill = {124, 116, 104};  // ImageNet mean in 0..255, timm's img_mean

json load_json(const std::string& name) {
  const std::string path = kRefs + "/" + name;
  INFO("missing " << path << ": run .venv/bin/python tests/parity/make_aug_refs.py " << kRefs);
  REQUIRE(std::filesystem::exists(path));
  std::ifstream f(path);
  return json::parse(f);
}

const json& policies_ref() {
  static const json j = load_json("aug_policies.json");
  return j;
}
const json& images_ref() {
  static const json j = load_json("aug_images.json");
  return j;
}

cv::Mat load_bin(const json& desc) {
  const int h = desc["height"], w = desc["width"], c = desc["channels"];
  cv::Mat m(h, w, CV_8UC(c));
  std::ifstream f(kRefs + "/" + desc["file"].get<std::string>(), std::ios::binary);
  f.read(reinterpret_cast<char*>(m.data), std::streamsize(m.total() * m.elemSize()));
  REQUIRE(f.gcount() == std::streamsize(m.total() * m.elemSize()));
  return m;
}

cv::Mat input(const std::string& name) { return load_bin(images_ref()["inputs"][name]); }

cv::Mat case_ref(const std::string& name) {
  for (const auto& c : images_ref()["cases"])
    if (c["name"] == name) return load_bin(c);
  FAIL("no reference case " << name);
  return {};
}

// JSON has no infinity: the script writes "inf".
double num(const json& v) {
  if (v.is_string()) return v.get<std::string>() == "inf" ? INFINITY : -INFINITY;
  return v.get<double>();
}

struct Diff {
  int max = 0;             // largest per-byte difference
  double mean = 0;         // mean per-byte difference
  double frac_pixels = 0;  // fraction of pixels with any differing channel
};
Diff diff(const cv::Mat& a, const cv::Mat& b) {
  REQUIRE(a.size() == b.size());
  REQUIRE(a.type() == b.type());
  Diff d;
  const int ch = a.channels();
  int64_t sum = 0, bad = 0;
  for (int y = 0; y < a.rows; ++y)
    for (int x = 0; x < a.cols; ++x) {
      bool any = false;
      for (int c = 0; c < ch; ++c) {
        int v = std::abs(int(a.ptr<uint8_t>(y)[x * ch + c]) - int(b.ptr<uint8_t>(y)[x * ch + c]));
        d.max = std::max(d.max, v);
        sum += v;
        any |= v != 0;
      }
      bad += any;
    }
  d.mean = double(sum) / double(a.total() * ch);
  d.frac_pixels = double(bad) / double(a.total());
  return d;
}
bool same(const cv::Mat& a, const cv::Mat& b) { return a.size() == b.size() && diff(a, b).max == 0; }

Interp interp_of(const std::string& s) {
  if (s == "nearest") return Interp::Nearest;
  if (s == "bilinear") return Interp::Bilinear;
  return Interp::Bicubic;
}

// Our PIL op for one reference case.
cv::Mat run_case(const json& c, const cv::Mat& img) {
  const std::string op = c["op"];
  std::vector<double> a = c["args"].get<std::vector<double>>();
  if (op == "autocontrast") return pil::autocontrast(img);
  if (op == "equalize") return pil::equalize(img);
  if (op == "invert") return pil::invert(img);
  if (op == "posterize") return pil::posterize(img, int(a[0]));
  if (op == "solarize") return pil::solarize(img, int(a[0]));
  if (op == "solarize_add") return pil::solarize_add(img, int(a[0]), int(a[1]));
  if (op == "color") return pil::color(img, a[0]);
  if (op == "contrast") return pil::contrast(img, a[0]);
  if (op == "brightness") return pil::brightness(img, a[0]);
  if (op == "sharpness") return pil::sharpness(img, a[0]);
  if (op == "gaussian_blur") return pil::gaussian_blur(img, a[0]);
  if (op == "desaturate") {  // through the op table: Desaturate's level arg is timm's factor
    std::mt19937_64 rng(0);
    return apply_op(img, "Desaturate", a, AugHParams{}, rng);
  }
  // Geometric ops go through the op table (timm's names, the fill and filter from hparams), so
  // the wiring is checked along with the sampling.
  const std::map<std::string, std::string> timm_name = {{"rotate", "Rotate"},
                                                        {"shear_x", "ShearX"},
                                                        {"shear_y", "ShearY"},
                                                        {"translate_x", "TranslateX"},
                                                        {"translate_y", "TranslateY"},
                                                        {"translate_x_rel", "TranslateXRel"},
                                                        {"translate_y_rel", "TranslateYRel"}};
  auto it = timm_name.find(op);
  if (it == timm_name.end()) FAIL("unknown reference op " << op);
  auto fill = c["fill"].get<std::vector<int>>();
  AugHParams hp;
  hp.img_mean = {uint8_t(fill[0]), uint8_t(fill[1]), uint8_t(fill[2])};
  hp.interpolation = interp_of(c["interp"]);
  std::mt19937_64 rng(0);
  return apply_op(img, it->second, a, hp, rng);
}

void check_op(const OpSpec& ours, const json& ref) {
  CHECK(ours.name == ref["name"].get<std::string>());
  CHECK(ours.prob == Approx(ref["prob"].get<double>()).margin(1e-9));
  CHECK(ours.magnitude == Approx(num(ref["magnitude"])).margin(1e-9));
  const double std_ref = num(ref["magnitude_std"]);
  if (std::isinf(std_ref))
    CHECK(std::isinf(ours.magnitude_std));
  else
    CHECK(ours.magnitude_std == Approx(std_ref).margin(1e-9));
  if (ref["magnitude_max"].is_null())
    CHECK(!ours.magnitude_max.has_value());
  else
    CHECK(ours.magnitude_max == std::optional<int>(ref["magnitude_max"].get<int>()));
}

AugHParams factory_hparams(const std::string& config, const std::string& interpolation = "random") {
  const auto& r = policies_ref();
  return timm_aa_hparams(config, r["img_size"].get<int>(), r["mean"].get<std::vector<double>>(), interpolation);
}

std::vector<std::vector<double>> all_args(const std::string& op, const json& mags, const AugHParams& hp, bool neg) {
  std::vector<std::vector<double>> out;
  for (const auto& m : mags) out.push_back(level_to_args(op, m.get<double>(), hp, neg));
  return out;
}

}  // namespace

TEST_CASE("augment: --aa strings decode as timm decodes them", "[parity][augment]") {
  const auto& refs = policies_ref();
  REQUIRE(refs["policies"].size() >= 11);
  for (const auto& [config, ref] : refs["policies"].items()) {
    INFO("--aa " << config);
    if (ref.contains("error")) {
      INFO("timm: " << ref["error"].get<std::string>());
      // One line naming the string.
      try {
        parse_augment(config, factory_hparams(config));
        FAIL("accepted a string timm rejects");
      } catch (const UserError& e) {
        CHECK(std::string(e.what()).find("'" + config + "'") != std::string::npos);
        CHECK(std::string(e.what()).find('\n') == std::string::npos);
      }
      continue;
    }
    const AugHParams hp = factory_hparams(config);
    const auto& rh = ref["hparams"];
    CHECK(hp.translate_const == rh["translate_const"].get<int>());
    CHECK(hp.translate_pct == Approx(rh["translate_pct"].get<double>()).margin(1e-12));
    CHECK(std::vector<int>(hp.img_mean.begin(), hp.img_mean.end()) == rh["img_mean"].get<std::vector<int>>());
    CHECK(!hp.interpolation.has_value());
    CHECK(rh["interpolation"].is_null());

    const AugmentPolicy pol = parse_augment(config, hp);
    const std::string kind = ref["kind"];
    if (kind == "rand") {
      REQUIRE(pol.kind == PolicyKind::RandAugment);
      CHECK(pol.num_layers == ref["num_layers"].get<int>());
      if (ref["choice_weights"].is_null()) {
        CHECK(pol.choice_weights.empty());
      } else {
        auto w = ref["choice_weights"].get<std::vector<double>>();
        REQUIRE(pol.choice_weights.size() == w.size());
        for (size_t i = 0; i < w.size(); ++i) CHECK(pol.choice_weights[i] == Approx(w[i]).margin(1e-9));
      }
    } else if (kind == "auto") {
      REQUIRE(pol.kind == PolicyKind::AutoAugment);
      REQUIRE(pol.sub_policies.size() == ref["sub_policies"].size());
      for (size_t i = 0; i < pol.sub_policies.size(); ++i) {
        REQUIRE(pol.sub_policies[i].size() == ref["sub_policies"][i].size());
        for (size_t k = 0; k < pol.sub_policies[i].size(); ++k)
          check_op(pol.sub_policies[i][k], ref["sub_policies"][i][k]);
      }
      CHECK(pol.ops.empty());
    } else {
      REQUIRE(kind == "augmix");
      REQUIRE(pol.kind == PolicyKind::AugMix);
      CHECK(pol.width == ref["width"].get<int>());
      CHECK(pol.depth == ref["depth"].get<int>());
      CHECK(pol.alpha == Approx(ref["alpha"].get<double>()).margin(1e-12));
      CHECK(pol.blended == ref["blended"].get<bool>());
    }
    if (kind != "auto") {
      REQUIRE(pol.ops.size() == ref["ops"].size());
      for (size_t i = 0; i < pol.ops.size(); ++i) check_op(pol.ops[i], ref["ops"][i]);
    }
  }
  // The strings the brief names are all covered, including the old 'w' syntax timm now rejects.
  for (const char* s : {"rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd0.5", "rand-m9-mstd0.5-inc1-mmax12", "rand-m10-w0",
                        "v0", "original", "3a", "augmix-m5-w3", "augmix-m3-w2-d2-a0.5"})
    CHECK(refs["policies"].contains(s));
}

TEST_CASE("augment: a fixed --train-interpolation reaches the ops' hparams", "[parity][augment]") {
  for (const auto& c : policies_ref()["interp_policies"]) {
    const std::string config = c["config"], interp = c["interpolation"];
    INFO(config << " " << interp);
    AugHParams hp = factory_hparams(config, interp);
    REQUIRE(hp.interpolation.has_value());
    CHECK(*hp.interpolation == interp_of(c["hparams"]["interpolation"]));
    CHECK(hp.translate_pct == Approx(c["hparams"]["translate_pct"].get<double>()));
  }
  CHECK_THROWS_AS(factory_hparams("rand-m9", "lanczos"), UserError);
}

TEST_CASE("augment: level_fn arguments equal timm's for every op and magnitude", "[parity][augment]") {
  const auto& sets = policies_ref()["level_args"];
  std::set<std::string> ref_names;
  for (const auto& [name, _] : sets["default"]["ops"].items()) ref_names.insert(name);
  const auto& ours = augment_op_names();
  CHECK(std::set<std::string>(ours.begin(), ours.end()) == ref_names);
  CHECK(ref_names.size() == 27);

  for (const auto& [set_name, set] : sets.items()) {
    AugHParams hp;
    hp.translate_const = set["hparams"]["translate_const"];
    hp.translate_pct = set["hparams"]["translate_pct"];
    for (const auto& [op, ref] : set["ops"].items()) {
      INFO(set_name << " " << op);
      const auto& mags = ref["magnitudes"];
      bool sign_matters = false;
      for (const char* key : {"args", "args_neg"}) {
        auto got = all_args(op, mags, hp, std::string(key) == "args_neg");
        for (size_t i = 0; i < mags.size(); ++i) {
          INFO(key << " at magnitude " << mags[i].get<double>());
          auto want = ref[key][i].get<std::vector<double>>();
          REQUIRE(got[i].size() == want.size());
          for (size_t k = 0; k < want.size(); ++k) CHECK(got[i][k] == Approx(want[k]).margin(1e-9).epsilon(0));
          if (ref["args"][i] != ref["args_neg"][i]) sign_matters = true;
        }
      }
      CHECK(op_has_random_sign(op) == sign_matters);
    }
  }
  // The coin is fair and comes from the generator.
  std::mt19937_64 rng(7);
  int heads = 0;
  for (int i = 0; i < 10000; ++i) heads += draw_negate(rng);
  CHECK(heads > 4700);
  CHECK(heads < 5300);
}

TEST_CASE("augment: point ops are pixel-exact against PIL", "[parity][augment]") {
  const std::set<std::string> point = {"autocontrast", "equalize",     "invert",       "posterize",
                                       "solarize",     "solarize_add", "gaussian_blur"};
  int n = 0;
  for (const auto& c : images_ref()["cases"]) {
    if (!point.count(c["op"].get<std::string>())) continue;
    INFO(c["name"].get<std::string>());
    const Diff d = diff(run_case(c, input(c["input"])), load_bin(c));
    CHECK(d.max == 0);
    ++n;
  }
  CHECK(n >= 30);
  // The references are not trivial: each op changed the image.
  CHECK(!same(case_ref("rgb_equalize"), input("rgb")));
  CHECK(!same(case_ref("rgb_autocontrast"), input("rgb")));
  CHECK(!same(case_ref("gray_gaussian_blur1.5"), input("gray")));
}

// PIL blends in float32 and truncates; we do the same arithmetic, so the results are expected to
// be exact, but the brief's contract is 1 level (compiler contraction to FMA could move a value
// across an integer boundary).
TEST_CASE("augment: enhance ops are within 1 level of PIL", "[parity][augment]") {
  const std::set<std::string> enhance = {"color", "contrast", "brightness", "sharpness", "desaturate"};
  int n = 0;
  for (const auto& c : images_ref()["cases"]) {
    if (!enhance.count(c["op"].get<std::string>())) continue;
    INFO(c["name"].get<std::string>());
    const Diff d = diff(run_case(c, input(c["input"])), load_bin(c));
    CHECK(d.max <= 1);
    CHECK(d.frac_pixels <= 0.01);
    ++n;
  }
  CHECK(n >= 40);
  CHECK(!same(case_ref("rgb_sharpness1.7"), input("rgb")));
  CHECK(!same(case_ref("rgb_contrast0.3"), input("rgb")));
}

// Nearest: PIL's fixed-point stepping is reproduced, so we expect exact output; we allow 0.2% of
// pixels (a sample point within an ulp of a pixel edge after a different libm sin/cos could land
// on the neighbour), which is far fewer than any off-by-half-pixel mistake would produce.
// Bilinear/bicubic: the same double arithmetic as PIL's filters; the truncation to 8 bits can
// flip by one where rounding of the sample point differs, hence max 1 and mean <= 0.01 levels.
TEST_CASE("augment: geometric ops match PIL", "[parity][augment]") {
  const std::set<std::string> geo = {"rotate",      "shear_x",         "shear_y",        "translate_x",
                                     "translate_y", "translate_x_rel", "translate_y_rel"};
  int n = 0;
  for (const auto& c : images_ref()["cases"]) {
    if (!geo.count(c["op"].get<std::string>())) continue;
    INFO(c["name"].get<std::string>());
    const Diff d = diff(run_case(c, input(c["input"])), load_bin(c));
    if (c["interp"] == "nearest") {
      CHECK(d.frac_pixels <= 0.002);
    } else {
      CHECK(d.max <= 1);
      CHECK(d.mean <= 0.01);
    }
    ++n;
  }
  CHECK(n >= 40);
  // The fill shows where the image left the frame, and a half-pixel mistake would show.
  const cv::Mat img = input("rgb");
  const cv::Mat shifted = pil::translate_x(img, 10.0, Interp::Nearest, kFill);
  CHECK(shifted.at<cv::Vec3b>(0, img.cols - 1) == cv::Vec3b(124, 116, 104));
  CHECK(shifted.at<cv::Vec3b>(5, 0) == img.at<cv::Vec3b>(5, 10));
  CHECK(!same(pil::translate_x(img, 10.5, Interp::Nearest, kFill), shifted));
}

TEST_CASE("augment: AugMix's mixing step matches timm's", "[parity][augment]") {
  const auto& ref = images_ref()["augmix"];
  const cv::Mat img = input("rgb");
  std::vector<cv::Mat> chains = {pil::rotate(img, 10.0, Interp::Nearest, kFill), pil::equalize(img),
                                 pil::solarize(img, 128)};
  auto w = ref["weights"].get<std::vector<float>>();
  const cv::Mat ours = augmix_mix(img, chains, w, ref["m"].get<float>());
  CHECK(diff(ours, load_bin(ref)).max == 0);
  CHECK(!same(ours, img));
}

TEST_CASE("augment: ColorJitter", "[parity][augment]") {
  const cv::Mat img = input("rgb");
  SECTION("fixed draws equal torchvision's functional ops") {
    const auto& ref = images_ref()["color_jitter"];
    ColorJitterParams p;
    auto order = ref["order"].get<std::vector<int>>();
    std::copy(order.begin(), order.end(), p.order.begin());
    p.brightness = ref["brightness"].get<double>();
    p.contrast = ref["contrast"].get<double>();
    p.saturation = ref["saturation"].get<double>();
    CHECK(diff(apply_color_jitter(img, p), load_bin(ref)).max == 0);
    // Order matters (every step truncates to 8 bits), so a fixed order would not pass.
    std::swap(p.order[0], p.order[2]);
    CHECK(diff(apply_color_jitter(img, p), load_bin(ref)).max > 0);
  }
  SECTION("factor 0 is the identity") {
    for (uint64_t seed = 0; seed < 5; ++seed) {
      std::mt19937_64 rng(seed);
      ColorJitterConfig cfg{0, 0, 0};
      CHECK(same(color_jitter(img, cfg, rng), img));
      auto p = draw_color_jitter(cfg, rng);
      CHECK(!p.brightness);
      CHECK(!p.contrast);
      CHECK(!p.saturation);
    }
    std::mt19937_64 rng(1);
    CHECK(!same(color_jitter(img, ColorJitterConfig{0.4, 0.4, 0.4}, rng), img));
  }
  SECTION("factors are uniform in [max(0, 1 - v), 1 + v], order is a permutation") {
    std::mt19937_64 rng(3);
    double lo = 9, hi = -9, lo_big = 9;
    std::set<std::array<int, 3>> orders;
    for (int i = 0; i < 3000; ++i) {
      auto p = draw_color_jitter(ColorJitterConfig{0.4, 0.4, 0.4}, rng);
      for (double f : {*p.brightness, *p.contrast, *p.saturation}) {
        lo = std::min(lo, f);
        hi = std::max(hi, f);
      }
      auto o = p.order;
      std::sort(o.begin(), o.end());
      CHECK(o == std::array<int, 3>{0, 1, 2});
      orders.insert(p.order);
      lo_big = std::min(lo_big, *draw_color_jitter(ColorJitterConfig{1.5, 0, 0}, rng).brightness);
    }
    CHECK(lo >= 0.6);
    CHECK(lo < 0.61);
    CHECK(hi <= 1.4);
    CHECK(hi > 1.39);
    CHECK(orders.size() == 6);
    CHECK(lo_big >= 0.0);
    CHECK(lo_big < 0.01);
  }
  std::mt19937_64 rng(1);
  CHECK_THROWS_AS(draw_color_jitter(ColorJitterConfig{-0.1, 0, 0}, rng), UserError);
}

TEST_CASE("augment: AugmentOp semantics", "[parity][augment]") {
  const cv::Mat img = input("rgb");
  AugHParams hp;
  hp.img_mean = kFill;
  SECTION("an op at a fixed magnitude is timm's op at timm's argument") {
    std::mt19937_64 rng(5);
    // SolarizeIncreasing at 5: threshold 256 - int(0.5 * 256) = 128, PIL's solarize(128).
    CHECK(same(apply_op(img, OpSpec{"SolarizeIncreasing", 1.0, 5, 0, {}}, hp, rng), case_ref("rgb_solarize128")));
    CHECK(same(apply_op(img, OpSpec{"Invert", 1.0, 3, 0, {}}, hp, rng), case_ref("rgb_invert")));
    // Rotate at 10 with a fixed filter: +-30 degrees, both signs drawn.
    hp.interpolation = Interp::Nearest;
    const cv::Mat pos = case_ref("rgb_rotate30.0_nearest"), neg = pil::rotate(img, -30.0, Interp::Nearest, kFill);
    int n_pos = 0, n_neg = 0;
    for (int i = 0; i < 40; ++i) {
      cv::Mat out = apply_op(img, OpSpec{"Rotate", 1.0, 10, 0, {}}, hp, rng);
      n_pos += same(out, pos);
      n_neg += same(out, neg);
    }
    CHECK(n_pos + n_neg == 40);
    CHECK(n_pos > 5);
    CHECK(n_neg > 5);
  }
  SECTION("random interpolation draws bilinear and bicubic") {
    std::mt19937_64 rng(11);
    const cv::Mat bl = case_ref("rgb_shear_x0.3_bilinear"), bc = case_ref("rgb_shear_x0.3_bicubic");
    REQUIRE(!same(bl, bc));
    int n_bl = 0, n_bc = 0;
    for (int i = 0; i < 40; ++i) {
      // ShearX's sign is drawn too; keep the positive ones.
      cv::Mat out = apply_op(img, "ShearX", std::vector<double>{0.3}, hp, rng);
      n_bl += diff(out, bl).max <= 1 && diff(out, bl).mean <= 0.01;
      n_bc += diff(out, bc).max <= 1 && diff(out, bc).mean <= 0.01;
    }
    CHECK(n_bl + n_bc == 40);
    CHECK(n_bl > 5);
    CHECK(n_bc > 5);
  }
  SECTION("probability") {
    std::mt19937_64 rng(2);
    CHECK(same(apply_op(img, OpSpec{"Invert", 0.0, 10, 0, {}}, hp, rng), img));
    int applied = 0;
    for (int i = 0; i < 400; ++i) applied += !same(apply_op(img, OpSpec{"Invert", 0.5, 10, 0, {}}, hp, rng), img);
    CHECK(applied > 160);
    CHECK(applied < 240);
  }
  SECTION("PosterizeIncreasing at magnitude 10 keeps 0 bits") {
    // Pillow 13 raises here (bits must be 1..8); older Pillow, and we, give black.
    std::mt19937_64 rng(2);
    cv::Mat out = apply_op(img, OpSpec{"PosterizeIncreasing", 1.0, 10, 0, {}}, hp, rng);
    CHECK(cv::countNonZero(out.reshape(1)) == 0);
    CHECK(same(pil::posterize(img, 8), img));
  }
}

TEST_CASE("augment: magnitude noise as timm draws it", "[parity][augment]") {
  std::mt19937_64 rng(42);
  CHECK(sample_magnitude(OpSpec{"Rotate", 1, 9, 0, {}}, rng) == 9.0);
  CHECK(sample_magnitude(OpSpec{"Rotate", 1, 12, 0, {}}, rng) == 10.0);  // clamped to 10
  CHECK(sample_magnitude(OpSpec{"Rotate", 1, 12, 0, 12}, rng) == 12.0);  // mmax lifts the clamp
  CHECK(sample_magnitude(OpSpec{"Rotate", 1, 12, 0, 0}, rng) == 10.0);   // mmax0 means 10, as in timm
  const int n = 20000;
  auto stats = [&](const OpSpec& op) {
    double s = 0, s2 = 0, lo = 1e9, hi = -1e9;
    for (int i = 0; i < n; ++i) {
      double m = sample_magnitude(op, rng);
      s += m;
      s2 += m * m;
      lo = std::min(lo, m);
      hi = std::max(hi, m);
    }
    double mean = s / n;
    return std::array<double, 4>{mean, std::sqrt(s2 / n - mean * mean), lo, hi};
  };
  // mstd=inf: uniform in [0, magnitude] (timm's random.uniform(0, magnitude), not [0, mmax]).
  auto u = stats(OpSpec{"Rotate", 1, 9, INFINITY, {}});
  CHECK(u[0] == Approx(4.5).margin(0.1));
  CHECK(u[1] == Approx(9 / std::sqrt(12.0)).margin(0.05));
  CHECK(u[2] >= 0.0);
  CHECK(u[3] <= 9.0);
  CHECK(u[3] > 8.9);
  // Gaussian around the magnitude.
  auto g = stats(OpSpec{"Rotate", 1, 5, 0.5, {}});
  CHECK(g[0] == Approx(5.0).margin(0.02));
  CHECK(g[1] == Approx(0.5).margin(0.02));
  // ...clamped at 10.
  auto c = stats(OpSpec{"Rotate", 1, 9.5, 1.0, {}});
  CHECK(c[3] == 10.0);
  auto c12 = stats(OpSpec{"Rotate", 1, 9.5, 1.0, 12});
  CHECK(c12[3] > 10.5);
}

TEST_CASE("augment: RandAugment's op choice", "[parity][augment]") {
  std::mt19937_64 rng(9);
  const AugmentPolicy uni = parse_augment("rand-m9-n3");
  const AugmentPolicy wtd = parse_augment("rand-m9-n3-tweights");
  std::vector<int> first(uni.ops.size(), 0), wfirst(wtd.ops.size(), 0);
  int dup = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto a = draw_rand_augment_ops(uni, rng);
    REQUIRE(a.size() == 3);
    ++first[a[0]];
    dup += a[0] == a[1];
    auto b = draw_rand_augment_ops(wtd, rng);
    REQUIRE(b.size() == 3);
    CHECK(std::set<size_t>(b.begin(), b.end()).size() == 3);  // without replacement
    ++wfirst[b[0]];
  }
  for (int f : first) CHECK(f == Approx(n / 15.0).margin(n * 0.012));
  CHECK(dup == Approx(n / 15.0).margin(n * 0.012));  // uniform picks are with replacement
  for (size_t i = 0; i < wtd.ops.size(); ++i) CHECK(wfirst[i] == Approx(n * wtd.choice_weights[i]).margin(n * 0.012));
  CHECK(draw_rand_augment_ops(parse_augment("rand-n0"), rng).empty());
}

TEST_CASE("augment: policies are deterministic in the generator state", "[parity][augment]") {
  const cv::Mat img = input("rgb");
  for (const char* config :
       {"rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd0.5", "rand-m9-mstd0.5-inc1-mmax12", "v0", "original", "3a",
        "augmix-m5-w3", "augmix-m3-w2-d2-a0.5", "augmix-m5-w3-b1", "rand-m9-t3aw-inc1"}) {
    INFO(config);
    const AugmentPolicy pol = parse_augment(config, factory_hparams(config));
    std::set<size_t> distinct;  // hashes of the outputs' bytes
    int changed = 0;
    for (uint64_t seed = 0; seed < 12; ++seed) {
      std::mt19937_64 a(seed), b(seed);
      cv::Mat x = apply_augment(img, pol, a), y = apply_augment(img, pol, b);
      REQUIRE(x.size() == img.size());
      REQUIRE(x.type() == img.type());
      CHECK(same(x, y));
      CHECK(a() == b());  // and the same number of draws
      cv::Mat xc = x.clone();
      distinct.insert(std::hash<std::string_view>{}(
          std::string_view(reinterpret_cast<const char*>(xc.data), xc.total() * xc.elemSize())));
      changed += !same(x, img);
    }
    CHECK(distinct.size() >= 6);
    CHECK(changed >= 6);
  }
  // A grayscale image goes through every op too.
  const cv::Mat gray = input("gray");
  for (const char* config : {"rand-m9-mstd0.5-inc1", "augmix-m5-w3", "original", "3a"}) {
    std::mt19937_64 rng(1);
    const AugmentPolicy pol = parse_augment(config, factory_hparams(config));
    for (int i = 0; i < 10; ++i) CHECK(apply_augment(gray, pol, rng).type() == CV_8UC1);
  }
}

TEST_CASE("augment: AugMix's random draws", "[parity][augment]") {
  std::mt19937_64 rng(17);
  const int n = 20000;
  double s = 0, s2 = 0, d0 = 0, s_half2 = 0, g = 0;
  for (int i = 0; i < n; ++i) {
    double b = sample_beta(1.0, 1.0, rng);
    REQUIRE(b >= 0.0);
    REQUIRE(b <= 1.0);
    s += b;
    s2 += b * b;
    double h = sample_beta(0.5, 0.5, rng) - 0.5;
    s_half2 += h * h;
    auto w = sample_dirichlet(1.0, 3, rng);
    REQUIRE(w.size() == 3);
    CHECK(std::abs(w[0] + w[1] + w[2] - 1.0f) < 1e-5f);
    d0 += w[0];
    g += sample_gamma(0.5, rng);
  }
  CHECK(s / n == Approx(0.5).margin(0.01));
  CHECK(s2 / n - (s / n) * (s / n) == Approx(1.0 / 12).margin(0.003));
  CHECK(s_half2 / n == Approx(1.0 / 8).margin(0.004));  // Beta(.5, .5) has variance 1/8
  CHECK(d0 / n == Approx(1.0 / 3).margin(0.01));
  CHECK(g / n == Approx(0.5).margin(0.02));
}

TEST_CASE("augment: RandomErasing", "[parity][augment]") {
  auto make = [](int type) {
    cv::Mat m(60, 80, type);
    cv::randu(m, cv::Scalar::all(0.5), cv::Scalar::all(2.0));  // no zeros outside erased areas
    return m;
  };
  auto inside = [](const cv::Rect& r, int y, int x) { return r.contains(cv::Point(x, y)); };
  SECTION("p=0 leaves the image") {
    for (uint64_t seed = 0; seed < 20; ++seed) {
      std::mt19937_64 rng(seed);
      cv::Mat m = make(CV_32FC3), orig = m.clone();
      RandomErasingConfig cfg;
      cfg.probability = 0;
      CHECK(random_erasing(m, cfg, rng).empty());
      CHECK(cv::norm(m, orig, cv::NORM_INF) == 0);
    }
  }
  SECTION("p=1, const: one rectangle of zeros within the area and aspect bounds") {
    for (int type : {CV_32FC3, CV_32FC1}) {
      for (uint64_t seed = 0; seed < 200; ++seed) {
        std::mt19937_64 rng(seed);
        cv::Mat m = make(type), orig = m.clone();
        RandomErasingConfig cfg;
        cfg.probability = 1;
        auto rects = random_erasing(m, cfg, rng);
        REQUIRE(rects.size() == 1);
        const cv::Rect r = rects[0];
        INFO("rect " << r.x << "," << r.y << " " << r.width << "x" << r.height);
        CHECK((r & cv::Rect(0, 0, m.cols, m.rows)) == r);
        CHECK(r.width < m.cols);
        CHECK(r.height < m.rows);
        // h = round(sqrt(A * ar)), w = round(sqrt(A / ar)), so A lies in [(h-.5)(w-.5), (h+.5)(w+.5)]
        // and ar in [(h-.5)/(w+.5), (h+.5)/(w-.5)]; these intervals must meet timm's bounds.
        const double area = double(m.rows) * m.cols, h = r.height, w = r.width;
        CHECK((h - 0.5) * (w - 0.5) <= area / 3.0);
        CHECK((h + 0.5) * (w + 0.5) >= 0.02 * area);
        CHECK((h - 0.5) / (w + 0.5) <= 1 / 0.3);
        CHECK((h + 0.5) / (w - 0.5) >= 0.3);
        for (int y = 0; y < m.rows; ++y)
          for (int x = 0; x < m.cols; ++x)
            for (int c = 0; c < m.channels(); ++c) {
              float v = m.ptr<float>(y)[x * m.channels() + c];
              if (inside(r, y, x))
                REQUIRE(v == 0.0f);
              else
                REQUIRE(v == orig.ptr<float>(y)[x * m.channels() + c]);
            }
      }
    }
  }
  SECTION("counts are in [1, recount], area shared between them") {
    std::map<size_t, int> seen;
    for (uint64_t seed = 0; seed < 300; ++seed) {
      std::mt19937_64 rng(seed);
      cv::Mat m = make(CV_32FC3);
      RandomErasingConfig cfg;
      cfg.probability = 1;
      cfg.max_count = 3;
      auto rects = random_erasing(m, cfg, rng);
      CHECK(rects.size() >= 1);
      CHECK(rects.size() <= 3);
      ++seen[rects.size()];
      // timm divides the area between the rectangles (count >= the rectangles placed).
      for (const auto& r : rects)
        CHECK((r.height - 0.5) * (r.width - 0.5) <= double(m.total()) / 3.0 / double(rects.size()));
    }
    CHECK(seen[1] > 50);
    CHECK(seen[3] > 50);
  }
  SECTION("rand: one normal value per channel; pixel: per pixel") {
    std::mt19937_64 rng(4);
    cv::Mat m = make(CV_32FC3);
    RandomErasingConfig cfg;
    cfg.probability = 1;
    cfg.mode = parse_erase_mode("rand");
    auto r = random_erasing(m, cfg, rng).at(0);
    cv::Vec3f first = m.at<cv::Vec3f>(r.y, r.x);
    CHECK(m.at<cv::Vec3f>(r.y + r.height - 1, r.x + r.width - 1) == first);
    CHECK(first[0] != first[1]);
    cv::Mat p = make(CV_32FC3);
    cfg.mode = parse_erase_mode("PIXEL");
    auto rp = random_erasing(p, cfg, rng).at(0);
    cv::Mat patch = p(rp).clone().reshape(1);
    cv::Scalar mean, sd;
    cv::meanStdDev(patch, mean, sd);
    CHECK(mean[0] == Approx(0).margin(0.2));
    CHECK(sd[0] == Approx(1).margin(0.2));
  }
  CHECK(parse_erase_mode("const") == EraseMode::Const);
  CHECK_THROWS_AS(parse_erase_mode("zeros"), UserError);
}
