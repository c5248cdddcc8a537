// The detection ops against torchvision.ops (references from make_ops_refs.py): nms and
// batched_nms keep the same indices in the same order, box_iou and roi_align (forward and input
// gradient) are bitwise equal, on random inputs with ties, degenerate and out-of-image boxes.
#include "io/safetensors.h"
#include "ops/ops.h"

#include "test_util.h"

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <torch/torch.h>

using namespace imgtrain;

namespace {
const io::SafeTensors& refs() {
  static const auto r = io::load_safetensors(std::string(IMGTRAIN_PARITY_DIR) + "/ops/ops.safetensors");
  return r;
}
at::Tensor get(const std::string& k) {
  const at::Tensor* t = refs().find(k);
  if (!t) throw std::runtime_error("missing reference " + k);
  return *t;
}
}  // namespace

TEST_CASE("nms and batched_nms keep what torchvision keeps, in its order", "[parity][ops]") {
  int cases = 0;
  for (int i = 0; refs().find(fmt::format("nms{}_boxes", i)); ++i, ++cases) {
    const auto b = get(fmt::format("nms{}_boxes", i)), s = get(fmt::format("nms{}_scores", i));
    const auto c = get(fmt::format("nms{}_idxs", i));
    for (int thr : {3, 5, 7}) {
      INFO("case " << i << " (" << b.size(0) << " boxes) threshold 0." << thr);
      CHECK(torch::equal(ops::nms(b, s, thr / 10.0), get(fmt::format("nms{}_keep_{}", i, thr))));
      CHECK(torch::equal(ops::batched_nms(b, s, c, thr / 10.0), get(fmt::format("nms{}_bkeep_{}", i, thr))));
    }
  }
  CHECK(cases == 6);
  CHECK_THROWS(ops::nms(torch::zeros({3, 4}), torch::zeros({2}), 0.5));
}

TEST_CASE("box_iou equals torchvision's", "[parity][ops]") {
  // degenerate boxes against each other give 0 / 0 = NaN in both: equal to the bit, NaN included
  const auto got = ops::box_iou(get("iou_a"), get("iou_b")), want = get("iou_ab");
  CHECK(torch::isnan(want).sum().item<int64_t>() > 0);
  CHECK(torch::equal(torch::isnan(got), torch::isnan(want)));
  CHECK(torch::allclose(got, want, /*rtol=*/0, /*atol=*/0, /*equal_nan=*/true));
}

