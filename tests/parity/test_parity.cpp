// Compares imgtrain with timm / torch on references written by make_refs.py (same inputs).
#include "data/loader.h"
#include "core/batch_norm.h"
#include "data/mixup.h"
#include "engine/checkpoint.h"
#include "engine/ema.h"
#include "engine/train_loop.h"
#include "tasks/classification/loss.h"
#include "io/weights.h"
#include "io/safetensors.h"
#include "model_zoo/registry.h"
#include "optim/optim.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <set>

using namespace imgtrain;

namespace {
io::SafeTensors load_ref(const std::string& name) {
  torch::set_num_threads(1);  // as make_refs.py: the same reduction order as the reference
  return io::load_safetensors(std::string(IMGTRAIN_PARITY_DIR) + "/" + name);
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  double n = b.norm().item<double>();
  return (a - b).norm().item<double>() / std::max(n, 1e-12);
}

const std::vector<std::string> kResNets = {"resnet18",        "resnet34",  "resnet50", "resnet101", "resnet152",
                                           "resnext50_32x4d", "resnet50d", "resnet26d"};
const std::vector<std::string> kVits = {"vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
                                        "vit_base_patch32_224"};
const std::vector<std::string> kEffNets = {
    "mobilenetv3_large_100", "mobilenetv3_small_100", "mobilenetv3_large_075", "mobilenetv2_100",
    "efficientnet_b0",       "efficientnet_b1",       "efficientnet_b2",       "efficientnet_b3",
    "efficientnet_b4",       "tf_efficientnet_b0",    "tf_efficientnet_b1",    "tf_efficientnet_b2",
    "tf_efficientnet_b3",    "tf_efficientnet_b4"};
const std::vector<std::string> kConvNeXts = {"convnext_tiny", "convnext_small"};
std::vector<std::string> all_models() {
  auto v = kResNets;
  for (auto* f : {&kVits, &kEffNets, &kConvNeXts}) v.insert(v.end(), f->begin(), f->end());
  return v;
}
// The references of ViTs are made at 32 px (make_refs.py).
int64_t ref_img_size(const std::string& name) { return name.rfind("vit_", 0) == 0 ? 32 : 0; }

model_zoo::Model loaded(const std::string& name, const io::SafeTensors& st) {
  ModelArgs a;
  a.num_classes = 10;
  a.img_size = ref_img_size(name);
  auto m = model_zoo::create_model(name, a);
  io::load_state_dict(*m, st, "model.", name);
  return m;
}
}  // namespace

TEST_CASE("state dict names, shapes and parameter counts equal timm's", "[parity][models]") {
  for (const std::string& name : all_models()) {
    auto st = load_ref(name + ".safetensors");
    auto keys = nlohmann::json::parse(st.metadata.at("keys"));
    std::map<std::string, std::vector<int64_t>> want, have;
    for (auto& kv : keys) want[kv[0].get<std::string>()] = kv[1].get<std::vector<int64_t>>();
    ModelArgs a;
    a.num_classes = 10;
    a.img_size = ref_img_size(name);
    auto m = model_zoo::create_model(name, a);
    for (auto& [k, v] : io::state_dict(*m)) have[k] = v.sizes().vec();
    CHECK(have == want);
    CHECK(model_zoo::count_params(*m) == std::stoll(st.metadata.at("param_count")));
  }
}

TEST_CASE("eval-mode outputs equal timm's for the same weights", "[parity][models]") {
  for (const std::string& name : all_models()) {
    auto st = load_ref(name + ".safetensors");
    auto m = loaded(name, st);
    m->eval();
    torch::NoGradGuard ng;
    INFO(name);
    // and with imgtrain's inference fusion (validate's default: BatchNorm folded, fused linear
    // layers, ViT's attention kernel)
    // within float rounding of the outputs' scale (a folded BatchNorm rounds its weights once more)
    const auto& ref = *st.find("ref.eval_out");
    for (bool fused : {false, true}) {
      INFO("inference fusion " << fused);
      set_inference_fusion(*m, fused);
      const double tol = fused ? 1e-4 * std::max(1.0, ref.abs().max().item<double>()) : 1e-4;
      CHECK(max_abs_diff(m->forward(*st.find("ref.input")), ref) < tol);
    }
  }
}

