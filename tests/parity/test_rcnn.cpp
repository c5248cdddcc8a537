// Faster / Mask R-CNN against torchvision (references from make_rcnn_refs.py): the same weights
// and the same transformed images give the same proposals, detections (boxes, scores, labels, mask
// probabilities) and postprocessed outputs, and in training the same five losses and gradients
// with the balanced samplers made deterministic.
#include "core/batch_norm.h"
#include "engine/setup.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "model_zoo/detection/rcnn.h"
#include "ops/depthwise.h"
#include "op_trace.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <fmt/format.h>
#include <torch/torch.h>

using namespace imgtrain;
using namespace imgtrain::model_zoo::detection;

namespace {

struct Refs {
  io::SafeTensors st;
  at::Tensor get(const std::string& k) const {
    const at::Tensor* t = st.find(k);
    if (!t) throw std::runtime_error("missing reference " + k);
    return *t;
  }
  bool has(const std::string& k) const { return st.find(k) != nullptr; }
};

Refs load(const std::string& arch) {
  return {io::load_safetensors(std::string(IMGTRAIN_PARITY_DIR) + "/rcnn/" + arch + ".safetensors")};
}

// "<arch>_narrow": the model with make_rcnn_refs.py's other widths and level mapper.
GeneralizedRCNN model_for(const std::string& ref, const Refs& r, int64_t mask_rois_per_image = 0,
                          RCNNOptions::MaskConvention mask_convention = RCNNOptions::MaskConvention::kTorchvision,
                          bool from_weights = false) {
  const std::string narrow = "_narrow";
  const bool is_narrow = ref.size() > narrow.size() && ref.ends_with(narrow);
  const std::string arch = is_narrow ? ref.substr(0, ref.size() - narrow.size()) : ref;
  RCNNOptions o;
  o.num_classes = 3;
  if (is_narrow) {
    o.fpn_channels = 96;
    o.box_head_dim = 384;
    o.mask_head_dim = 64;
    o.mask_head_convs = 2;
    o.roi_canonical_size = 112;
  }
  o.deterministic_sampling = true;
  o.mask_rois_per_image = mask_rois_per_image;
  o.mask_convention = mask_convention;
  o.from_weights = from_weights;
  const auto d = rcnn_defaults(arch);  // what the builder sets (the MobileNetV3 detectors' RPN numbers)
  o.rpn_pre_nms_top_n_test = d.rpn_pre_nms_top_n_test;
  o.rpn_post_nms_top_n_test = d.rpn_post_nms_top_n_test;
  o.rpn_score_thresh = d.rpn_score_thresh;
  auto m = create_rcnn(arch, o);
  io::load_state_dict(*m, r.st, "sd.", "torchvision's state dict");
  return m;
}

ImageBatch batch(const Refs& r, const char* key = "sizes") {
  ImageBatch b;
  b.tensors = r.get("images");
  auto s = r.get(key);
  for (int64_t i = 0; i < s.size(0); ++i) b.sizes.push_back({s[i][0].item<int64_t>(), s[i][1].item<int64_t>()});
  return b;
}

// The references' two training targets (t0_*, t1_*).
std::vector<Target> targets_of(const Refs& r) {
  std::vector<Target> targets;
  for (int j = 0; j < 2; ++j) {
    const std::string p = fmt::format("t{}_", j);
    targets.push_back({r.get(p + "boxes"), r.get(p + "labels"), r.get(p + "masks")});
  }
  return targets;
}

void check_close(const at::Tensor& got, const at::Tensor& want, double atol, const std::string& what) {
  INFO(what << ": got " << got.sizes() << " want " << want.sizes());
  REQUIRE(got.sizes() == want.sizes());
  if (got.numel() == 0) return;
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  INFO(what << ": max abs difference " << diff);
  CHECK(diff <= atol);
}

void eval_parity(const std::string& arch) {
  const auto r = load(arch);
  auto m = model_for(arch, r);
  m->eval();
  torch::NoGradGuard ng;
  const auto b = batch(r);
  auto res = m->forward(b);
  REQUIRE(res.detections.size() == 2);
  const auto orig = batch(r, "orig_sizes").sizes;
  for (size_t j = 0; j < 2; ++j) {
    auto& d = res.detections[j];
    const std::string p = fmt::format("det{}_", j);
    CHECK(d.boxes.size(0) > 10);  // random weights still leave detections to compare
    check_close(d.boxes, r.get(p + "boxes"), 1e-3, p + "boxes");
    check_close(d.scores, r.get(p + "scores"), 1e-5, p + "scores");
    CHECK(torch::equal(d.labels, r.get(p + "labels")));
    if (m->has_mask()) check_close(d.masks, r.get(p + "masks"), 1e-4, p + "masks");
    postprocess(d, b.sizes[j], orig[j]);
    check_close(d.boxes, r.get(fmt::format("post{}_boxes", j)), 1e-3, "postprocessed boxes");
    if (m->has_mask()) {
      const auto want = r.get(fmt::format("post{}_masks", j));
      check_close(d.masks, want, 1e-4, "pasted masks");
    }
  }
}

void train_parity(const std::string& arch) {
  const auto r = load(arch);
  auto m = model_for(arch, r);
  m->train();
  const auto b = batch(r);
  const auto targets = targets_of(r);
  auto res = m->forward(b, &targets);
  std::vector<std::string> names;
  at::Tensor total;
  for (auto& [k, v] : res.losses) {
    names.push_back(k);
    const auto want = r.get("loss_" + k.substr(5));
    INFO(k << " " << v.item<double>() << " vs torchvision " << want.item<double>());
    CHECK(std::abs(v.item<double>() - want.item<double>()) <= 1e-5 * std::max(1.0, std::abs(want.item<double>())));
    total = total.defined() ? total + v : v;
  }
  std::vector<std::string> expected = {"loss_classifier", "loss_box_reg"};
  if (m->has_mask()) expected.push_back("loss_mask");
  expected.push_back("loss_objectness");
  expected.push_back("loss_rpn_box_reg");
  CHECK(names == expected);
  total.backward();
  auto params = m->named_parameters();
  int grads = 0;
  for (auto& item : r.st.tensors) {
    const std::string& k = item.first;
    if (k.rfind("grad.", 0) != 0) continue;
    const auto name = k.substr(5);
    const auto* p = params.find(name);
    REQUIRE(p);
    REQUIRE(p->grad().defined());
    const auto want = item.second;
    const double scale = want.abs().max().item<double>();
    check_close(p->grad(), want, 1e-4 * scale + 1e-7, "gradient of " + name);
    ++grads;
  }
  CHECK(grads >= 4);
}

// Fine-tuning (a body started from weights: FrozenBatchNorm2d folded into its convolutions by the
// training fusion, layers 2-4 trained) in channels-last memory, where the zoo's dense 3x3 path
// (ops::dense_conv_train: Winograd at stride 1, the weight gradient as GEMMs) runs the body's, the
// FPN's and the heads' 3x3 convolutions: the losses and every gradient as close to the float64
// step's as the same float32 step with ATen's convolutions (the path off). Float32 rounding grows
// through these random networks: channels-last memory alone (oneDNN's other sums) moved gradients
// by up to 2% from float64 where NCHW moved them by 0.2% (and with BatchNorm trained on two images
// by up to 26%, while float64 channels-last equalled float64 NCHW to 1e-12), so the reference for
// the float32 error is the same layout's.
void train_channels_last(const std::string& arch) {
  const auto r = load(arch);
  auto step = [&](at::ScalarType dtype, bool channels_last, std::set<std::string>* ops) {
    auto m = model_for(arch, r, 0, RCNNOptions::MaskConvention::kTorchvision, /*from_weights=*/true);
    set_training_fusion(*m, true);
    m->to(dtype);
    m->train();
    auto b = batch(r);
    b.tensors = b.tensors.to(dtype);
    if (channels_last) {
      engine::to_channels_last(*m);
      b.tensors = b.tensors.contiguous(at::MemoryFormat::ChannelsLast);
    }
    auto targets = targets_of(r);
    for (auto& t : targets) t.boxes = t.boxes.to(dtype);
    RCNNResult res;
    auto forward_ops = test::ops_called([&] { res = m->forward(b, &targets); });
    std::map<std::string, at::Tensor> out;
    at::Tensor total;
    for (auto& [k, v] : res.losses) {
      out[k] = v.detach().to(at::kDouble);
      total = total.defined() ? total + v : v;
    }
    auto backward_ops = test::ops_called([&] { total.backward(); });
    if (ops) {
      *ops = std::move(forward_ops);
      ops->insert(backward_ops.begin(), backward_ops.end());
    }
    for (auto& p : m->named_parameters())
      if (p.value().grad().defined()) out["grad " + p.key()] = p.value().grad().to(at::kDouble);
    return out;
  };
  std::set<std::string> ops, plain_ops;
  const auto ref = step(at::kDouble, false, nullptr), cl = step(at::kFloat, true, &ops);
  const auto plain = [&] {
    struct PathOff {  // on again however the step ends, for the tests after this one
      PathOff() { ops::set_dense_conv_enabled(false); }
      ~PathOff() { ops::set_dense_conv_enabled(true); }
    } off;
    return step(at::kFloat, true, &plain_ops);
  }();
  CHECK(test::any_contains(ops, "DenseConvFunction"));
  CHECK(ops.count("imgtrain::winograd_conv3x3"));
  CHECK_FALSE(test::any_contains(plain_ops, "DenseConvFunction"));
  std::map<std::string, int> dense_layers;  // trained 3x3 convolutions the check covers, by part
  for (const auto& [name, want] : ref) {
    INFO(name);
    REQUIRE(cl.count(name));
    REQUIRE(plain.count(name));
    const double scale = want.abs().max().item<double>() + 1e-12;
    const double e_dense = (cl.at(name) - want).abs().max().item<double>() / scale,
                 e_plain = (plain.at(name) - want).abs().max().item<double>() / scale;
    INFO("relative error against float64: dense path " << e_dense << ", ATen's convolutions " << e_plain);
    // Winograd's forward rounds up to ~4x a direct convolution's (the op's test), compounded over
    // the FPN, RPN and box head here: measured at most 5.1x (the box head's fc6), 3.8x elsewhere
    CHECK(e_dense <= 8 * e_plain + 1e-5);
    if (name.starts_with("grad ") && want.dim() == 4 && want.size(2) == 3)
      for (const char* part : {"backbone.body.", "backbone.fpn.", "rpn.head.", "roi_heads.mask_head."})
        dense_layers[part] += name.find(part) == 5;
  }
  CHECK(dense_layers["backbone.body."] >= 4);  // layers 2-4
  CHECK(dense_layers["backbone.fpn."] >= 4);
  CHECK(dense_layers["rpn.head."] >= 1);
  if (r.has("loss_mask")) CHECK(dense_layers["roi_heads.mask_head."] >= 4);
  CHECK_FALSE(cl.count("grad backbone.body.layer1.0.conv1.weight"));  // frozen: no gradient
}

// The second image without objects: torchvision gives its RoIs all to the background.
void train_parity_empty(const std::string& arch) {
  const auto r = load(arch);
  auto m = model_for(arch, r);
  m->train();
  const auto b = batch(r);
  const auto m1 = r.get("t1_masks");
  std::vector<Target> targets = {{r.get("t0_boxes"), r.get("t0_labels"), r.get("t0_masks")},
                                 {torch::zeros({0, 4}), torch::zeros({0}, torch::kLong),
                                  torch::zeros({0, m1.size(1), m1.size(2)}, torch::kByte)}};
  auto res = m->forward(b, &targets);
  int n = 0;
  at::Tensor total;
  for (auto& [k, v] : res.losses) {
    const auto want = r.get("empty_loss_" + k.substr(5));
    INFO(k << " " << v.item<double>() << " vs torchvision " << want.item<double>());
    CHECK(std::isfinite(v.item<double>()));
    CHECK(std::abs(v.item<double>() - want.item<double>()) <= 1e-5 * std::max(1.0, std::abs(want.item<double>())));
    total = total.defined() ? total + v : v;
    ++n;
  }
  CHECK(n == (m->has_mask() ? 5 : 4));
  total.backward();  // and the backward runs
}

}  // namespace