TEST_CASE("roi_align forward and input gradient equal torchvision's", "[parity][ops]") {
  int cases = 0;
  for (int i = 0; refs().find(fmt::format("ra{}_x", i)); ++i, ++cases) {
    const std::string p = fmt::format("ra{}_", i);
    const auto a = get(p + "args");
    const double scale = a[0].item<double>();
    const int64_t ph = int64_t(a[1].item<double>()), pw = int64_t(a[2].item<double>());
    const int64_t sampling = int64_t(a[3].item<double>());
    const bool aligned = a[4].item<double>() != 0;
    INFO("case " << i << " " << get(p + "x").scalar_type() << " scale " << scale << " " << ph << "x" << pw
                 << " sampling " << sampling << " aligned " << aligned);
    auto x = get(p + "x").clone().requires_grad_();
    auto y = ops::roi_align(x, get(p + "rois"), scale, ph, pw, sampling, aligned);
    CHECK(torch::equal(y, get(p + "y")));
    auto gx = torch::autograd::grad({y}, {x}, {get(p + "gy")})[0];
    const auto want = get(p + "gx");
    CHECK(torch::allclose(gx, want, 1e-6, 1e-6));
    CHECK(torch::equal(gx, want));
    // channels-last maps: read in place, a channels-last result and gradient, the same bits
    auto xc = get(p + "x").contiguous(at::MemoryFormat::ChannelsLast).requires_grad_();
    auto yc = ops::roi_align(xc, get(p + "rois"), scale, ph, pw, sampling, aligned);
    CHECK(torch::equal(yc, get(p + "y")));
    auto gxc = torch::autograd::grad({yc}, {xc}, {get(p + "gy")})[0];
    CHECK(torch::equal(gxc, want));
    if (xc.size(1) > 1 && xc.size(2) * xc.size(3) > 1) {
      CHECK(yc.is_contiguous(at::MemoryFormat::ChannelsLast));
      CHECK(gxc.is_contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  CHECK(cases == 36);
  // half precision (autocast's output) runs in float32 and comes back as half
  auto xh = get("ra0_x").to(torch::kHalf);
  auto yh = ops::roi_align(xh, get("ra0_rois"), 1.0, 7, 7, 0, false);
  CHECK(yh.scalar_type() == torch::kHalf);
  CHECK(torch::allclose(yh.to(torch::kFloat), ops::roi_align(xh.to(torch::kFloat), get("ra0_rois"), 1.0, 7, 7, 0, false).to(torch::kHalf).to(torch::kFloat)));
  CHECK_THROWS(ops::roi_align(torch::zeros({1, 1, 4}), torch::zeros({1, 5}), 1.0, 2, 2, 0, false));
}

TEST_CASE("multiscale_roi_align equals roi_align level by level, forward and gradients", "[parity][ops]") {
  torch::manual_seed(3);
  // four levels of two images, strides 4..32 of a 64x96 canvas; level 2 gets no RoI
  std::vector<at::Tensor> feats;
  const std::vector<double> scales{0.25, 0.125, 0.0625, 0.03125};
  for (double s : scales) feats.push_back(torch::randn({2, 3, int64_t(64 * s), int64_t(96 * s)}).requires_grad_());
  const int64_t K = 23;
  auto xy = torch::rand({K, 2}) * torch::tensor({80.0f, 50.0f}), wh = torch::rand({K, 2}) * 40 + 0.5;
  auto rois = torch::cat({torch::randint(0, 2, {K, 1}).to(torch::kFloat), xy, xy + wh}, 1);
  auto levels = torch::randint(0, 3, {K}, torch::kLong);
  levels.masked_fill_(levels.eq(2), 3);
  for (bool aligned : {false, true})
    for (int64_t sampling : {2, 0}) {
      INFO("aligned " << aligned << " sampling " << sampling);
      auto y = ops::multiscale_roi_align(feats, rois, levels, scales, 5, 4, sampling, aligned);
      // the reference: each level on its own, scattered into a zeroed result
      auto want = torch::zeros({K, 3, 5, 4});
      for (int64_t l = 0; l < 4; ++l) {
        const auto idx = torch::where(levels.eq(l))[0];
        want = want.index_put({idx}, ops::roi_align(feats[size_t(l)], rois.index_select(0, idx), scales[size_t(l)], 5,
                                                    4, sampling, aligned));
      }
      CHECK(torch::equal(y, want));
      const auto gy = torch::randn_like(y);
      auto got = torch::autograd::grad({y}, feats, {gy}, {}, false, /*allow_unused=*/true);
      auto ref = torch::autograd::grad({want}, feats, {gy}, {}, false, true);
      for (size_t l = 0; l < 4; ++l) {
        INFO("level " << l);
        if (l == 2) {  // read by no RoI: no gradient, or a zero one
          CHECK((!got[l].defined() || got[l].abs().sum().item<float>() == 0));
          continue;
        }
        REQUIRE(got[l].defined());
        CHECK(got[l].abs().sum().item<float>() > 0);
        CHECK(torch::equal(got[l], ref[l]));
      }
    }
  {  // channels-last maps: the same values and gradients, channels-last ones
    std::vector<at::Tensor> cl;
    for (auto& f : feats) cl.push_back(f.detach().contiguous(at::MemoryFormat::ChannelsLast).requires_grad_());
    auto yc = ops::multiscale_roi_align(cl, rois, levels, scales, 5, 4, 2, false);
    auto yn = ops::multiscale_roi_align(feats, rois, levels, scales, 5, 4, 2, false);
    CHECK(torch::equal(yc, yn));
    CHECK(yc.is_contiguous(at::MemoryFormat::ChannelsLast));
    const auto gy = torch::randn_like(yn);
    auto gc = torch::autograd::grad({yc}, cl, {gy}, {}, false, true);
    auto gn = torch::autograd::grad({yn}, feats, {gy}, {}, false, true);
    for (size_t l : {0, 1, 3}) {
      CHECK(torch::equal(gc[l], gn[l]));
      CHECK(gc[l].is_contiguous(at::MemoryFormat::ChannelsLast));
    }
  }
  // bfloat16 maps (autocast) run in float32 and come back in bfloat16
  std::vector<at::Tensor> bf;
  for (auto& f : feats) bf.push_back(f.detach().to(torch::kBFloat16));
  auto yb = ops::multiscale_roi_align(bf, rois, levels, scales, 5, 4, 2, false);
  CHECK(yb.scalar_type() == torch::kBFloat16);
  std::vector<at::Tensor> back;
  for (auto& f : bf) back.push_back(f.to(torch::kFloat));
  CHECK(torch::equal(yb, ops::multiscale_roi_align(back, rois, levels, scales, 5, 4, 2, false).to(torch::kBFloat16)));
  {  // every RoI on one level: the same numbers as roi_align on it, gradients included
    const auto one = torch::full({K}, 1, torch::kLong);
    auto y1 = ops::multiscale_roi_align(feats, rois, one, scales, 5, 4, 2, false);
    auto r1 = ops::roi_align(feats[1], rois, scales[1], 5, 4, 2, false);
    CHECK(torch::equal(y1, r1));
    const auto gy = torch::randn_like(y1);
    auto g = torch::autograd::grad({y1}, {feats[1]}, {gy})[0], gr = torch::autograd::grad({r1}, {feats[1]}, {gy})[0];
    CHECK(torch::equal(g, gr));
  }
  CHECK_THROWS(ops::multiscale_roi_align(feats, rois, levels.slice(0, 1), scales, 5, 4, 2, false));
  CHECK_THROWS(ops::multiscale_roi_align(feats, rois, levels, {0.25}, 5, 4, 2, false));
  CHECK_THROWS(ops::multiscale_roi_align(feats, rois, levels + 1, scales, 5, 4, 2, false));
  CHECK_THROWS(ops::multiscale_roi_align(feats, rois, levels - 1, scales, 5, 4, 2, false));
}

// The device kernels (ops_cuda.cu) against the same references: torchvision's CPU results, which
// the device may differ from by float rounding (contraction), so values are compared with a
// tolerance and NMS indices exactly. Without a GPU the test reports itself skipped (exit 77).
TEST_CASE("CUDA kernels: nms, batched_nms and roi_align on the device agree with torchvision's", "[cuda][ops]") {
  test::skip_unless(torch::cuda::is_available());
  const torch::Device dev(torch::kCUDA, 0);
  int cases = 0;
  for (int i = 0; refs().find(fmt::format("nms{}_boxes", i)); ++i, ++cases) {
    const auto b = get(fmt::format("nms{}_boxes", i)).to(dev), s = get(fmt::format("nms{}_scores", i)).to(dev);
    const auto c = get(fmt::format("nms{}_idxs", i)).to(dev);
    for (int thr : {3, 5, 7}) {
      INFO("nms case " << i << " threshold 0." << thr);
      const auto keep = ops::nms(b, s, thr / 10.0);
      CHECK(keep.is_cuda());
      CHECK(torch::equal(keep.cpu(), get(fmt::format("nms{}_keep_{}", i, thr))));
      CHECK(torch::equal(ops::batched_nms(b, s, c, thr / 10.0).cpu(), get(fmt::format("nms{}_bkeep_{}", i, thr))));
    }
  }
  CHECK(cases == 6);
  int ra = 0;
  for (int i = 0; refs().find(fmt::format("ra{}_x", i)); ++i, ++ra) {
    const std::string p = fmt::format("ra{}_", i);
    const auto a = get(p + "args");
    const double scale = a[0].item<double>();
    const int64_t ph = int64_t(a[1].item<double>()), pw = int64_t(a[2].item<double>());
    const int64_t sampling = int64_t(a[3].item<double>());
    const bool aligned = a[4].item<double>() != 0;
    INFO("roi_align case " << i);
    auto x = get(p + "x").to(dev).requires_grad_();
    auto y = ops::roi_align(x, get(p + "rois").to(dev), scale, ph, pw, sampling, aligned);
    CHECK(y.is_cuda());
    CHECK(torch::allclose(y.cpu(), get(p + "y"), 1e-5, 1e-5));
    auto gx = torch::autograd::grad({y}, {x}, {get(p + "gy").to(dev)})[0];
    CHECK(gx.is_cuda());
    CHECK(torch::allclose(gx.cpu(), get(p + "gx"), 1e-5, 1e-5));
  }
  CHECK(ra == 36);
  // empty inputs
  CHECK(ops::nms(torch::zeros({0, 4}, dev), torch::zeros({0}, dev), 0.5).numel() == 0);
  CHECK(ops::roi_align(torch::rand({1, 2, 8, 8}, dev), torch::zeros({0, 5}, dev), 1.0, 2, 2, 0, false).size(0) == 0);
}