TEST_CASE("global pool types (--gp) give timm's head shapes, names and outputs", "[parity][models]") {
  for (auto [name, gp] : std::vector<std::pair<std::string, std::string>>{{"resnet18", "catavgmax"},
                                                                         {"mobilenetv3_small_100", "avgmax"},
                                                                         {"efficientnet_b0", "max"},
                                                                         {"convnext_tiny", "max"},
                                                                         {"vit_tiny_patch16_224", "avg"}}) {
    INFO(name << " " << gp);
    auto st = load_ref(name + "-" + gp + ".safetensors");
    ModelArgs a;
    a.num_classes = 10;
    a.img_size = ref_img_size(name);
    a.global_pool = gp;
    auto m = model_zoo::create_model(name, a);
    std::map<std::string, std::vector<int64_t>> want, have;
    for (auto& kv : nlohmann::json::parse(st.metadata.at("keys"))) want[kv[0].get<std::string>()] = kv[1].get<std::vector<int64_t>>();
    for (auto& [k, v] : io::state_dict(*m)) have[k] = v.sizes().vec();
    CHECK(have == want);
    io::load_state_dict(*m, st, "model.", name);
    m->eval();
    torch::NoGradGuard ng;
    CHECK(max_abs_diff(m->forward(*st.find("ref.input")), *st.find("ref.eval_out")) < 1e-4);
  }
  ModelArgs bad;
  bad.global_pool = "catavgmax";
  CHECK_THROWS_WITH(model_zoo::create_model("convnext_tiny", bad),
                    Catch::Contains("--gp 'catavgmax': convnext_tiny supports avg, max, avgmax"));
}

TEST_CASE("features API: levels, channels, strides and maps equal timm's", "[parity][models]") {
  for (const std::string& name : all_models()) {
    INFO(name);
    auto st = load_ref(name + ".safetensors");
    auto m = loaded(name, st);
    m->eval();
    auto info = nlohmann::json::parse(st.metadata.at("feature_info"));
    auto fi = m->feature_info();
    REQUIRE(fi.size() == info.size());
    std::vector<int64_t> all;
    for (size_t i = 0; i < fi.size(); ++i) {
      CHECK(fi[i].num_chs == info[i][0].get<int64_t>());
      CHECK(fi[i].reduction == info[i][1].get<int64_t>());
      CHECK(fi[i].module == info[i][2].get<std::string>());
      all.push_back(int64_t(i));
    }
    CHECK(m->default_out_indices() == nlohmann::json::parse(st.metadata.at("out_indices")).get<std::vector<int64_t>>());
    torch::NoGradGuard ng;
    auto feats = m->forward_intermediates(*st.find("ref.input"), all);
    REQUIRE(feats.size() == fi.size());
    for (size_t i = 0; i < feats.size(); ++i) {
      INFO("level " << i);
      auto want = *st.find("feat." + std::to_string(i));
      REQUIRE(feats[i].sizes() == want.sizes());
      CHECK(max_abs_diff(feats[i], want) < 1e-4);
    }
    // a subset: only the levels asked for, in order
    auto two = m->forward_intermediates(*st.find("ref.input"), {1, int64_t(fi.size()) - 1});
    REQUIRE(two.size() == 2);
    CHECK(max_abs_diff(two[1], *st.find("feat." + std::to_string(fi.size() - 1))) < 1e-4);
  }
}

