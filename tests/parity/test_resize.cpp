// PIL-exact resizing and timm's eval transform against the references of make_resize_refs.py:
// every comparison is exact (uint8 equality), as timm's validate.py sees the same pixels.
#include "data/dataset.h"
#include "data/resample.h"
#include "data/transforms.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace imgtrain;

namespace {

const char* const kFilters[] = {"nearest", "box", "bilinear", "hamming", "bicubic", "lanczos"};
const char* const kModes[] = {"center", "squash", "border"};

std::string dir() { return std::string(IMGTRAIN_PARITY_DIR) + "/resize"; }

const io::SafeTensors& refs() {
  static const io::SafeTensors st = io::load_safetensors(dir() + "/resize_refs.safetensors");
  return st;
}

const at::Tensor& reference(const std::string& name) {
  const at::Tensor* t = refs().find(name);
  if (!t) FAIL("no reference " << name);
  return *t;
}

cv::Mat to_mat(const at::Tensor& hwc) {
  auto t = hwc.contiguous();
  cv::Mat m(int(t.size(0)), int(t.size(1)), CV_8UC(int(t.size(2))), t.data_ptr());
  return m.clone();
}

at::Tensor to_tensor(const cv::Mat& m) {
  cv::Mat c = m.isContinuous() ? m : m.clone();
  return torch::from_blob(c.data, {c.rows, c.cols, c.channels()}, torch::kUInt8).clone();
}

// The number of differing bytes (0 = equal), with the sizes required equal first.
int64_t mismatches(const at::Tensor& ours, const at::Tensor& want) {
  REQUIRE(ours.sizes() == want.sizes());
  return (ours != want).sum().item<int64_t>();
}

}  // namespace

TEST_CASE("pil_resize equals Image.resize for every filter on random sizes", "[parity][resize]") {
  int cases = 0;
  for (int i = 0; refs().find("resize." + std::to_string(i) + ".src"); ++i, ++cases) {
    const std::string p = "resize." + std::to_string(i);
    const auto args = reference(p + ".args");
    const auto filter = data::parse_resample(kFilters[args[0].item<int64_t>()]);
    const cv::Size to(int(args[1].item<int64_t>()), int(args[2].item<int64_t>()));
    const cv::Mat src = to_mat(reference(p + ".src"));
    INFO(p << ": " << kFilters[args[0].item<int64_t>()] << " " << src.cols << "x" << src.rows << " -> " << to.width
           << "x" << to.height << " channels " << src.channels());
    CHECK(mismatches(to_tensor(data::pil_resize(src, to, filter)), reference(p + ".out")) == 0);
    // A cut of the output (what the center crop keeps) is the same pixels as cutting afterwards.
    if (to.width > 2 && to.height > 2) {
      const cv::Rect roi(1, to.height / 3, to.width - 2, to.height - to.height / 3 - 1);
      const auto want = reference(p + ".out").slice(0, roi.y, roi.y + roi.height).slice(1, roi.x, roi.x + roi.width);
      CHECK(mismatches(to_tensor(data::pil_resize(src, to, filter, roi)), want) == 0);
    }
  }
  CHECK(cases >= 100);
}

TEST_CASE("an RGB image converted to L equals PIL convert", "[parity][resize]") {
  CHECK(mismatches(to_tensor(data::pil_rgb_to_l(to_mat(reference("l.src")))), reference("l.out")) == 0);
}

TEST_CASE("the eval transform equals timm create_transform on JPEG and PNG files", "[parity][resize]") {
  int compared = 0;
  for (int ci = 0; refs().find("eval.cfg." + std::to_string(ci)); ++ci) {
    const auto cfg = reference("eval.cfg." + std::to_string(ci));
    data::TransformConfig tc;
    tc.train = false;
    tc.size = int(cfg[0].item<double>());
    tc.crop_pct = cfg[1].item<double>();
    tc.interpolation = kFilters[int(cfg[2].item<double>())];
    tc.crop_mode = kModes[int(cfg[3].item<double>())];
    tc.channels = int(cfg[4].item<double>());
    for (const char* name : {"land.jpg", "port.jpg", "big.jpg", "odd.png", "small.jpg", "square.png", "gray.jpg"}) {
      INFO(name << " config " << ci << ": " << tc.size << " crop_pct " << tc.crop_pct << " " << tc.interpolation << " "
                << tc.crop_mode << " channels " << tc.channels);
      const std::string bytes = test::read_file(dir() + "/images/" + name);
      std::mt19937_64 rng(0);
      CHECK(mismatches(to_tensor(data::apply_transform_encoded(bytes, tc, rng, name)),
                       reference(std::string("eval.") + name + "." + std::to_string(ci))) == 0);
      ++compared;
    }
  }
  CHECK(compared >= 70);
}

TEST_CASE("the fast eval decode stays close to the exact one", "[parity][resize]") {
  data::TransformConfig tc;
  tc.train = false;
  tc.size = 112;  // big.jpg (1024x683) is more than 2x the resize: the DCT-domain downscale runs
  tc.interpolation = "bicubic";
  std::mt19937_64 rng(0);
  const std::string bytes = test::read_file(dir() + "/images/big.jpg");
  const auto exact = to_tensor(data::apply_transform_encoded(bytes, tc, rng, "big.jpg")).to(torch::kFloat);
  tc.fast_decode = true;
  const auto fast = to_tensor(data::apply_transform_encoded(bytes, tc, rng, "big.jpg")).to(torch::kFloat);
  REQUIRE(fast.sizes() == exact.sizes());
  const double mean_abs = (fast - exact).abs().mean().item<double>();
  CHECK(mean_abs > 0);  // a different path, not the exact one again
  CHECK(mean_abs < 6);
}