TEST_CASE("Mask R-CNN with --mask-rois-per-image caps the mask head's RoIs and changes nothing else", "[parity][rcnn]") {
  const auto r = load("maskrcnn_resnet18_fpn");
  const auto b = batch(r);
  const auto targets = targets_of(r);
  auto losses = [&](int64_t cap) {
    auto m = model_for("maskrcnn_resnet18_fpn", r, cap);
    m->train();
    std::map<std::string, double> out;
    for (auto& [k, v] : m->forward(b, &targets).losses) out[k] = v.item<double>();
    return out;
  };
  const auto all = losses(0), above = losses(100000), one = losses(1);
  // a cap above the positives' count is no cap: torchvision's numbers (train_parity holds cap 0 to them)
  CHECK(all == above);
  REQUIRE(one.size() == all.size());
  for (auto& [k, v] : all) {
    INFO(k << ": " << one.at(k) << " capped, " << v << " not");
    CHECK(std::isfinite(one.at(k)));
    if (k == "loss_mask") CHECK(one.at(k) != v);  // the mean over one RoI per image
    else CHECK(one.at(k) == v);                   // the samplers and every other loss are untouched
  }
}

TEST_CASE("Mask R-CNN's Detectron2 mask conventions: aligned targets and the grid_sample paste", "[parity][rcnn]") {
  using C = RCNNOptions::MaskConvention;
  const auto r = load("maskrcnn_resnet18_fpn");
  const auto b = batch(r);
  const auto targets = targets_of(r);
  // Training: only the mask loss changes, to the one with Detectron2's targets (binarised) or
  // with them kept as fractions.
  std::map<std::string, std::map<std::string, double>> losses;
  for (auto c : {C::kTorchvision, C::kDetectron2, C::kAligned}) {
    auto m = model_for("maskrcnn_resnet18_fpn", r, 0, c);
    m->train();
    for (auto& [k, v] : m->forward(b, &targets).losses) losses[mask_convention_name(c)][k] = v.item<double>();
  }
  for (const std::string name : {"detectron2", "aligned"}) {
    const double want = r.get("loss_mask_" + name).item<double>();
    INFO(name << ": loss_mask " << losses[name]["loss_mask"] << " vs the reference's " << want);
    CHECK(std::abs(losses[name]["loss_mask"] - want) <= 1e-5 * std::max(1.0, std::abs(want)));
    CHECK(losses[name]["loss_mask"] != losses["torchvision"]["loss_mask"]);
    for (auto& [k, v] : losses["torchvision"])
      if (k != "loss_mask") CHECK(losses[name][k] == v);
  }
  // Evaluation: torchvision's detections (mask probabilities, boxes in the original size) pasted
  // as Detectron2 pastes them.
  const auto orig = batch(r, "orig_sizes").sizes;
  int pasted = 0;
  for (int j = 0; j < 2; ++j) {
    const auto want = r.get(fmt::format("post{}_masks_grid", j));
    Detections d;
    d.boxes = r.get(fmt::format("post{}_boxes", j));
    d.masks = r.get(fmt::format("det{}_masks", j));
    REQUIRE(d.boxes.size(0) > 10);
    auto soft = d;
    postprocess(soft, orig[size_t(j)], orig[size_t(j)], 0.0, C::kDetectron2);  // same size: boxes as they are
    check_close(soft.masks, want, 1e-6, "pasted masks");
    CHECK(soft.masks.gt(0.5).any().item<bool>());
    auto binary = d;
    postprocess(binary, orig[size_t(j)], orig[size_t(j)], 0.5, C::kAligned);
    REQUIRE(binary.masks.scalar_type() == at::kByte);
    CHECK(torch::equal(binary.masks, want.ge(0.5).to(at::kByte)));  // prob >= 0.5, as Detectron2
    pasted += int(d.boxes.size(0));
  }
  CHECK(pasted > 20);
  // a box of no width or height pastes nothing (no pixel centre maps into it)
  Detections e;
  e.boxes = torch::tensor({{10.f, 10.f, 10.f, 30.f}, {5.f, 8.f, 25.f, 8.f}});
  e.masks = torch::ones({2, 1, 28, 28});
  postprocess(e, {40, 40}, {40, 40}, 0.5, C::kDetectron2);
  CHECK(e.masks.sum().item<int64_t>() == 0);
}