TEST_CASE("train-mode loss, gradients and BN statistics equal timm's", "[parity][models]") {
  for (std::string name : {"resnet18", "resnet26d", "vit_tiny_patch16_224", "mobilenetv3_large_100", "efficientnet_b0",
                           "tf_efficientnet_b0", "convnext_tiny"}) {
  INFO(name);
  auto st = load_ref(name + ".safetensors");
  auto m = loaded(name, st);
  m->train();
  auto out = m->forward(*st.find("ref.train_input"));
  auto loss = torch::nn::functional::cross_entropy(
      out, *st.find("ref.train_target"), torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(0.1));
  loss.backward();
  CHECK(std::abs(loss.item<double>() - st.find("ref.train_loss")->item<double>()) < 1e-5);
  // Relative to each gradient, but not below 1e-3 of the largest: some gradients are zero in exact
  // arithmetic and float rounding in both programs (the bias of a BatchNorm whose every path runs
  // through linear convolutions into another training-mode BatchNorm, which removes any constant
  // shift: ~1e-6 against gradients of ~10 in EfficientNet), and their rounding differs wherever
  // imgtrain's ops differ from ATen's (the depthwise gradients, ops/depthwise.h).
  double largest = 0;
  for (auto& p : m->named_parameters()) largest = std::max(largest, st.find("grad." + p.key())->norm().item<double>());
  for (auto& p : m->named_parameters()) {
    INFO(p.key());
    const auto& want = *st.find("grad." + p.key());
    CHECK((p.value().grad() - want).norm().item<double>() < 1e-3 * std::max(want.norm().item<double>(), 1e-3 * largest));
  }
  for (auto& b : m->named_buffers()) {
    INFO(b.key());
    CHECK(max_abs_diff(b.value().to(torch::kDouble), st.find("after." + b.key())->to(torch::kDouble)) < 1e-5);
  }
  }
}

TEST_CASE("initialisation statistics agree with timm's within sampling error", "[parity][models]") {
  for (std::string name : {"resnet18", "resnet50", "resnext50_32x4d", "resnet26d", "vit_tiny_patch16_224",
                           "vit_base_patch16_224", "mobilenetv3_large_100", "mobilenetv2_100", "efficientnet_b0",
                           "tf_efficientnet_b2", "convnext_tiny"}) {
    auto st = load_ref(name + ".safetensors");
    auto stats = nlohmann::json::parse(st.metadata.at("init_stats"));
    torch::manual_seed(123);
    ModelArgs fresh;
    fresh.img_size = ref_img_size(name);
    auto m = model_zoo::create_model(name, fresh);
    size_t checked = 0;
    for (auto& [k, v] : io::state_dict(*m)) {
      if (!v.is_floating_point()) continue;
      REQUIRE(stats.contains(k));
      const double rmean = stats[k][0].get<double>();
      const double rstd = stats[k][1].get<double>();
      const double n = stats[k][2].get<double>();
      // as make_refs.py's robust_stats: without values more than 6 std from the mean
      auto x = v.to(torch::kDouble).flatten();
      if (x.numel() > 1) x = x.masked_select((x - x.mean()).abs() <= 6 * x.std());
      double mean = x.mean().item<double>(), sd = x.numel() > 1 ? x.std().item<double>() : 0.0;
      INFO(name << " " << k << " mean " << mean << " vs " << rmean << ", std " << sd << " vs " << rstd);
      if (rstd == 0) {
        CHECK(mean == Approx(rmean).margin(1e-12));
        CHECK(sd == Approx(0).margin(1e-12));
      } else {
        CHECK(std::abs(mean - rmean) < 6 * std::max(rstd, sd) / std::sqrt(n) + 1e-7);
        // the standard error of a sample std is about std / sqrt(2n); six of them, as for the mean
        if (n >= 100) CHECK(std::abs(sd - rstd) < 6 * rstd / std::sqrt(2 * n));
      }
      ++checked;
    }
    CHECK(checked == stats.size());
  }
}

TEST_CASE("optimizers step exactly like torch.optim", "[parity][optim]") {
  auto st = load_ref("optim.safetensors");
  for (std::string name : {"sgd", "momentum", "adamw"}) {
    optim::OptimizerArgs a;
    a.opt = name;
    a.lr = name == "adamw" ? 1e-2 : 0.1;
    a.weight_decay = name == "adamw" ? 5e-2 : 1e-2;
    a.momentum = 0.9;
    auto p = st.find("p0")->clone().requires_grad_(true);
    auto opt = optim::create_optimizer(a, {{"w", p}});
    for (int i = 0; i < 3; ++i) {
      p.mutable_grad() = st.find(fmt::format("g{}", i))->clone();
      opt->step();
      INFO(name << " step " << i);
      CHECK(max_abs_diff(p.detach(), *st.find(name + ".step" + std::to_string(i))) < 1e-6);
    }
  }
}

