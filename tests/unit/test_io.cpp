#include "core/error.h"
#include "engine/checkpoint.h"
#include "engine/train_loop.h"
#include "io/weights.h"
#include "io/safetensors.h"
#include "model_zoo/registry.h"
#include "optim/optim.h"
#include "tasks/classification/classification.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace imgtrain;

namespace {
std::string le64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
  return s;
}
std::string with_header(const std::string& json, const std::string& data = "") {
  return le64(json.size()) + json + data;
}
std::string parse_error(const std::string& bytes) {
  try {
    io::parse_safetensors(bytes, "f.safetensors");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("safetensors round trip keeps dtypes, shapes, values and metadata", "[io]") {
  test::TempDir d("st");
  std::vector<std::pair<std::string, at::Tensor>> t = {
      {"a.weight", torch::randn({3, 4})},
      {"half", torch::randn({5}).to(torch::kHalf)},
      {"bf", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"count", torch::tensor({int64_t(7)})},
      {"bytes", torch::arange(10, torch::kUInt8)},
      {"flag", torch::tensor({true, false})},
      {"scalar", torch::tensor(3.5)},
      {"empty", torch::zeros({0, 3})},
      {"strided", torch::arange(12, torch::kFloat32).view({3, 4}).t()},
  };
  io::save_safetensors(d / "x.safetensors", t, {{"epoch", "3"}, {"arch", "resnet18"}});
  CHECK_FALSE(std::filesystem::exists(d / "x.safetensors.tmp"));
  auto back = io::load_safetensors(d / "x.safetensors");
  REQUIRE(back.tensors.size() == t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    CHECK(back.tensors[i].first == t[i].first);
    CHECK(back.tensors[i].second.scalar_type() == t[i].second.scalar_type());
    CHECK(torch::equal(back.tensors[i].second, t[i].second));
  }
  CHECK(back.metadata.at("epoch") == "3");
  // Data section is 8-byte aligned, as the format asks.
  auto bytes = test::read_file(d / "x.safetensors");
  uint64_t hn = 0;
  for (int i = 0; i < 8; ++i) hn |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  CHECK(hn % 8 == 0);
  // a rename that fails (the name is a folder) says why and leaves no temporary file
  std::filesystem::create_directories(d / "dir.safetensors");
  CHECK_THROWS_WITH(io::save_safetensors(d / "dir.safetensors", t, {}), Catch::Contains("(Is a directory)"));
  for (auto& e : std::filesystem::directory_iterator(d.path))
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
}

TEST_CASE("malformed safetensors files are refused with a reason", "[io]") {
  CHECK_THAT(parse_error("abc"), Catch::Contains("shorter than"));
  CHECK_THAT(parse_error(le64(1000) + "{}"), Catch::Contains("exceeds the file size"));
  CHECK_THAT(parse_error(with_header("{not json")), Catch::Contains("not JSON"));
  CHECK_THAT(parse_error(with_header("[1,2]")), Catch::Contains("not a JSON object"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234")),
             Catch::Contains("outside"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678")),
             Catch::Contains("8 bytes for 3 elements"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", "12345678")),
             Catch::Contains("unsupported dtype 'F33'"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "12345678")),
             Catch::Contains("negative"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", "12345678")),
             Catch::Contains("outside"));
  CHECK_THAT(parse_error(with_header(R"({"w":{"dtype":"F32"}})")), Catch::Contains("lacks"));
  CHECK_THAT(parse_error(with_header(R"({"__metadata__":{"a":1}})")), Catch::Contains("not a string"));
  CHECK_THAT(parse_error(with_header(
                 R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", "1")),
             Catch::Contains("absurd"));
  // A valid one still parses.
  auto ok = io::parse_safetensors(with_header(R"({"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", "\x05\x06"),
                                  "ok");
  CHECK(ok.tensors.at(0).second[1].item<int>() == 6);
}

TEST_CASE("model weights load by name and mismatches are listed", "[io][checkpoint]") {
  ModelArgs a;
  a.num_classes = 10;
  auto m1 = model_zoo::create_model("resnet18", a);
  auto m2 = model_zoo::create_model("resnet18", a);
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (auto& [k, v] : io::state_dict(*m1)) t.emplace_back("model." + k, v);
  test::TempDir d("ck");
  io::save_safetensors(d / "m.safetensors", t);
  auto st = io::load_safetensors(d / "m.safetensors");
  CHECK(io::weights_prefix(st, true) == "model.");
  io::load_state_dict(*m2, st, "model.", "m");
  for (auto& [k, v] : io::state_dict(*m2)) CHECK(torch::equal(v, *st.find("model." + k)));

  a.num_classes = 5;
  auto m3 = model_zoo::create_model("resnet18", a);
  try {
    io::load_state_dict(*m3, st, "model.", "m.safetensors");
    FAIL("expected an error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Catch::Contains("wrong shape fc.weight (10x512 in file, 5x512 in model)"));
  }
  st.tensors.erase(st.tensors.begin());
  st.tensors.emplace_back("model.extra", torch::zeros({1}));
  try {
    io::load_state_dict(*m2, st, "model.", "m.safetensors");
    FAIL("expected an error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Catch::Contains("missing conv1.weight") && Catch::Contains("unexpected extra"));
  }
  // NaN / infinite weights are refused by name, before anything is copied
  auto bad = io::load_safetensors(d / "m.safetensors");
  for (auto& [k, v] : bad.tensors) {
    if (k == "model.layer1.0.conv1.weight") v = v.clone(), v.view(-1)[3] = NAN;
    if (k == "model.fc.bias") v = v.clone(), v.view(-1)[0] = INFINITY;
  }
  CHECK_THROWS_WITH(io::load_state_dict(*m2, bad, "model.", "m.safetensors"),
                    Catch::Contains("weights in 'm.safetensors' hold NaN or infinite values: layer1.0.conv1.weight and 1 more"));
}

TEST_CASE("CheckpointSaver keeps the best N, last and model_best", "[io][checkpoint]") {
  test::TempDir d("saver");
  engine::CheckpointSaver s(d.path.string(), 2, false);
  std::vector<double> metrics = {1.0, 3.0, 2.0, 5.0, 4.0};
  for (size_t e = 0; e < metrics.size(); ++e)
    s.save(int64_t(e), metrics[e], [&](const std::string& p) {
      io::save_safetensors(p, {{"epoch", torch::tensor({int64_t(e)})}});
    });
  auto epoch_in = [&](const std::string& name) {
    return io::load_safetensors(d / name).find("epoch")->item<int64_t>();
  };
  CHECK(epoch_in("last.safetensors") == 4);
  CHECK(epoch_in("model_best.safetensors") == 3);
  CHECK(s.best_epoch == 3);
  CHECK(std::filesystem::exists(d / "checkpoint-3.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-4.safetensors"));
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-1.safetensors"));
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-0.safetensors"));
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-2.safetensors"));
  // Lower is better for loss.
  test::TempDir d2("saver");
  engine::CheckpointSaver l(d2.path.string(), 1, true);
  for (int e = 0; e < 3; ++e) l.save(e, 3.0 - (e == 1 ? 2.5 : 0.0), [](const std::string& p) { io::save_safetensors(p, {}); });
  CHECK(l.best_epoch == 1);
}

TEST_CASE("optimizer state survives a save/load round trip exactly", "[io][optim]") {
  // A channels-last weight (the CPU default for convnets) whose state comes back from the file
  // contiguous: LAMB's and LARS's norms must run over the same layout as in the run that saved it
  for (std::string name : {"sgd", "adamw", "rmsproptf", "lamb", "lambc", "lars"}) {
    INFO(name);
    auto make = [&](at::Tensor init) {
      std::vector<std::pair<std::string, at::Tensor>> p = {{"w", init.clone().requires_grad_(true)},
                                                            {"b.bias", torch::zeros({3}).requires_grad_(true)}};
      optim::OptimizerArgs oa;
      oa.opt = name;
      oa.lr = 0.05;
      oa.weight_decay = 0.01;
      return std::make_pair(p, optim::create_optimizer(oa, p));
    };
    torch::manual_seed(0);
    auto w0 = torch::randn({16, 8, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast);
    auto [pa, oa] = make(w0);
    auto step = [](auto& params, auto& opt, int k) {
      opt->zero_grad();
      auto loss = (params[0].second * (k + 1)).pow(2).sum() + params[1].second.sum() * k;
      loss.backward();
      opt->step();
    };
    for (int k = 0; k < 3; ++k) step(pa, oa, k);
    // Copy parameters and optimizer state to a fresh optimizer, continue both.
    auto [pb, ob] = make(pa[0].second.detach());
    {
      torch::NoGradGuard ng;
      pb[1].second.copy_(pa[1].second);
    }
    std::map<std::string, at::Tensor> st;
    for (auto& [k, v] : oa->state()) st[k] = v.contiguous().clone();  // as a safetensors file gives it back
    ob->load_state(st);
    for (auto& [k, v] : ob->state())
      if (v.dim() == 4) CHECK(v.strides() == pb[0].second.strides());
    for (int k = 3; k < 5; ++k) {
      step(pa, oa, k);
      step(pb, ob, k);
    }
    CHECK(torch::equal(pa[0].second, pb[0].second));
    CHECK(torch::equal(pa[1].second, pb[1].second));
  }
}

TEST_CASE("pretrained loading resets a differing classifier and adapts the first conv", "[io][pretrained]") {
  ModelArgs a;  // timm's defaults: 1000 classes, 3 channels
  torch::manual_seed(1);
  auto src = model_zoo::create_model("resnet18", a);
  io::SafeTensors st;
  for (auto& [k, v] : io::state_dict(*src)) st.tensors.emplace_back(k, v.clone());
  a.num_classes = 10;
  a.in_chans = 1;
  auto dst = model_zoo::create_model("resnet18", a);
  auto fc_before = dst->named_parameters()["fc.weight"].clone();
  auto note = io::load_pretrained(*dst, st, {"conv1", "fc"}, "src");
  CHECK_THAT(note, Catch::Contains("adapted conv1.weight from 3 to 1") && Catch::Contains("classifier fc"));
  auto p = dst->named_parameters();
  CHECK(torch::allclose(p["conv1.weight"], st.find("conv1.weight")->sum(1, true)));
  CHECK(torch::equal(p["fc.weight"], fc_before));
  CHECK(torch::equal(p["layer4.1.conv2.weight"], *st.find("layer4.1.conv2.weight")));
  // Same shapes: a plain strict load, nothing adapted.
  auto same = model_zoo::create_model("resnet18", ModelArgs{});
  CHECK(io::load_pretrained(*same, st, {"conv1", "fc"}, "src").empty());
  CHECK(torch::equal(same->named_parameters()["fc.weight"], *st.find("fc.weight")));
}

TEST_CASE("hub cache lookup follows refs/main and says where it looked", "[io][pretrained]") {
  test::TempDir d("hub");
  const std::string repo = d / "models--timm--resnet18.a1_in1k";
  test::write_file(repo + "/snapshots/aaa/model.safetensors", io::serialize_safetensors({}, {}));
  test::write_file(repo + "/snapshots/bbb/model.safetensors", io::serialize_safetensors({}, {}));
  test::write_file(repo + "/refs/main", "bbb");
  ::setenv("HF_HUB_CACHE", d.path.c_str(), 1);
  CHECK(io::find_hub_weights("resnet18", "a1_in1k") == repo + "/snapshots/bbb/model.safetensors");
  try {
    io::find_hub_weights("resnet50", "a1_in1k");
    FAIL("expected an error");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Catch::Contains(d / "models--timm--resnet50.a1_in1k/snapshots/*/model.safetensors"));
  }
  ::unsetenv("HF_HUB_CACHE");
  ::setenv("HF_HOME", d.path.c_str(), 1);
  CHECK_THROWS_WITH(io::find_hub_weights("resnet18", "a1_in1k"), Catch::Contains(d / "hub/models--timm--"));
  ::unsetenv("HF_HOME");
}

namespace {
// A BatchNorm-free classifier: flatten, then one linear layer.
struct LinearNetImpl : ClassifierImpl {
  torch::nn::Linear fc{nullptr};
  double gain = 1.0;  // a huge gain makes the scaled loss overflow: an injected inf
  explicit LinearNetImpl(int64_t in) { fc = register_module("fc", torch::nn::Linear(in, 3)); }
  at::Tensor forward_features(const at::Tensor& x) override { return x.flatten(1); }
  at::Tensor forward_head(const at::Tensor& x, bool) override { return fc(x) * gain; }
  int64_t num_classes() const override { return 3; }
  int64_t num_features() const override { return fc->options.in_features(); }
};

struct Patterns : data::Dataset {
  size_t size() const override { return 32; }
  int64_t label(size_t i) const override { return int64_t(i % 3); }
  cv::Mat image(size_t i) const override {
    cv::Mat m(6, 6, CV_8UC3);
    for (int k = 0; k < 108; ++k) m.data[k] = uint8_t((k * 7 + i * 31) % 256);
    return m;
  }
  std::string describe(size_t i) const override { return std::to_string(i); }
  int64_t num_classes() const override { return 3; }
  std::vector<std::string> class_names() const override { return {"a", "b", "c"}; }
};

at::Tensor train_linear(int64_t batch, int64_t accum, const std::string& opt) {
  torch::manual_seed(9);
  auto model = std::make_shared<LinearNetImpl>(6 * 6 * 3);
  data::TransformConfig tc;
  tc.size = 6;
  data::LoaderOptions lo;
  lo.batch_size = batch;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.workers = 0;
  data::Loader loader(std::make_shared<Patterns>(), tc, lo);
  optim::OptimizerArgs oa;
  oa.opt = opt;
  oa.lr = 0.05;
  oa.weight_decay = 1e-3;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  auto o = optim::create_optimizer(oa, named);
  tasks::ClassificationOptions co;
  co.loss.smoothing = 0.1;
  tasks::ClassificationTask task(co);
  engine::LoopOptions eo;
  eo.accum_steps = accum;
  eo.log_interval = 1000;
  eo.mean = {0.5, 0.5, 0.5};
  eo.std = {0.25, 0.25, 0.25};
  int64_t updates = 0;
  for (int64_t e = 0; e < 2; ++e) {
    eo.epoch = e;
    engine::train_one_epoch(task, *model, loader, *o, nullptr, updates, eo);  // NOLINT
  }
  CHECK(updates == 2 * 32 / (batch * accum));
  return model->fc->weight.detach().clone();
}
}  // namespace

TEST_CASE("accumulating A micro-batches of b equals one batch of A*b", "[engine][accum]") {
  for (std::string opt : {"sgd", "adamw"}) {
    INFO(opt);
    auto one = train_linear(8, 1, opt);
    auto acc = train_linear(4, 2, opt);
    auto acc4 = train_linear(2, 4, opt);
    CHECK((one - acc).abs().max().item<double>() < 1e-5);
    CHECK((one - acc4).abs().max().item<double>() < 1e-5);
    // and accumulation is not a no-op: plain batches of 4 give different weights
    auto small = train_linear(4, 1, opt);
    CHECK((one - small).abs().max().item<double>() > 1e-3);
  }
}

TEST_CASE("loss scaler: unscale, skip on inf with backoff, growth after the interval", "[engine][amp]") {
  engine::LossScaler s(1024.0, true, torch::kCPU, 2.0, 0.5, 2);
  auto p = torch::zeros({3}, torch::requires_grad());
  auto q = torch::zeros({2}, torch::requires_grad());
  CHECK(s.scale(torch::tensor(2.0)).item<double>() == 2048.0);
  p.mutable_grad() = torch::tensor({1024.0f, 2048.0f, -512.0f});
  q.mutable_grad() = torch::tensor({512.0f, 0.0f});
  CHECK(s.unscale({p, q}));
  CHECK(torch::equal(p.grad(), torch::tensor({1.0f, 2.0f, -0.5f})));
  CHECK(torch::equal(q.grad(), torch::tensor({0.5f, 0.0f})));
  s.update();
  CHECK(s.value() == 1024.0);  // one finite step of an interval of 2
  q.mutable_grad() = torch::tensor({1.0f, 1.0f});
  p.mutable_grad() = torch::tensor({1.0f, 1.0f, 1.0f});
  CHECK(s.unscale({p, q}));
  s.update();
  CHECK(s.value() == 2048.0);  // grows after 2 finite steps
  p.mutable_grad() = torch::tensor({1.0f, std::numeric_limits<float>::infinity(), 1.0f});
  CHECK_FALSE(s.unscale({p, q}));
  s.update();
  CHECK(s.value() == 1024.0);  // backs off
  p.mutable_grad() = torch::tensor({std::nanf(""), 0.0f, 0.0f});
  CHECK_FALSE(s.unscale({p}));
  // A static scale never changes.
  engine::LossScaler st(64.0, false, torch::kCPU);
  CHECK_FALSE(st.unscale({p}));
  st.update();
  CHECK(st.value() == 64.0);
  // State round trip.
  engine::LossScaler r(1.0, true, torch::kCPU);
  std::map<std::string, at::Tensor> m;
  for (auto& [k, v] : s.state()) m[k] = v;
  r.load_state(m);
  CHECK(r.value() == 1024.0);
  // a damaged state is refused by name, before any step
  for (auto bad : {torch::tensor(std::nan("")), torch::tensor(0.0), torch::ones({2})}) {
    auto d = m;
    d["scale"] = bad;
    CHECK_THROWS_WITH(r.load_state(d), Catch::Contains("loss scaler state 'scaler.scale' is not a positive number"));
  }
  auto d = m;
  d["growth_tracker"] = torch::tensor(-3, torch::kInt32);
  CHECK_THROWS_WITH(r.load_state(d), Catch::Contains("'scaler.growth_tracker'"));
  CHECK(r.value() == 1024.0);
}

TEST_CASE("a skipped step leaves the weights alone and training goes on", "[engine][amp]") {
  torch::manual_seed(1);
  auto model = std::make_shared<LinearNetImpl>(6 * 6 * 3);
  data::TransformConfig tc;
  tc.size = 6;
  data::LoaderOptions lo;
  lo.batch_size = 8;
  lo.workers = 0;
  data::Loader loader(std::make_shared<Patterns>(), tc, lo);
  optim::OptimizerArgs oa;
  oa.lr = 0.05;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  auto o = optim::create_optimizer(oa, named);
  engine::LossScaler s(65536.0, true, torch::kCPU);
  const tasks::ClassificationOptions defaults;
  tasks::ClassificationTask task(defaults);
  engine::LoopOptions eo;
  eo.mean = {0.5, 0.5, 0.5};
  eo.std = {0.25, 0.25, 0.25};
  eo.scaler = &s;
  eo.log_interval = 1000;
  auto before = model->fc->weight.detach().clone();
  int64_t updates = 0;
  model->gain = 1e35;  // loss ~1e35, times the scale: inf
  auto res = engine::train_one_epoch(task, *model, loader, *o, nullptr, updates, eo);
  CHECK(res.skipped_steps == 4);
  CHECK(s.value() == 65536.0 / 16);  // halved at every skipped update
  CHECK(torch::equal(before, model->fc->weight.detach()));
  model->gain = 1.0;
  eo.epoch = 1;
  res = engine::train_one_epoch(task, *model, loader, *o, nullptr, updates, eo);
  CHECK(res.skipped_steps == 0);
  CHECK_FALSE(torch::equal(before, model->fc->weight.detach()));
  CHECK(std::isfinite(res.loss));
  CHECK(updates == 8);
}

TEST_CASE("O2: half weights, float32 masters and BatchNorm, and training lowers the loss", "[engine][amp]") {
  for (auto half : {at::kBFloat16, at::kHalf}) {
    INFO(half);
    torch::manual_seed(0);
    ModelArgs a;
    a.num_classes = 4;
    auto model = model_zoo::create_model("resnet18", a);
    engine::MasterWeights master(*model, half);
    for (auto& p : model->named_parameters()) {
      INFO(p.key());
      const bool bn = p.key().find("bn") != std::string::npos || p.key().find("downsample.1") != std::string::npos;
      CHECK(p.value().scalar_type() == (bn ? at::kFloat : half));
    }
    for (auto& b : model->named_buffers())
      if (b.value().is_floating_point()) CHECK(b.value().scalar_type() == at::kFloat);  // BN running stats
    for (auto& [k, t] : master.named_masters()) CHECK(t.scalar_type() == at::kFloat);
    optim::OptimizerArgs oa;
    oa.opt = "momentum";
    oa.lr = 0.05;
    auto opt = optim::create_optimizer(oa, master.named_masters());
    auto x = torch::randn({8, 3, 32, 32});
    auto y = torch::tensor({0, 1, 2, 3, 0, 1, 2, 3});
    engine::LossScaler scaler(1024.0, true, torch::kCPU);
    model->train();
    double first = 0, last = 0;
    for (int step = 0; step < 8; ++step) {
      auto loss = torch::nn::functional::cross_entropy(model->forward(x.to(half)).to(at::kFloat), y);
      scaler.scale(loss).backward();
      master.grads_to_masters();
      for (auto& p : model->parameters()) CHECK_FALSE(p.grad().defined());
      REQUIRE(scaler.unscale(master.masters()));
      opt->step();
      master.masters_to_model();
      opt->zero_grad();
      scaler.update();
      (step == 0 ? first : last) = loss.item<double>();
    }
    CHECK(last < 0.7 * first);
    // the model holds the masters, rounded
    auto mp = model->named_parameters();
    for (auto& [k, t] : master.named_masters())
      CHECK(torch::equal(mp[k], t.to(mp[k].scalar_type())));
  }
}