TEST_CASE("Mask R-CNN R18-FPN evaluation equals torchvision's", "[parity][rcnn]") { eval_parity("maskrcnn_resnet18_fpn"); }
TEST_CASE("Faster R-CNN R18-FPN evaluation equals torchvision's", "[parity][rcnn]") {
  eval_parity("fasterrcnn_resnet18_fpn");
}
TEST_CASE("Mask R-CNN R50-FPN v2 evaluation equals torchvision's", "[parity][rcnn]") {
  eval_parity("maskrcnn_resnet50_fpn_v2");
}
TEST_CASE("Mask R-CNN R18-FPN training losses and gradients equal torchvision's", "[parity][rcnn]") {
  train_parity("maskrcnn_resnet18_fpn");
}
TEST_CASE("R-CNN training with an image without objects gives torchvision's losses", "[parity][rcnn]") {
  train_parity_empty("maskrcnn_resnet18_fpn");
  train_parity_empty("fasterrcnn_resnet18_fpn");
}
TEST_CASE("a detector built without weights initialises its ResNet body as torchvision's", "[parity][rcnn]") {
  // torchvision's resnet (zero_init_residual=False): BatchNorm weights 1, biases 0, convolutions
  // kaiming-normal over fan-out (timm's classifiers zero the last BatchNorm weight of each block)
  for (const char* arch : {"maskrcnn_resnet18_fpn", "fasterrcnn_resnet50_fpn"}) {
    RCNNOptions o;
    o.num_classes = 3;
    auto m = create_rcnn(arch, o);
    int bns = 0;
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("backbone.body.", 0) != 0 || p.value().dim() != 1) continue;
      const bool weight = p.key().size() > 7 && p.key().ends_with(".weight");
      INFO(arch << " " << p.key());
      CHECK(torch::equal(p.value(), weight ? torch::ones_like(p.value()) : torch::zeros_like(p.value())));
      bns += weight;
    }
    CHECK(bns > 10);
    // the first convolution's spread: kaiming normal, fan-out 64 * 7 * 7, gain sqrt(2)
    const auto w = m->named_parameters()["backbone.body.conv1.weight"];
    CHECK(std::abs(w.std().item<double>() - std::sqrt(2.0 / (64 * 49))) < 0.1 * std::sqrt(2.0 / (64 * 49)));
  }
}
TEST_CASE("Faster R-CNN R18-FPN training losses and gradients equal torchvision's", "[parity][rcnn]") {
  train_parity("fasterrcnn_resnet18_fpn");
}
TEST_CASE("R-CNN fine-tuning in channels-last memory takes the dense 3x3 path and its losses and gradients stay as close to float64", "[parity][rcnn]") {
  train_channels_last("fasterrcnn_resnet18_fpn");
  train_channels_last("maskrcnn_resnet18_fpn");
}
TEST_CASE("Mask R-CNN R50-FPN v2 training losses and gradients equal torchvision's", "[parity][rcnn]") {
  train_parity("maskrcnn_resnet50_fpn_v2");
}
TEST_CASE("Mask R-CNN R18-FPN with other widths and RoI level mapper equals torchvision's in evaluation and training", "[parity][rcnn]") {
  eval_parity("maskrcnn_resnet18_fpn_narrow");
  train_parity("maskrcnn_resnet18_fpn_narrow");
}
TEST_CASE("Faster R-CNN MobileNetV3-Large FPN evaluation equals torchvision's", "[parity][rcnn]") {
  eval_parity("fasterrcnn_mobilenet_v3_large_fpn");
}
TEST_CASE("Faster R-CNN MobileNetV3-Large 320 FPN evaluation equals torchvision's", "[parity][rcnn]") {
  eval_parity("fasterrcnn_mobilenet_v3_large_320_fpn");
}
TEST_CASE("Faster R-CNN MobileNetV3-Large FPN training losses and gradients equal torchvision's", "[parity][rcnn]") {
  train_parity("fasterrcnn_mobilenet_v3_large_fpn");
}
TEST_CASE("MobileNetV3 detectors have torchvision's state dict and builder defaults", "[rcnn]") {
  RCNNOptions o;
  auto m = create_rcnn("fasterrcnn_mobilenet_v3_large_fpn", o);
  int64_t n = 0;
  for (auto& p : m->parameters()) n += p.numel();
  CHECK(n == 19410754);  // torchvision, weights=None, weights_backbone=None, 91 classes
  CHECK(io::state_dict(*m).size() == 330);
  auto sd = m->named_parameters();
  CHECK(sd.find("backbone.body.13.block.2.fc2.bias") != nullptr);
  CHECK(sd["rpn.head.cls_logits.weight"].sizes() == at::IntArrayRef({15, 256, 1, 1}));
  CHECK(sd["backbone.fpn.inner_blocks.1.0.weight"].sizes() == at::IntArrayRef({256, 960, 1, 1}));
  const auto d = rcnn_defaults("fasterrcnn_mobilenet_v3_large_320_fpn");
  CHECK(d.min_size == 320);
  CHECK(d.max_size == 640);
  CHECK(d.rpn_post_nms_top_n_test == 150);
  CHECK(rcnn_defaults("fasterrcnn_mobilenet_v3_large_fpn").rpn_score_thresh == 0.05);
  CHECK(rcnn_defaults("maskrcnn_resnet50_fpn").rpn_score_thresh == 0.0);
  // From weights: FrozenBatchNorm2d and the first seven features frozen (3 trainable layers)
  o.from_weights = true;
  auto f = create_rcnn("fasterrcnn_mobilenet_v3_large_fpn", o);
  auto fp = f->named_parameters();
  CHECK_FALSE(fp["backbone.body.6.block.0.0.weight"].requires_grad());
  CHECK(fp["backbone.body.7.block.0.0.weight"].requires_grad());
  o.trainable_backbone_layers = 7;
  CHECK_THROWS_WITH(create_rcnn("fasterrcnn_mobilenet_v3_large_fpn", o), Catch::Contains("expected 0 to 6"));
}