TEST_CASE("schedules give timm's learning rates", "[parity][sched]") {
  auto st = load_ref("misc.safetensors");
  optim::SchedulerArgs c;
  c.sched = "cosine";
  c.base_lr = 0.1;
  c.epochs = 10;
  c.warmup_epochs = 2;
  c.warmup_lr = 1e-4;
  c.min_lr = 1e-5;
  optim::SchedulerArgs s = c;
  s.sched = "step";
  s.min_lr = 0;
  s.decay_epochs = 3;
  s.decay_rate = 0.5;
  s.warmup_epochs = 1;
  for (auto [args, key] : {std::pair{c, "cosine"}, std::pair{s, "step"}}) {
    optim::Scheduler sch(args);
    auto want = *st.find(key);
    for (int64_t t = 0; t < want.size(0); ++t) {
      INFO(key << " epoch " << t);
      CHECK(sch.lr_at(t) == Approx(want[t].item<double>()).epsilon(1e-12));
    }
  }
}

TEST_CASE("training order is torch's randperm seeded with seed + epoch", "[parity][data]") {
  auto st = load_ref("misc.safetensors");
  struct Tiny : data::Dataset {
    size_t size() const override { return 10; }
    int64_t label(size_t) const override { return 0; }
    cv::Mat image(size_t) const override { return cv::Mat(4, 4, CV_8UC3, cv::Scalar::all(1)); }
    std::string describe(size_t i) const override { return std::to_string(i); }
    int64_t num_classes() const override { return 1; }
    std::vector<std::string> class_names() const override { return {"x"}; }
  };
  data::TransformConfig tc;
  tc.size = 4;
  data::LoaderOptions o;
  o.batch_size = 5;
  o.shuffle = true;
  o.seed = 42;
  o.workers = 0;
  data::Loader l(std::make_shared<Tiny>(), tc, o);
  l.start_epoch(3);
  auto want = *st.find("randperm");
  std::vector<int64_t> w(want.data_ptr<int64_t>(), want.data_ptr<int64_t>() + want.numel());
  CHECK(l.order() == w);
  auto vec = [](const at::Tensor& t) { return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()); };
  std::vector<int64_t> identity(10);
  for (int64_t i = 0; i < 10; ++i) identity[size_t(i)] = i;
  for (int64_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    // torch's DistributedSampler(shuffle, seed 42, epoch 3) and timm's OrderedDistributedSampler
    CHECK(data::rank_share(w, r, 4) == vec(*st.find("dsampler." + std::to_string(r))));
    CHECK(data::rank_share(identity, r, 4) == vec(*st.find("osampler." + std::to_string(r))));
    data::LoaderOptions ro = o;
    ro.rank = r;
    ro.world = 4;
    data::Loader lr(std::make_shared<Tiny>(), tc, ro);
    lr.start_epoch(3);
    CHECK(lr.order() == vec(*st.find("dsampler." + std::to_string(r))));
    CHECK(lr.num_batches() == 1);  // 3 samples per rank, batch 5
  }
}

TEST_CASE("sampler assignments for several dataset and world sizes, with padding and repeats, as torch and timm", "[parity]") {
  auto st = load_ref("misc.safetensors");
  auto vec = [](const at::Tensor& t) { return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()); };
  for (int64_t n : {1, 7, 10, 300, 515})
    for (int64_t w : {2, 3, 4, 8}) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + 5);
      auto perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
      std::vector<int64_t> shuffled = vec(perm), identity(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) identity[size_t(i)] = i;
      for (int64_t r = 0; r < w; ++r) {
        INFO("n " << n << " world " << w << " rank " << r);
        const std::string key = fmt::format("{}.{}.{}", n, w, r);
        CHECK(data::rank_share(shuffled, r, w) == vec(*st.find("dsampler." + key)));
        CHECK(data::rank_share(identity, r, w) == vec(*st.find("osampler." + key)));  // evaluation, padded
        for (double reps : {3.0, 2.5}) {
          INFO("repeats " << reps);
          auto keys = data::repeat_aug_share(n, 5, true, reps, r, w);
          std::vector<int64_t> idx;
          for (auto k : keys) idx.push_back(k % n);  // keys carry the copy number above n
          const auto* want = st.find(fmt::format("rsampler.{}.{}", key, reps == 3.0 ? "3" : "2.5"));
          REQUIRE(want != nullptr);
          CHECK(idx == vec(*want));
          CHECK(keys.size() == data::repeat_aug_samples(n, reps, w));
        }
      }
    }
  // Copies of one sample carry distinct keys (so distinct augmentation draws).
  auto keys = data::repeat_aug_share(10, 0, true, 3, 0, 1);
  std::set<int64_t> distinct(keys.begin(), keys.end());
  CHECK(distinct.size() == keys.size());
}

TEST_CASE("no-weight-decay group and smoothed cross entropy match timm", "[parity][optim]") {
  auto st = load_ref("misc.safetensors");
  auto want = nlohmann::json::parse(st.metadata.at("no_decay")).get<std::vector<std::string>>();
  ModelArgs a;
  a.num_classes = 10;
  auto m = model_zoo::create_model("resnet18", a);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : m->named_parameters()) named.emplace_back(p.key(), p.value());
  auto groups = optim::weight_decay_groups(named, 1e-4);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].weight_decay == 0);
  auto got = groups[0].names;
  std::sort(got.begin(), got.end());
  CHECK(got == want);
  {  // ViT: timm's model.no_weight_decay() adds pos_embed and cls_token
    auto want_vit = nlohmann::json::parse(st.metadata.at("no_decay_vit")).get<std::vector<std::string>>();
    ModelArgs va;
    va.img_size = 32;
    auto vit = model_zoo::create_model("vit_tiny_patch16_224", va);
    std::vector<std::pair<std::string, at::Tensor>> vn;
    for (auto& p : vit->named_parameters()) vn.emplace_back(p.key(), p.value());
    auto vg = optim::weight_decay_groups(vn, 1e-4, vit->no_weight_decay());
    auto got_vit = vg[0].names;
    std::sort(got_vit.begin(), got_vit.end());
    CHECK(got_vit == want_vit);
  }

  auto loss = torch::nn::functional::cross_entropy(
      *st.find("ce.logits"), *st.find("ce.target"), torch::nn::functional::CrossEntropyFuncOptions().label_smoothing(0.1));
  CHECK(loss.item<double>() == Approx(st.find("ce.loss")->item<double>()).epsilon(1e-6));
}

TEST_CASE("files written by the safetensors library read back exactly", "[parity][io]") {
  auto st = load_ref("dtypes.safetensors");
  CHECK(st.metadata.at("hello") == "world");
  CHECK(torch::equal(*st.find("f32"), torch::arange(6, torch::kFloat32).view({2, 3})));
  CHECK(torch::equal(*st.find("f16"), torch::arange(4).to(torch::kHalf)));
  CHECK(torch::equal(*st.find("bf16"), torch::arange(4).to(torch::kBFloat16)));
  CHECK(torch::equal(*st.find("i64"), torch::arange(3, torch::kLong) - 1));
  CHECK(torch::equal(*st.find("u8"), torch::arange(5, torch::kUInt8)));
  CHECK(torch::equal(*st.find("b"), torch::tensor({true, false})));
}

TEST_CASE("first-conv channel adaptation equals timm's adapt_input_conv", "[parity][io]") {
  auto st = load_ref("misc.safetensors");
  for (int c : {1, 2, 4, 7}) {
    INFO("in_chans " << c);
    auto got = io::adapt_input_conv(c, *st.find("adapt.w3"));
    auto want = *st.find("adapt.c" + std::to_string(c));
    REQUIRE(got.sizes() == want.sizes());
    CHECK(max_abs_diff(got, want) < 1e-6);
  }
}