TEST_CASE("load_rcnn_weights takes torchvision's frozen-BN detector files and classifier bodies", "[rcnn]") {
  RCNNOptions o;
  o.num_classes = 5;
  o.from_weights = true;  // FrozenBatchNorm2d, as a torchvision detector fine-tuned from a backbone
  torch::manual_seed(1);
  auto src = create_rcnn("fasterrcnn_resnet18_fpn", o);
  torch::manual_seed(2);
  auto dst = create_rcnn("fasterrcnn_resnet18_fpn", o);
  // torchvision's FrozenBatchNorm2d has no num_batches_tracked: its files lack the counters
  io::SafeTensors file;
  int64_t counters = 0;
  for (auto& [k, v] : io::state_dict(*src)) {
    if (k.find("num_batches_tracked") != std::string::npos) {
      ++counters;
      continue;
    }
    file.tensors.emplace_back("model." + k, v.clone());
  }
  CHECK(counters > 0);
  const auto line = load_rcnn_weights(*dst, file, "model.", "test file", "f.safetensors");
  CHECK_THAT(line, Catch::Contains("Loaded detector weights from f.safetensors"));
  for (auto& [k, v] : io::state_dict(*dst)) {
    const at::Tensor* t = file.find("model." + k);
    if (!t) continue;
    INFO(k);
    CHECK(torch::equal(v, *t));
  }
  // a missing weight (not a counter) is refused by name
  io::SafeTensors broken;
  for (auto& [k, v] : file.tensors)
    if (k != "model.rpn.head.conv.0.0.weight" && k != "model.rpn.head.conv.weight") broken.tensors.emplace_back(k, v);
  CHECK_THROWS_WITH(load_rcnn_weights(*dst, broken, "model.", "test file", "f"), Catch::Contains("rpn.head.conv"));
  // a classifier's state dict (with a head and counters) goes into the body only
  io::SafeTensors cls;
  auto body = dst->named_parameters().find("backbone.body.layer1.0.conv1.weight");
  REQUIRE(body != nullptr);
  const auto fpn_before = dst->named_parameters()["backbone.fpn.inner_blocks.0.0.weight"].clone();
  for (auto& [k, v] : io::state_dict(*src))
    if (k.rfind("backbone.body.", 0) == 0) cls.tensors.emplace_back(k.substr(14), (v * 2).to(v.scalar_type()));
  cls.tensors.emplace_back("fc.weight", torch::zeros({1000, 512}));
  CHECK_THAT(load_rcnn_weights(*dst, cls, "", "cls", "c"), Catch::Contains("Loaded backbone weights from c"));
  CHECK(torch::equal(dst->named_parameters()["backbone.body.layer1.0.conv1.weight"],
                     src->named_parameters()["backbone.body.layer1.0.conv1.weight"] * 2));
  CHECK(torch::equal(dst->named_parameters()["backbone.fpn.inner_blocks.0.0.weight"], fpn_before));
}