TEST_CASE("more schedules: multistep, poly, warmup prefix, cooldown", "[parity][sched]") {
  auto st = load_ref("misc.safetensors");
  optim::SchedulerArgs m;
  m.sched = "multistep";
  m.base_lr = 0.1;
  m.epochs = 300;
  m.decay_milestones = {2, 5};
  m.decay_rate = 0.5;
  m.warmup_epochs = 1;
  m.warmup_lr = 1e-4;
  optim::SchedulerArgs p;
  p.sched = "poly";
  p.base_lr = 0.1;
  p.epochs = 8;
  p.decay_rate = 2.0;
  p.warmup_epochs = 2;
  p.warmup_lr = 1e-4;
  p.warmup_prefix = true;
  p.min_lr = 1e-5;
  p.cooldown_epochs = 2;
  optim::SchedulerArgs c = p;
  c.sched = "cosine";
  c.epochs = 6;
  c.decay_rate = 0.1;
  c.cooldown_epochs = 3;
  int i = 0;
  for (auto& args : {m, p, c}) {
    optim::Scheduler sch(args);
    auto want = *st.find("more" + std::to_string(i));
    INFO(args.sched);
    CHECK(sch.num_epochs() == st.find("more" + std::to_string(i) + ".num_epochs")->item<int64_t>());
    for (int64_t t = 0; t < want.size(0); ++t) {
      INFO("epoch " << t);
      CHECK(sch.lr_at(t) == Approx(want[t].item<double>()).epsilon(1e-12));
    }
    ++i;
  }
}

TEST_CASE("optimizer factory matches timm's create_optimizer_v2", "[parity][optim]") {
  auto st = load_ref("optim_factory.safetensors");
  for (auto [name, lr] : {std::pair{"sgd", 0.1}, {"momentum", 0.1}, {"adam", 1e-2}, {"adamw", 1e-2}, {"rmsproptf", 1e-2},
                          {"lamb", 1e-2}, {"lambc", 1e-2}, {"lars", 0.1}, {"larc", 0.1}, {"nlars", 0.1}}) {
    auto w = st.find("w0")->clone().requires_grad_(true);
    auto b = st.find("b0")->clone().requires_grad_(true);
    optim::OptimizerArgs a;
    a.opt = name;
    a.lr = lr;
    a.weight_decay = 1e-2;
    a.momentum = 0.9;
    auto opt = optim::create_optimizer(a, {{"weight", w}, {"bias", b}});
    for (int i = 0; i < 3; ++i) {
      w.mutable_grad() = st.find("gw" + std::to_string(i))->clone();
      b.mutable_grad() = st.find("gb" + std::to_string(i))->clone();
      opt->step();
      INFO(name << " step " << i);
      auto ww = *st.find(std::string(name) + ".w" + std::to_string(i));
      auto wb = *st.find(std::string(name) + ".b" + std::to_string(i));
      CHECK(rel_diff(w.detach(), ww) < 1e-6);
      CHECK(rel_diff(b.detach(), wb) < 1e-6);
    }
  }
}

TEST_CASE("gradient clipping matches torch and timm (norm, value, agc)", "[parity][optim]") {
  auto st = load_ref("clip.safetensors");
  for (auto [mode, value] : {std::pair{"norm", 1.5}, {"value", 0.3}, {"agc", 0.05}}) {
    auto pw = st.find("pw")->clone(), pb = st.find("pb")->clone();
    pw.mutable_grad() = st.find("gw")->clone();
    pb.mutable_grad() = st.find("gb")->clone();
    engine::clip_gradients({pw, pb}, value, mode);
    INFO(mode);
    CHECK(max_abs_diff(pw.grad(), *st.find(std::string(mode) + ".gw")) < 1e-6);
    CHECK(max_abs_diff(pb.grad(), *st.find(std::string(mode) + ".gb")) < 1e-6);
  }
}

namespace {
// timm's toy: Sequential(Linear(3, 4), BatchNorm1d(4)); a plain module (EMA takes any).
struct ToyImpl : torch::nn::Module {
  ToyImpl() {
    register_module("0", torch::nn::Linear(3, 4));
    register_module("1", torch::nn::BatchNorm1d(4));
  }
};
}  // namespace

TEST_CASE("EMA matches timm's ModelEmaV3, warmup included", "[parity][ema]") {
  auto st = load_ref("ema.safetensors");
  for (bool warm : {false, true}) {
    const std::string w = warm ? "True" : "False";
    INFO("warmup " << w);
    auto model = std::make_shared<ToyImpl>();
    auto set_state = [&](const std::string& prefix) {
      torch::NoGradGuard ng;
      for (auto& [k, v] : io::state_dict(*model)) v.copy_(*st.find(prefix + k));
    };
    set_state(w + ".init.");
    engine::ModelEma ema(std::make_shared<ToyImpl>(), *model, 0.9, warm, torch::kCPU);
    auto decay = *st.find(w + ".decay");
    for (int64_t s = 0; s < decay.size(0); ++s) CHECK(ema.decay_at(s) == Approx(decay[s].item<double>()).epsilon(1e-12));
    for (int step = 1; step <= 5; ++step) {
      set_state(w + ".model" + std::to_string(step) + ".");  // the model as timm had it at this update
      ema.update(step);
      for (auto& [k, v] : io::state_dict(ema.module())) {
        INFO("step " << step << " " << k);
        CHECK(max_abs_diff(v.to(torch::kDouble), st.find(w + ".ema" + std::to_string(step) + "." + k)->to(torch::kDouble)) < 1e-6);
      }
    }
  }
}

TEST_CASE("mixup targets and the soft-target / BCE losses match timm", "[parity][mixup]") {
  auto st = load_ref("misc.safetensors");
  auto tgt = *st.find("mix.target");
  CHECK(max_abs_diff(data::mixup_target(tgt, 10, torch::tensor(0.7), 0.1), *st.find("mix.batch")) < 1e-6);
  CHECK(max_abs_diff(data::mixup_target(tgt, 10, *st.find("mix.lam_elem"), 0.1), *st.find("mix.elem")) < 1e-6);
  auto lg = *st.find("loss.logits");
  tasks::LossConfig c;
  CHECK(tasks::train_loss(lg, *st.find("mix.batch"), c).item<double>() ==
        Approx(st.find("loss.soft")->item<double>()).epsilon(1e-6));
  c.bce = true;
  c.smoothing = 0.1;
  CHECK(tasks::train_loss(lg, tgt, c).item<double>() == Approx(st.find("loss.bce_idx")->item<double>()).epsilon(1e-6));
  c.bce_sum = true;
  CHECK(tasks::train_loss(lg, tgt, c).item<double>() == Approx(st.find("loss.bce_sum")->item<double>()).epsilon(1e-6));
  c.bce_sum = false;
  c.smoothing = 0;
  c.bce_target_thresh = 0.2;
  CHECK(tasks::train_loss(lg, *st.find("mix.batch"), c).item<double>() ==
        Approx(st.find("loss.bce_dense_thresh")->item<double>()).epsilon(1e-6));
}

TEST_CASE("ViT position embeddings resample like timm's resample_abs_pos_embed", "[parity][io]") {
  auto st = load_ref("misc.safetensors");
  const auto& in = *st.find("posemb.in");
  for (int64_t side : {6, 3, 2}) {
    INFO(side);
    CHECK(max_abs_diff(io::resample_abs_pos_embed(in, side, side, 1), *st.find("posemb." + std::to_string(side))) < 1e-5);
  }
  // load_pretrained applies it: weights of a 32 px ViT-Tiny (2x2 grid) into a 48 px one (3x3)
  auto vit = load_ref("vit_tiny_patch16_224.safetensors");
  ModelArgs a;
  a.num_classes = 10;
  a.img_size = 48;
  auto m = model_zoo::create_model("vit_tiny_patch16_224", a);
  auto note = io::load_pretrained(*m, vit, {"patch_embed.proj", "head"}, "ref");
  CHECK(note.find("resampled pos_embed from 5 to 10 tokens") != std::string::npos);
  for (auto& [k, v] : io::state_dict(*m))
    if (k == "pos_embed") CHECK(max_abs_diff(v, io::resample_abs_pos_embed(*vit.find("model.pos_embed"), 3, 3, 1)) == 0);
}

namespace {
optim::SchedulerArgs sched_from(const nlohmann::json& kw) {
  optim::SchedulerArgs a;  // create_scheduler_v2's defaults
  a.base_lr = 0.1;
  a.sched = kw.value("sched", "cosine");
  a.epochs = kw.value("num_epochs", 300);
  a.warmup_epochs = kw.value("warmup_epochs", 0);
  a.warmup_lr = kw.value("warmup_lr", 1e-5);
  a.warmup_prefix = kw.value("warmup_prefix", false);
  a.cooldown_epochs = kw.value("cooldown_epochs", 0);
  a.min_lr = kw.value("min_lr", 0.0);
  a.decay_epochs = kw.value("decay_epochs", 90.0);
  a.decay_milestones = kw.value("decay_milestones", std::vector<int64_t>{90, 180, 270});
  a.decay_rate = kw.value("decay_rate", 0.1);
  a.patience_epochs = kw.value("patience_epochs", 10);
  a.plateau_max = kw.value("plateau_mode", std::string("max")) == "max";
  a.cycle_mul = kw.value("cycle_mul", 1.0);
  a.cycle_decay = kw.value("cycle_decay", 0.1);  // create_scheduler_v2's default (train.py passes 0.5)
  a.cycle_limit = kw.value("cycle_limit", 1);
  a.k_decay = kw.value("k_decay", 1.0);
  a.on_updates = !kw.value("step_on_epochs", true);
  a.updates_per_epoch = kw.value("updates_per_epoch", 0);
  return a;
}
}  // namespace

TEST_CASE("tanh, cycles, k-decay and per-update schedules give timm's learning rates", "[parity][sched]") {
  auto st = load_ref("sched.safetensors");
  auto cases = nlohmann::json::parse(st.metadata.at("sched_cases"));
  REQUIRE(cases.size() >= 10);
  for (auto& c : cases) {
    INFO(c["kw"].dump());
    optim::Scheduler sch(sched_from(c["kw"]));
    CHECK(sch.num_epochs() == c["num_epochs"].get<int64_t>());
    auto lrs = c["lrs"].get<std::vector<double>>();
    for (size_t t = 0; t < lrs.size(); ++t) {
      INFO("t " << t);
      CHECK(sch.lr_at(int64_t(t)) == Approx(lrs[t]).epsilon(1e-12).margin(1e-15));
    }
    // what the trainer sees: per-epoch schedules move on epochs, per-update ones on updates
    if (sch.on_updates()) {
      CHECK_FALSE(sch.on_epoch(1).has_value());
      CHECK(*sch.on_update(3) == Approx(lrs[3]).epsilon(1e-12));
    } else {
      CHECK(*sch.on_epoch(2) == Approx(lrs[2]).epsilon(1e-12));
      CHECK_FALSE(sch.on_update(3).has_value());
    }
  }
}

TEST_CASE("plateau schedule follows the eval metric like timm's PlateauLRScheduler", "[parity][sched]") {
  auto st = load_ref("sched.safetensors");
  for (auto& c : nlohmann::json::parse(st.metadata.at("plateau_cases"))) {
    INFO(c["kw"].dump());
    optim::Scheduler sch(sched_from(c["kw"]));
    CHECK(sch.num_epochs() == c["num_epochs"].get<int64_t>());
    auto lrs = c["lrs"].get<std::vector<double>>();
    auto metrics = c["metrics"].get<std::vector<double>>();
    CHECK(sch.initial_lr() == Approx(lrs[0]).epsilon(1e-12));
    for (size_t e = 0; e < metrics.size(); ++e) {
      INFO("epoch " << e);
      CHECK(*sch.on_epoch(int64_t(e) + 1, metrics[e]) == Approx(lrs[e + 1]).epsilon(1e-12));
    }
  }
}

TEST_CASE("layer-wise lr decay groups equal timm's param_groups_layer_decay", "[parity][optim]") {
  auto st = load_ref("sched.safetensors");
  auto all = nlohmann::json::parse(st.metadata.at("layer_decay"));
  for (auto& [name, want] : all.items()) {
    INFO(name);
    ModelArgs a;
    a.num_classes = 10;
    a.img_size = ref_img_size(name);
    auto m = model_zoo::create_model(name, a);
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (auto& p : m->named_parameters()) named.emplace_back(p.key(), p.value());
    auto groups = optim::layer_decay_groups(named, 0.05, m->no_weight_decay(), m->group_matcher(), 0.75);
    size_t n = 0;
    for (auto& g : groups)
      for (auto& pn : g.names) {
        INFO(pn);
        REQUIRE(want.contains(pn));
        CHECK(g.lr_scale == Approx(want[pn][0].get<double>()).epsilon(1e-12));
        CHECK(g.weight_decay == Approx(want[pn][1].get<double>()).margin(1e-15));
        ++n;
      }
    CHECK(n == want.size());
  }
}
