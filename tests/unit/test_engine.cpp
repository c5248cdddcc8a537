// The engine's seam: a task that is not classification trains through the one loop, and the
// checkpoint format's owner round-trips every field.
#include "core/batch_norm.h"
#include "core/error.h"
#include "core/log.h"
#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "engine/run_folder.h"
#include "engine/setup.h"
#include "engine/evaluate.h"
#include "engine/train_loop.h"
#include "io/weights.h"
#include "model_zoo/layers/layers.h"
#include "model_zoo/registry.h"
#include "ops/norm_act.h"
#include "ops/depthwise.h"
#include "ops/mlp.h"
#include "ops/attention.h"
#include "ops/se_gate.h"
#include "ops/winograd.h"
#include "ops/kernel_util.h"
#include "optim/optim.h"
#include "core/rng.h"
#include "tasks/classification/classification.h"
#include "tasks/tasks.h"
#include "cli/config.h"
#include "test_util.h"
#include "op_trace.h"

#include <catch2/catch.hpp>
#include <opencv2/imgcodecs.hpp>
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <array>
#include <cstdio>
#include <sys/stat.h>
#include <functional>
#include <map>
#include <set>
#include <cstdlib>
#include <cstring>

using namespace imgtrain;

namespace {

// Images whose brightness is the regression target: sample i is a flat grey of level 8 * i.
struct Greys : data::Dataset {
  size_t size() const override { return 32; }
  int64_t label(size_t) const override { return 0; }
  cv::Mat image(size_t i) const override { return cv::Mat(4, 4, CV_8UC3, cv::Scalar::all(double(8 * i))); }
  std::string describe(size_t i) const override { return std::to_string(i); }
  int64_t num_classes() const override { return 1; }
  std::vector<std::string> class_names() const override { return {"grey"}; }
};

// A plain module (not a classifier): one linear unit on the pooled input, plus a BatchNorm so that
// the EMA has buffers to copy.
struct RegressorImpl : torch::nn::Module {
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
  RegressorImpl() {
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    fc = register_module("fc", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(bn(x).mean({2, 3}) + x.mean({2, 3})).squeeze(1); }
};

// Mean squared error against each image's own brightness (in normalised units): a loss dict of
// one part, and an evaluator reporting "mse".
struct BrightnessTask : engine::Task {
  int64_t epochs_started = 0;
  std::string name() const override { return "brightness"; }
  std::shared_ptr<torch::nn::Module> create_model() const override { return std::make_shared<RegressorImpl>(); }
  void start_epoch(int64_t) override { ++epochs_started; }
  static at::Tensor target(const data::Batch& b, const at::Tensor& x) {
    return b.indices.to(x.device(), at::kFloat) * (8.0 / 255.0);
  }
  engine::StepOutput forward_train(torch::nn::Module& m, at::Tensor x, const data::Batch& b,
                                   const engine::StepContext&) override {
    auto pred = m.as<RegressorImpl>()->forward(x);
    auto loss = (pred - target(b, x)).pow(2).mean();
    return {loss, {{"loss_mse", loss}}};
  }
  engine::EvalOutputs forward_eval(torch::nn::Module& m, const at::Tensor& x, const data::Batch& b,
                                   const engine::StepContext&) override {
    return {{{"err2", (m.as<RegressorImpl>()->forward(x) - target(b, x)).pow(2)}}};
  }
  struct Mse : engine::Evaluator {
    double sum = 0;
    int64_t n = 0;
    void update(const engine::EvalOutputs& out, const data::Batch&) override {
      sum += out.at("err2").sum().item<double>();
      n += out.at("err2").numel();
    }
    engine::NamedValues summarize() const override { return {{"mse", sum / double(n)}}; }
    std::string progress(bool) const override { return fmt::format("MSE: {:.4f}", sum / double(n)); }
    int64_t count() const override { return n; }
    std::string summary_line() const override { return progress(true); }
    engine::NamedValues result_fields() const override { return summarize(); }
  };
  std::unique_ptr<engine::Evaluator> evaluator(dist::Context*) const override { return std::make_unique<Mse>(); }
  std::vector<std::string> metric_names() const override { return {"mse"}; }
};

}  // namespace

TEST_CASE("a task that is not classification trains through the loop with accumulation, EMA and a scaler",
          "[engine][task]") {
  torch::manual_seed(3);
  BrightnessTask task;
  auto model = task.create_model();
  data::TransformConfig tc;
  tc.size = 4;
  tc.crop_pct = 1.0;
  data::LoaderOptions lo;
  lo.batch_size = 4;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.workers = 0;
  data::Loader train(std::make_shared<Greys>(), tc, lo);
  lo.shuffle = false;
  data::Loader eval(std::make_shared<Greys>(), tc, lo);
  optim::OptimizerArgs oa;
  oa.opt = "momentum";
  oa.lr = 0.05;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  auto opt = optim::create_optimizer(oa, named);
  engine::LossScaler scaler(1024.0, true, torch::kCPU, 2.0, 0.5, /*interval=*/4);
  engine::ModelEma ema(task.create_model(), *model, 0.5, false, torch::kCPU);
  engine::LoopOptions o;
  o.accum_steps = 2;
  o.log_interval = 1000;
  o.mean = {0.5, 0.5, 0.5};
  o.std = {0.25, 0.25, 0.25};
  o.scaler = &scaler;
  engine::EvalOptions eo;
  eo.mean = o.mean;
  eo.std = o.std;
  eo.log_interval = 1000;
  const double mse0 = engine::evaluate(task, *model, eval, eo).get("mse");
  const auto w0 = io::state_dict(*model)[0].second.clone();
  int64_t updates = 0;
  double first_loss = 0, last_loss = 0;
  for (int64_t e = 0; e < 6; ++e) {
    o.epoch = e;
    auto res = engine::train_one_epoch(task, *model, train, *opt, &ema, updates, o);
    CHECK(res.skipped_steps == 0);
    CHECK(std::isfinite(res.loss));
    (e == 0 ? first_loss : last_loss) = res.loss;
  }
  CHECK(task.epochs_started == 6);
  CHECK(updates == 6 * (32 / 4) / 2);  // 8 micro-batches per epoch, 4 updates
  CHECK(scaler.value() == 1024.0 * 64);  // grew once every 4 finite updates: 24 updates
  CHECK(last_loss < 0.5 * first_loss);
  const auto res = engine::evaluate(task, *model, eval, eo);
  CHECK(res.count == 32);
  CHECK(res.metrics.size() == 1);
  CHECK(res.get("mse") < 0.5 * mse0);
  // The EMA followed the model: it moved from the start, and is not the model itself.
  auto ema_w = io::state_dict(ema.module())[0].second;
  CHECK_FALSE(torch::equal(ema_w, w0));
  CHECK_FALSE(torch::equal(ema_w, io::state_dict(*model)[0].second));
  // and its BatchNorm buffers were copied from the model
  auto mb = io::state_dict(*model), eb = io::state_dict(ema.module());
  for (size_t i = 0; i < mb.size(); ++i)
    if (mb[i].first == "bn.num_batches_tracked") CHECK(torch::equal(mb[i].second, eb[i].second));
}

TEST_CASE("the checkpoint format round-trips every field and tensor", "[engine][checkpoint]") {
  test::TempDir d("ckpt");
  torch::manual_seed(1);
  auto model = std::make_shared<RegressorImpl>();
  auto ema = std::make_shared<RegressorImpl>();
  engine::CheckpointMeta m;
  m.arch = "regressor";
  m.task = "brightness";
  m.num_classes = 1;
  m.in_chans = 3;
  m.img_size = 4;
  m.global_pool = "";
  m.crop_pct = 0.95;
  m.epoch = 7;
  m.num_updates = 123;
  m.recovery_update = 5;
  m.metric = 0.1 + 0.2;  // not exactly representable: the text must keep every bit
  m.best_metric = 1.0 / 3.0;
  m.best_epoch = 6;
  m.plateau = "0.01 0.5 2";
  m.args = "model: regressor\n";
  m.roi_canonical_size = 112;
  m.box_sampling_ratio = 0;
  m.roi_align_v2 = 1;
  m.mask_convention = "aligned";
  engine::TrainStateRefs s;
  s.model = model.get();
  s.ema = ema.get();
  s.optim = {{"0.momentum_buffer", torch::randn({2, 3})}};
  s.master = {{"fc.weight", torch::randn({1, 3})}};
  s.scaler = {{"scale", torch::tensor(1024.0)}};
  s.rng_cpu = at::detail::getDefaultCPUGenerator().get_state();
  const std::string path = d / "a.safetensors";
  engine::write_checkpoint(path, m, s);

  const auto ck = engine::Checkpoint::read(path);
  const auto& r = ck.meta();
  CHECK(r.arch == m.arch);
  CHECK(r.task == m.task);
  CHECK(r.num_classes == m.num_classes);
  CHECK(r.in_chans == m.in_chans);
  CHECK(r.img_size == m.img_size);
  CHECK(r.global_pool == m.global_pool);
  CHECK(r.crop_pct == m.crop_pct);
  CHECK(r.epoch == m.epoch);
  CHECK(r.num_updates == m.num_updates);
  CHECK(r.recovery_update == m.recovery_update);
  CHECK(r.metric == m.metric);
  CHECK(r.best_metric == m.best_metric);
  CHECK(r.best_epoch == m.best_epoch);
  CHECK(r.plateau == m.plateau);
  CHECK(r.args == m.args);
  CHECK(r.roi_canonical_size == m.roi_canonical_size);
  CHECK(r.box_sampling_ratio == m.box_sampling_ratio);
  CHECK(r.roi_align_v2 == m.roi_align_v2);
  CHECK(r.mask_convention == m.mask_convention);
  CHECK(r.is_training());
  CHECK(engine::Checkpoint::read_meta(path).to_metadata() == m.to_metadata());
  // Tensors: the weights load into fresh modules and equal the originals.
  auto back = std::make_shared<RegressorImpl>(), back_ema = std::make_shared<RegressorImpl>();
  ck.load_prefixed(*back, "model.");
  ck.load_weights(*back_ema, /*prefer_ema=*/true);
  CHECK(ck.has_ema());
  for (auto [a, b] : {std::pair{model, back}, {ema, back_ema}}) {
    auto x = io::state_dict(*a), y = io::state_dict(*b);
    REQUIRE(x.size() == y.size());
    for (size_t i = 0; i < x.size(); ++i) {
      INFO(x[i].first);
      CHECK(torch::equal(x[i].second, y[i].second));
    }
  }
  CHECK(torch::equal(ck.section("optim.").at("0.momentum_buffer"), s.optim[0].second));
  CHECK(torch::equal(*ck.find("master.fc.weight"), s.master[0].second));
  CHECK(ck.section("scaler.").at("scale").item<double>() == 1024.0);
  CHECK(torch::equal(*ck.find("rng.cpu"), s.rng_cpu));
  CHECK_NOTHROW(ck.require_training("--resume", "regressor"));
  CHECK_THROWS_WITH(ck.require_training("--resume", "resnet18"), Catch::Contains("checkpoint is a regressor"));

  // A plain weights file is not a training checkpoint; a malformed field is a one-line error.
  io::save_safetensors(d / "plain.safetensors", io::state_dict(*model));
  const auto plain = engine::Checkpoint::read(d / "plain.safetensors");
  CHECK_FALSE(plain.meta().is_training());
  CHECK(plain.weights_prefix(true).empty());
  CHECK_THROWS_WITH(plain.require_training("--resume", "regressor"), Catch::Contains("no 'arch'"));
  io::save_safetensors(d / "bad.safetensors", io::state_dict(*model), {{"epoch", "seven"}});
  CHECK_THROWS_AS(engine::Checkpoint::read(d / "bad.safetensors"), UserError);
  // numbers outside what the flags accept are refused by key, naming the file
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{
           {"img_size", "-3"}, {"img_size", "100000"}, {"crop_pct", "0"}, {"crop_pct", "nan"}, {"num_classes", "0"},
           {"in_chans", "2"}, {"roi_canonical_size", "0"}, {"roi_align_v2", "2"}, {"box_sampling_ratio", "-1"},
           {"mask_convention", "detectron"}}) {
    INFO(k << " = " << v);
    CHECK_THROWS_WITH(engine::CheckpointMeta::from_metadata({{k, v}}, "x.safetensors"),
                      Catch::Contains("'x.safetensors': metadata '" + k + "' is '"));
  }
  // and a training position --resume could not continue from
  for (auto [k, v] : std::vector<std::pair<std::string, std::string>>{
           {"epoch", "-5"}, {"epoch", "1000000000"}, {"num_updates", "-1"}, {"recovery_update", "-2"}}) {
    INFO(k << " = " << v);
    auto md = m.to_metadata();
    md[k] = v;
    io::save_safetensors(d / "pos.safetensors", io::state_dict(*model), md);
    CHECK_THROWS_WITH(engine::Checkpoint::read(d / "pos.safetensors").require_training("--resume", "regressor"),
                      Catch::Contains("metadata '" + k + "' is " + v + ", expected"));
  }
  // the plateau scheduler's state: three numbers, or the resumed run would train at lr 0
  for (std::string v : {"a b", "0.1 0.5", "nan 0.5 1", "0.1 0.5 1 junk", "0.1 0.5 -1", "-0.1 0.5 1", "inf 0 0"}) {
    INFO("plateau = " << v);
    auto md = m.to_metadata();
    md["plateau"] = v;
    io::save_safetensors(d / "pos.safetensors", io::state_dict(*model), md);
    CHECK_THROWS_WITH(engine::Checkpoint::read(d / "pos.safetensors").require_training("--resume", "regressor"),
                      Catch::Contains("metadata 'plateau' is '" + v + "', expected"));
  }
  for (std::string v : {"0.1 0.5 2", "0.01 inf 0", "1e-3 -0.25 10"}) {
    INFO("plateau = " << v);
    auto md = m.to_metadata();
    md["plateau"] = v;
    io::save_safetensors(d / "pos.safetensors", io::state_dict(*model), md);
    CHECK_NOTHROW(engine::Checkpoint::read(d / "pos.safetensors").require_training("--resume", "regressor"));
  }

  // --resume auto: the most updates first; at a tie the end-of-epoch file before the recovery
  // one; unreadable files and plain weights are passed over.
  test::TempDir run("run");
  CHECK(engine::find_checkpoints(run.path.string()).empty());
  auto at = [&](const std::string& name, int64_t updates, bool recovery) {
    engine::CheckpointMeta k = m;
    k.num_updates = updates;
    k.recovery_update = recovery ? std::optional<int64_t>(3) : std::nullopt;
    engine::write_checkpoint(run / name, k, {});
  };
  test::write_file(run / "broken.safetensors", "not a safetensors file");
  io::save_safetensors(run / "weights.safetensors", io::state_dict(*model));
  at("recovery-1-3.safetensors", 40, true);
  at("checkpoint-0.safetensors", 30, false);
  CHECK(engine::find_checkpoints(run.path.string()) ==
        std::vector<std::string>{run / "recovery-1-3.safetensors", run / "checkpoint-0.safetensors"});
  at("last.safetensors", 40, false);
  CHECK(engine::find_checkpoints(run.path.string()).front() == run / "last.safetensors");
}

TEST_CASE("a resumed run keeps --checkpoint-hist, one recovery file and one summary row per epoch",
          "[engine][checkpoint][fault]") {
  test::TempDir d("hist");
  auto write = [&](const std::string& name, int64_t epoch, double metric) {
    engine::CheckpointMeta k;
    k.arch = "regressor";
    k.epoch = epoch;
    k.num_updates = 10 * (epoch + 1);
    k.metric = metric;
    engine::write_checkpoint(d / name, k, {});
  };
  // an earlier process kept epochs 0..3 (hist was larger then, or it was killed mid-save)
  write("checkpoint-0.safetensors", 0, 50.0);
  write("checkpoint-1.safetensors", 1, 70.0);
  write("checkpoint-2.safetensors", 2, 60.0);
  write("checkpoint-3.safetensors", 3, 80.0);
  write("checkpoint-5.safetensors", 5, 99.0);  // beyond the resume point: not adopted, not removed
  test::write_file(d / "notes.txt", "mine");
  engine::CheckpointSaver saver(d.path.string(), 2, /*decreasing=*/false);
  saver.adopt_existing(/*start_epoch=*/4);
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-0.safetensors"));
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-2.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-1.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-3.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-5.safetensors"));
  CHECK(std::filesystem::exists(d / "notes.txt"));
  // the next epoch competes with the adopted ones: 75 displaces 70
  saver.save(4, 75.0, [&](const std::string& path) { write(path.substr(d.path.string().size() + 1), 4, 75.0); });
  CHECK_FALSE(std::filesystem::exists(d / "checkpoint-1.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-4.safetensors"));
  CHECK(std::filesystem::exists(d / "checkpoint-3.safetensors"));

  // killed between writing last.safetensors and linking it: the resumed run makes the links
  test::TempDir d2("hist2");
  auto write2 = [&](const std::string& name, int64_t epoch, double metric, int64_t best_epoch) {
    engine::CheckpointMeta k;
    k.arch = "regressor";
    k.epoch = epoch;
    k.num_updates = 10 * (epoch + 1);
    k.metric = metric;
    k.best_epoch = best_epoch;
    engine::write_checkpoint(d2 / name, k, {});
  };
  write2("checkpoint-0.safetensors", 0, 50.0, 0);
  write2("model_best.safetensors", 0, 50.0, 0);
  write2("last.safetensors", 1, 60.0, 1);
  engine::CheckpointSaver saver2(d2.path.string(), 2, /*decreasing=*/false);
  saver2.adopt_existing(2);
  REQUIRE(std::filesystem::exists(d2 / "checkpoint-1.safetensors"));
  CHECK(engine::Checkpoint::read_meta(d2 / "checkpoint-1.safetensors").epoch == 1);
  CHECK(engine::Checkpoint::read_meta(d2 / "model_best.safetensors").epoch == 1);
  CHECK(std::filesystem::exists(d2 / "checkpoint-0.safetensors"));

  // recovery files: one kept after a recovery write, none after an epoch's checkpoint
  test::write_file(d / "recovery-2-7.safetensors", "x");
  test::write_file(d / "recovery-4-3.safetensors", "x");
  saver.prune_recovery(d / "recovery-4-3.safetensors");
  CHECK_FALSE(std::filesystem::exists(d / "recovery-2-7.safetensors"));
  CHECK(std::filesystem::exists(d / "recovery-4-3.safetensors"));
  saver.prune_recovery("");
  CHECK_FALSE(std::filesystem::exists(d / "recovery-4-3.safetensors"));

  // summary.csv: rows of epochs about to be redone are dropped; a temporary file a killed
  // process left is removed when the next run takes the folder
  test::TempDir out("out");
  {
    engine::RunFolder folder(out.path.string(), "exp", true);
    folder.append_summary(0, {{"loss", 1.0}}, {{"top1", 10.0}}, 0.1);
    folder.append_summary(1, {{"loss", 0.5}}, {{"top1", 20.0}}, 0.1);
    folder.append_summary(2, {{"loss", 0.4}}, {{"top1", 30.0}}, 0.1);
    test::write_file(folder.path("last.safetensors.tmp.12345"), "partial");
  }
  engine::RunFolder folder(out.path.string(), "exp", true);
  CHECK_FALSE(std::filesystem::exists(folder.path("last.safetensors.tmp.12345")));
  folder.truncate_summary(2);
  CHECK(test::read_file(folder.path("summary.csv")) ==
        "epoch,train_loss,eval_top1,lr\n0,1,10,0.1\n1,0.5,20,0.1\n");
  folder.truncate_summary(5);  // nothing to drop
  CHECK(test::read_file(folder.path("summary.csv")) ==
        "epoch,train_loss,eval_top1,lr\n0,1,10,0.1\n1,0.5,20,0.1\n");
  // --experiment names a folder under --output, never one outside it
  for (const char* bad : {"../x", "a/../../x", "/tmp/x", ".", ""})
    CHECK_THROWS_WITH(engine::RunFolder(out.path.string(), bad, true),
                      Catch::Contains("a folder name under --output"));
  engine::RunFolder nested(out.path.string(), "ablation/lr0.1", true);
  CHECK(std::filesystem::is_directory(out / "ablation/lr0.1"));
}

TEST_CASE("a run that does not resume its folder's run moves that run's files aside", "[engine][checkpoint]") {
  namespace fs = std::filesystem;
  test::TempDir out("out");
  const fs::path d = out / "exp";
  {
    engine::RunFolder folder(out.path.string(), "exp", true);
    // only a start-up failure's files: nothing to move, the log goes on
    test::write_file(d / "log.txt", "earlier\n");
    CHECK(folder.begin("a: 1\n", /*continues=*/false).empty());
    CHECK(test::read_file(d / "args.yaml") == "a: 1\n");
    folder.append_summary(0, {{"loss", 1.0}}, {{"top1", 10.0}}, 0.1);
    for (const char* f : {"last.safetensors", "checkpoint-0.safetensors", "model_best.safetensors",
                          "recovery-1-3.safetensors", "events.out.tfevents.1.h.2", "notes.md"})
      test::write_file(d / f, f);
    fs::create_directories(d / "mine");
    // resuming the folder's own run keeps everything
    CHECK(folder.begin("a: 2\n", /*continues=*/true).empty());
    CHECK(fs::exists(d / "checkpoint-0.safetensors"));
    // a fresh run: the earlier run's files go to earlier-run-1, the user's own files stay
    CHECK(folder.begin("a: 3\n", /*continues=*/false) == (d / "earlier-run-1").string());
    imgtrain::log::set_file("");
    for (const char* f : {"last.safetensors", "checkpoint-0.safetensors", "model_best.safetensors",
                          "recovery-1-3.safetensors", "events.out.tfevents.1.h.2", "summary.csv"}) {
      CHECK_FALSE(fs::exists(d / f));
      CHECK(fs::exists(d / "earlier-run-1" / f));
    }
    CHECK(test::read_file(d / "earlier-run-1" / "args.yaml") == "a: 2\n");
    CHECK(test::read_file(d / "earlier-run-1" / "log.txt").starts_with("earlier\n"));
    CHECK(test::read_file(d / "args.yaml") == "a: 3\n");
    CHECK(fs::exists(d / "notes.md"));
    CHECK(fs::is_directory(d / "mine"));
    // the new run's summary starts with its own header and rows
    folder.append_summary(0, {{"loss", 2.0}}, {{"top1", 5.0}}, 0.1);
    CHECK(test::read_file(d / "summary.csv") == "epoch,train_loss,eval_top1,lr\n0,2,5,0.1\n");
    // and a third run finds the next free name
    CHECK(folder.begin("a: 4\n", /*continues=*/false) == (d / "earlier-run-2").string());
    imgtrain::log::set_file("");
    CHECK(fs::exists(d / "earlier-run-2" / "summary.csv"));
    CHECK(fs::exists(d / "earlier-run-1" / "summary.csv"));
  }
  // a FIFO (or folder) where the run writes by name is refused, not waited on
  fs::remove(d / "log.txt");
  REQUIRE(::mkfifo((d / "log.txt").c_str(), 0644) == 0);
  {
    engine::RunFolder folder(out.path.string(), "exp", true);
    CHECK_THROWS_WITH(folder.begin("a: 5\n", false), Catch::Contains("log.txt' is not a regular file"));
  }
  fs::remove(d / "log.txt");
  // the lock is never taken through a link (it would overwrite the link's target)
  test::TempDir other("other");
  test::write_file(other / "precious", "keep");
  fs::create_directories(out / "linked");
  fs::create_symlink(other / "precious", out / "linked/.lock");
  CHECK_THROWS_WITH(engine::RunFolder(out.path.string(), "linked", true), Catch::Contains(".lock' is a symbolic link"));
  // a folder where a checkpoint goes is found at the start, not after an epoch
  fs::create_directories(d / "last.safetensors");
  {
    engine::RunFolder folder(out.path.string(), "exp", true);
    CHECK_THROWS_WITH(folder.begin("a: 6\n", false), Catch::Contains("last.safetensors' is not a regular file"));
  }
  fs::remove(d / "last.safetensors");
  CHECK(test::read_file(other / "precious") == "keep");
}

TEST_CASE("TensorBoard framing: CRC-32C and the records of an events file", "[engine][tensorboard]") {
  // RFC 3720's check value, and TFRecord's framing read back by hand
  CHECK(engine::crc32c("123456789", 9) == 0xE3069283u);
  CHECK(engine::crc32c("", 0) == 0u);
  test::TempDir d("tb");
  std::string path;
  {
    engine::EventWriter w(d / "events");
    REQUIRE(w.enabled());
    w.scalar("train/loss", 0.5, 7);
    w.flush();
    path = w.path();
  }
  const std::string bytes = test::read_file(path);
  auto u64 = [&](size_t at) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + at, 8);
    return v;
  };
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + at, 4);
    return v;
  };
  auto masked = [](uint32_t c) { return ((c >> 15) | (c << 17)) + 0xA282EAD8u; };
  size_t at = 0;
  int records = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    const uint64_t n = u64(at);
    CHECK(u32(at + 8) == masked(engine::crc32c(bytes.data() + at, 8)));
    REQUIRE(at + 12 + n + 4 <= bytes.size());
    CHECK(u32(at + 12 + n) == masked(engine::crc32c(bytes.data() + at + 12, n)));
    if (records == 0) CHECK(bytes.substr(at + 12, n).find("brain.Event:2") != std::string::npos);
    if (records == 1) CHECK(bytes.substr(at + 12, n).find("train/loss") != std::string::npos);
    at += 12 + n + 4;
    ++records;
  }
  CHECK(records == 2);
  CHECK(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0);
  engine::EventWriter off;
  CHECK_FALSE(off.enabled());
  off.scalar("x", 1, 0);  // nothing, no crash
}

#ifdef IMGTRAIN_WITH_IMGCODECS
TEST_CASE("curves.png: three panels with each curve's colour, runs overlaid with a legend", "[engine][plot]") {
  test::TempDir d("plot");
  test::write_file(d / "a/summary.csv",
                   "epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\n0,2.1,1.9,40,80,0.1\n1,1.5,1.4,60,90,0.05\n"
                   "2,1.2,1.1,70,95,0.01\n");
  test::write_file(d / "b/summary.csv", "epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\n0,2.5,2,30,70,0.1\n");
  engine::plot_runs({d / "a"}, d / "a.png");
  const cv::Mat img = data::decode_image(test::read_file(d / "a.png"), "a.png");
  REQUIRE(img.cols == 1260);
  REQUIRE(img.rows == 360);
  auto count = [&](const cv::Mat& m, const unsigned char* rgb) {
    int n = 0;
    for (int y = 0; y < m.rows; ++y)
      for (int x = 0; x < m.cols; ++x) {
        const auto& p = m.at<cv::Vec3b>(y, x);
        n += p[0] == rgb[0] && p[1] == rgb[1] && p[2] == rgb[2];  // decode_image gives RGB
      }
    return n;
  };
  for (int c = 0; c < 4; ++c) {
    INFO("curve " << c);
    CHECK(count(img, engine::kCurveColours[c]) > 20);
  }
  const unsigned char white[3] = {255, 255, 255};
  CHECK(count(img, white) < img.rows * img.cols * 99 / 100);  // not blank
  // two runs: a legend row each below the panels; a folder without summary.csv alone is refused
  engine::plot_runs({d / "a", d / "b"}, d / "ab.png");
  const cv::Mat both = data::decode_image(test::read_file(d / "ab.png"), "ab.png");
  CHECK(both.rows == 360 + 2 * 22 + 10);
  CHECK_THROWS_WITH(engine::plot_runs({d / "none"}, d / "n.png"),
                    Catch::Contains("no run with a readable summary.csv"));
}
#endif

namespace {

// A few steps of an optimizer over parameters of every shape the fused kernels meet: a
// channels-last convolution weight with a channels-last gradient, one with a contiguous gradient
// (layouts differ: the loop must take it), a matrix, a bias (no weight decay) and a parameter
// whose first gradient comes at the third step; the lr changes half-way (with `big`, also a matrix
// of 34,639 elements, which ATen's element-wise ops split among threads with a partial vector at
// the split). Returns the parameters after each step (on the CPU) and the optimizer.
std::pair<std::vector<at::Tensor>, std::unique_ptr<optim::Optimizer>> optimizer_trace(
    const std::string& opt, const std::string& impl, torch::Device dev, double momentum = 0.9, int steps = 6,
    std::unique_ptr<optim::Optimizer> resume_into = nullptr, int first_step = 0,
    const std::vector<at::Tensor>& start = {}, bool big = false, at::ScalarType dtype = at::kFloat) {
  torch::manual_seed(3);
  const auto cl = at::MemoryFormat::ChannelsLast;
  std::vector<std::pair<std::string, at::Tensor>> named = {
      {"conv.weight", torch::randn({8, 4, 3, 3}).contiguous(cl)},
      {"conv2.weight", torch::randn({6, 4, 3, 3}).contiguous(cl)},
      {"fc.weight", torch::randn({10, 7})},
      {"fc.bias", torch::randn({10})},
      {"late.weight", torch::randn({5, 5})}};
  if (big) named.emplace_back("big.weight", torch::randn({67, 517}));
  for (size_t i = 0; i < start.size(); ++i) named[i].second.copy_(start[i]);
  for (auto& [n, p] : named) p = p.to(dev, dtype).requires_grad_(true);
  optim::OptimizerArgs a;
  a.opt = opt;
  a.impl = impl;
  a.lr = opt.find("adam") != std::string::npos ? 1e-2 : 0.1;
  a.weight_decay = 1e-2;
  a.momentum = momentum;
  auto o = optim::create_optimizer(a, named);
  if (resume_into) {  // continue from another optimizer's state, as a resumed run does
    std::map<std::string, at::Tensor> st;
    for (auto& [k, t] : resume_into->state()) st[k] = t;
    o->load_state(st);
  }
  std::vector<at::Tensor> trace;
  for (int step = 0; step < steps; ++step) {
    if (step + first_step == 3) o->set_lr(a.lr / 2);
    torch::manual_seed(100 + step + first_step);
    for (auto& [n, p] : named) {
      auto g = torch::randn(p.sizes()).to(dtype);
      if (n == "conv.weight") g = g.contiguous(cl);
      if (n == "late.weight" && step + first_step < 2) continue;
      p.mutable_grad() = g.to(dev);
    }
    o->step();
    for (auto& [n, p] : named) trace.push_back(p.detach().to(torch::kCPU).clone());
    for (auto& [n, p] : named) p.mutable_grad() = at::Tensor();
  }
  return {trace, std::move(o)};
}

// Largest |a - b| / (1 + |b|) over the traces.
double trace_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, ((a[i] - b[i]).abs() / (b[i].abs() + 1)).max().item<double>());
  return d;
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

using test::op_counts;
using test::ops_called;

void fused_optimizers_agree(torch::Device dev, double tolerance_sgd) {
  for (double momentum : {0.9, 0.0})
    for (std::string opt : {"sgd", "momentum"}) {
      INFO(opt << " momentum " << momentum);
      auto loop = optimizer_trace(opt, "loop", dev, momentum).first;
      auto fast = optimizer_trace(opt, "auto", dev, momentum).first;  // whole blocks fused, tails looped
      auto fused = optimizer_trace(opt, "fused", dev, momentum).first;  // all of each tensor fused
      if (tolerance_sgd == 0) CHECK(same_bits(fast, loop));
      else CHECK(trace_diff(fast, loop) < tolerance_sgd);
      CHECK(trace_diff(fused, loop) < 1e-6);
      if (opt == "sgd") CHECK(same_bits(optimizer_trace("fusedsgd", "auto", dev, momentum).first, fused));
    }
  for (std::string opt : {"adam", "adamw"}) {
    INFO(opt);
    auto loop = optimizer_trace(opt, "loop", dev).first;
    auto each = optimizer_trace(opt, "foreach", dev).first;
    std::vector<at::Tensor> fused;
    const auto ran = ops_called([&] { fused = optimizer_trace(opt, "fused", dev).first; });
    if (dev.is_cpu()) CHECK(same_bits(each, loop));
    else CHECK(trace_diff(each, loop) < 1e-6);
    CHECK(trace_diff(fused, loop) < 1e-6);
    // a real second implementation, not the loop again: ATen's fused kernel ran (its bits may or
    // may not equal the loop's, depending on the CPU's vector width)
    CHECK(ran.count(opt == "adam" ? "aten::_fused_adam_" : "aten::_fused_adamw_") == 1);
    CHECK(same_bits(optimizer_trace("fused" + opt, "auto", dev).first, fused));
  }
}

}  // namespace

TEST_CASE("optimizers through ATen's fused and multi-tensor kernels equal the per-parameter loops", "[optim]") {
  fused_optimizers_agree(torch::Device(torch::kCPU), 0.0);  // fused SGD is the loop, bit for bit
  // The state a fused step leaves resumes in the loop (and back) exactly: 3 + 3 steps == 6 steps.
  for (std::string opt : {"sgd", "adamw"}) {
    INFO(opt);
    auto whole = optimizer_trace(opt, "auto", torch::kCPU).first;
    auto [head, o] = optimizer_trace(opt, opt == "sgd" ? "auto" : "fused", torch::kCPU, 0.9, 3);
    auto tail = optimizer_trace(opt, "loop", torch::kCPU, 0.9, 3, std::move(o), 3,
                                std::vector<at::Tensor>(head.end() - 5, head.end()))
                    .first;
    std::vector<at::Tensor> tail_whole(whole.begin() + 15, whole.end()), tail_only(tail.begin(), tail.end());
    if (opt == "sgd") CHECK(same_bits(tail_only, tail_whole));
    else CHECK(trace_diff(tail_only, tail_whole) < 1e-6);
  }
  optim::OptimizerArgs a;
  a.impl = "fastest";
  auto w = torch::zeros({2}, torch::requires_grad());
  CHECK_THROWS_WITH(optim::create_optimizer(a, {{"w", w}}), Catch::Contains("unknown optimizer implementation"));
}

TEST_CASE("RMSpropTF, LAMB and LARS step a parameter in one pass, bit for bit their loops", "[optim]") {
  const torch::Device cpu(torch::kCPU);
  for (auto dtype : {at::kFloat, at::kDouble})
    for (std::string opt : {"rmsproptf", "lamb", "lambc", "lars", "larc", "nlars", "nlarc"})
      for (double momentum : {0.9, 0.0}) {
        if (opt.find("lamb") != std::string::npos && momentum == 0) continue;  // no momentum in LAMB
        INFO(opt << " momentum " << momentum << " " << dtype);
        auto [loop, lo] = optimizer_trace(opt, "loop", cpu, momentum, 6, nullptr, 0, {}, true, dtype);
        std::pair<std::vector<at::Tensor>, std::unique_ptr<optim::Optimizer>> fast;
        const auto ran = ops_called([&] { fast = optimizer_trace(opt, "auto", cpu, momentum, 6, nullptr, 0, {}, true, dtype); });
        // a second implementation ran, not the loop again
        const std::string kernel = opt == "rmsproptf" ? "imgtrain::rmsprop_tf_step"
                                   : opt.find("lamb") != std::string::npos ? "imgtrain::lamb_moments"
                                                                           : "imgtrain::lars_sgd_step";
        CHECK(ran.count(kernel) == 1);
        CHECK(same_bits(fast.first, loop));
        // and left the state the loop leaves (a resumed run continues either way)
        std::vector<at::Tensor> st_loop, st_fast;
        for (auto& [k, t] : lo->state()) st_loop.push_back(t);
        for (auto& [k, t] : fast.second->state()) st_fast.push_back(t);
        CHECK(same_bits(st_fast, st_loop));
      }
}

TEST_CASE("damaged optimizer state in a checkpoint is refused by name", "[optim][fault]") {
  for (std::string opt : {"sgd", "adamw"}) {
    INFO(opt);
    auto [trace, o] = optimizer_trace(opt, "auto", torch::kCPU, 0.9, 2);
    std::map<std::string, at::Tensor> good;
    for (auto& [k, t] : o->state()) good[k] = t;
    const std::string buf = opt == "sgd" ? "fc.weight.momentum_buffer" : "fc.weight.exp_avg";
    REQUIRE(good.count(buf));
    auto load = [&](const std::string& key, at::Tensor t) {
      auto st = good;
      st[key] = t;
      optim::OptimizerArgs a;
      a.opt = opt;
      a.momentum = 0.9;
      auto named = std::vector<std::pair<std::string, at::Tensor>>{};
      for (auto& [k, v] : std::map<std::string, std::vector<int64_t>>{
               {"conv.weight", {8, 4, 3, 3}}, {"conv2.weight", {6, 4, 3, 3}}, {"fc.weight", {10, 7}},
               {"fc.bias", {10}}, {"late.weight", {5, 5}}})
        named.emplace_back(k, torch::zeros(v, torch::requires_grad()));
      optim::create_optimizer(a, named)->load_state(st);
    };
    CHECK_NOTHROW(load(buf, good[buf]));
    CHECK_THROWS_WITH(load(buf, torch::zeros({1, 7})),
                      Catch::Contains("optimizer state '" + buf + "' has shape 1x7, but the parameter 'fc.weight' has 10x7"));
    auto nan = good[buf].clone();
    nan[3][2] = std::nan("");
    CHECK_THROWS_WITH(load(buf, nan), Catch::Contains("optimizer state '" + buf + "' holds NaN or infinite values"));
    CHECK_THROWS_WITH(load(buf, torch::zeros({10, 7}, torch::kInt64)), Catch::Contains("not floating point"));
    if (opt == "adamw") {
      auto neg = good["fc.weight.exp_avg_sq"].clone();
      neg[1][1] = -1.0;
      CHECK_THROWS_WITH(load("fc.weight.exp_avg_sq", neg),
                        Catch::Contains("optimizer state 'fc.weight.exp_avg_sq' holds negative values"));
      CHECK_THROWS_WITH(load("fc.weight.step", torch::tensor(-1.0, torch::kFloat64)),
                        Catch::Contains("optimizer state 'fc.weight.step' is not a step count"));
      CHECK_THROWS_WITH(load("fc.weight.step", torch::tensor(2.5, torch::kFloat64)), Catch::Contains("step count"));
    }
  }
}

TEST_CASE("CUDA: fused and multi-tensor optimizer steps equal the loops on the device", "[cuda][optim]") {
  test::skip_unless(torch::cuda::is_available());
  fused_optimizers_agree(torch::Device(torch::kCUDA, 0), 1e-6);
}

namespace {

// timm's RandomErasing per sample on HWC images through the cv::Mat path (the one the augment
// parity tests hold to timm), with each sample's generator as the batch version seeds it.
at::Tensor erase_per_image(const at::Tensor& x, const at::Tensor& indices, const data::RandomErasingConfig& c,
                           uint64_t seed, int64_t epoch) {
  auto host = x.to(torch::kCPU).permute({0, 2, 3, 1}).contiguous().clone();
  for (int64_t i = 0; i < host.size(0); ++i) {
    cv::Mat m(int(host.size(1)), int(host.size(2)), CV_32FC(int(host.size(3))), host[i].data_ptr<float>());
    auto rng = sample_rng(seed ^ 0x657261736500ull, uint64_t(epoch), uint64_t(indices[i].item<int64_t>()));
    data::random_erasing(m, c, rng);
  }
  return host.permute({0, 3, 1, 2});
}

// Every mode, one and three rectangles, both memory formats, grey and RGB: the batch erased where it
// lives equals the per-image path bit for bit. Returns how many cases erased something.
int erasing_matches(torch::Device dev) {
  int erased = 0;
  for (auto mode : {data::EraseMode::Const, data::EraseMode::Rand, data::EraseMode::Pixel})
    for (int count : {1, 3})
      for (int64_t ch : {3, 1})
        for (bool cl : {false, true}) {
          data::RandomErasingConfig c;
          c.mode = mode;
          c.probability = 0.7;
          c.max_count = count;
          torch::manual_seed(5);
          auto x = torch::randn({6, ch, 20, 24});
          auto indices = torch::tensor({3, 17, 4, 99, 0, 12}, torch::kLong);
          const auto want = erase_per_image(x, indices, c, 42, 2);
          auto y = x.clone().to(dev);
          if (cl) y = y.contiguous(at::MemoryFormat::ChannelsLast);
          auto got = tasks::random_erase(y, indices, c, 42, 2);
          INFO("mode " << int(mode) << " count " << count << " channels " << ch << " channels_last " << cl);
          CHECK(got.data_ptr() == y.data_ptr());  // in place
          CHECK(torch::equal(got.to(torch::kCPU), want));
          erased += !torch::equal(want, x);
        }
  return erased;
}

}  // namespace

TEST_CASE("random erasing of a batch where it lives equals timm's per-image erasing", "[data]") {
  CHECK(erasing_matches(torch::Device(torch::kCPU)) == 24);  // p 0.7 over 6 samples: every case erases
  // probability 0: nothing drawn beyond the coin, nothing written
  data::RandomErasingConfig off;
  off.probability = 0;
  auto x = torch::randn({2, 3, 8, 8});
  CHECK(torch::equal(tasks::random_erase(x.clone(), torch::tensor({0, 1}, torch::kLong), off, 1, 0), x));
}

TEST_CASE("CUDA: random erasing on the device equals the host's", "[cuda][data]") {
  test::skip_unless(torch::cuda::is_available());
  CHECK(erasing_matches(torch::Device(torch::kCUDA, 0)) == 24);
}

TEST_CASE("a data-parallel process's CUDA device: its local rank's, or the one device a launcher left visible",
          "[engine]") {
  CHECK(engine::local_cuda_index(0, 8, false) == 0);
  CHECK(engine::local_cuda_index(5, 8, false) == 5);
  CHECK(engine::local_cuda_index(3, 8, true) == 3);
  // SLURM --gpus-per-task 1: SLURM_LOCALID 3, one device visible through CUDA_VISIBLE_DEVICES
  CHECK(engine::local_cuda_index(3, 1, true) == 0);
  CHECK_THROWS_WITH(engine::local_cuda_index(3, 1, false),
                    Catch::Contains("LOCAL_RANK 3: only 1 CUDA device(s)") && Catch::Contains("CUDA_VISIBLE_DEVICES"));
  CHECK_THROWS_AS(engine::local_cuda_index(3, 2, true), UserError);  // two visible: a real mismatch
  CHECK_THROWS_AS(engine::local_cuda_index(1, 0, true), UserError);
  engine::make_current(torch::Device(torch::kCPU));  // nothing to do for the CPU
}

TEST_CASE("CUDA: a checkpoint keeps the device generator, so a resumed run draws what the run would have",
          "[cuda][engine]") {
  test::skip_unless(torch::cuda::is_available());
  const torch::Device dev(torch::kCUDA, 0);
  test::TempDir d("cudarng");
  auto g = at::globalContext().defaultGenerator(dev);
  torch::manual_seed(7);
  torch::rand({3}, dev);  // advance past the seed
  engine::TrainStateRefs s;
  s.rng_cpu = at::detail::getDefaultCPUGenerator().get_state();
  s.rng_cuda = g.get_state();
  engine::CheckpointMeta meta;
  meta.arch = "resnet18";
  meta.epoch = 0;
  meta.num_updates = 1;
  engine::write_checkpoint(d / "c.safetensors", meta, s);
  const auto want = torch::rand({1000}, dev);
  torch::rand({50}, dev);  // the run goes on; the resume must not see these draws
  const auto ck = engine::Checkpoint::read(d / "c.safetensors");
  const at::Tensor* state = ck.find("rng.cuda");
  REQUIRE(state);
  g.set_state(*state);
  CHECK(torch::equal(torch::rand({1000}, dev).cpu(), want.cpu()));
}

TEST_CASE("inference fusion: BatchNorm folded into the convolutions equals the modules within float rounding",
          "[models]") {
  // every block shape of the zoo's BatchNorm families: basic / bottleneck blocks with and without
  // a downsample, avg-down + deep stem (resnet50d), depthwise-separable and inverted-residual
  // blocks with SE and residual, ReLU / ReLU6 / Swish / hard-swish, TF 'same' padding
  for (const char* name : {"resnet18", "resnet50d", "efficientnet_b0", "tf_efficientnet_b0", "mobilenetv3_large_100",
                           "mobilenetv2_100"}) {
    for (bool cl : {false, true}) {
      INFO(name << (cl ? " channels-last" : " NCHW"));
      torch::manual_seed(0);
      ModelArgs a;
      a.num_classes = 10;
      auto m = model_zoo::create_model(name, a);
      std::vector<BatchNorm2dImpl*> bns;
      {
        torch::NoGradGuard ng;  // statistics and affine far from the identity, so a wrong fold shows
        for (auto& mod : m->modules())
          if (auto* bn = dynamic_cast<BatchNorm2dImpl*>(mod.get())) {
            bns.push_back(bn);
            bn->running_mean.uniform_(-0.3, 0.3);
            bn->running_var.uniform_(0.3, 2.0);
            bn->weight.uniform_(0.5, 1.5);
            bn->bias.uniform_(-0.3, 0.3);
          }
      }
      m->eval();
      if (cl) engine::to_channels_last(*m);
      auto x = torch::randn({3, 3, 64, 64});
      if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      // 32 px as well: the last stages' maps are 1x1, where NCHW and NHWC strides coincide
      auto xs = torch::randn({2, 3, 32, 32});
      if (cl) xs = xs.contiguous(at::MemoryFormat::ChannelsLast);
      torch::NoGradGuard ng;
      const auto ref = m->forward(x);
      const auto ref_s = m->forward(xs);
      const auto ref_f = m->forward_intermediates(x, {0, 1, 2, 3, 4});
      const auto x_before = x.clone();
      set_inference_fusion(*m, true);
      const auto y = m->forward(x);
      // residuals are summed into in place only where nothing else holds them: never the input,
      // never a feature level that forward_intermediates has collected
      CHECK(torch::equal(x, x_before));
      const auto f = m->forward_intermediates(x, {0, 1, 2, 3, 4});
      REQUIRE(f.size() == ref_f.size());
      CHECK(f.size() == 5);
      for (size_t i = 0; i < f.size(); ++i) {
        INFO("feature " << i);
        CHECK((f[i] - ref_f[i]).abs().max().item<double>() <= 1e-4 * ref_f[i].abs().max().item<double>());
      }
      size_t folded = 0;
      for (auto* bn : bns) folded += bn->folded_weight.defined();
      CHECK(folded == bns.size());
      const double scale = ref.abs().max().item<double>();
      CHECK((y - ref).abs().max().item<double>() <= 1e-4 * scale);
      CHECK_FALSE(torch::equal(y, ref));  // the fused kernels did run
      // every convolution a oneDNN fused op, or imgtrain's Winograd kernel for the ResNets' 3x3
      // stride-1 convolutions without a residual (their inputs are channels-last in either layout:
      // oneDNN's stem, its weight in oneDNN's own layout, writes channels-last); squeeze-and-excite's
      // two on the pooled map as GEMMs
      const auto ran = ops_called([&] { m->forward(x); });
      CHECK_FALSE(ran.count("aten::conv2d"));
      CHECK(ran.count("imgtrain::winograd_conv3x3") == size_t(std::string(name).rfind("resnet", 0) == 0));
      // another batch size
      const auto y2 = m->forward(x.slice(0, 0, 2));
      CHECK((y2 - ref.slice(0, 0, 2)).abs().max().item<double>() <= 1e-4 * scale);
      // another image size with the weights folded (and laid out) for the first
      CHECK((m->forward(xs) - ref_s).abs().max().item<double>() <= 1e-4 * ref_s.abs().max().item<double>());
      {  // a forward that records autograd never fuses: bitwise the modules
        torch::AutoGradMode on(true);
        CHECK(torch::equal(m->forward(x), ref));
      }
      set_inference_fusion(*m, false);
      CHECK(torch::equal(m->forward(x), ref));
      for (auto* bn : bns) CHECK_FALSE(bn->folded_weight.defined());
    }
  }
}

TEST_CASE("Winograd's F(2x2, 3x3) and F(4x4, 3x3) convolutions equal a float64 convolution as closely as ATen's float one",
          "[ops]") {
  // odd and even map sizes (partial tiles at the right and bottom edges), 1x1 maps, channel counts
  // off the 16-float vectors (the scalar tails), with and without ReLU, on one and two threads
  struct Case {
    int64_t n, c, k, h, w;
  };
  const int threads = at::get_num_threads();
  for (const Case cs : {Case{3, 20, 36, 7, 10}, Case{2, 32, 48, 8, 8}, Case{2, 64, 64, 1, 1}, Case{1, 17, 33, 2, 3},
                        Case{4, 48, 32, 13, 5}, Case{2, 128, 96, 12, 16}}) {
    for (int tile : {2, 4})
    for (bool relu : {false, true})
      for (int t : {1, 2}) {
        INFO("tile " << tile << " n " << cs.n << " c " << cs.c << " k " << cs.k << " " << cs.h << "x" << cs.w << " relu " << relu << " threads " << t);
        at::set_num_threads(t);
        torch::manual_seed(1);
        const auto x = torch::randn({cs.n, cs.c, cs.h, cs.w}).contiguous(at::MemoryFormat::ChannelsLast);
        const auto w = torch::randn({cs.k, cs.c, 3, 3}) / std::sqrt(9.0 * double(cs.c));
        const auto b = torch::randn({cs.k}) * 0.1;
        const auto U = ops::winograd_pack_3x3(w, tile);
        REQUIRE(U.size(0) == (tile == 2 ? 16 : 52));  // 4: F(4x4)'s, then F(2x2)'s for the edges
        REQUIRE(ops::winograd_conv3x3_supported(x, U));
        const auto r = torch::randn({cs.n, cs.k, cs.h, cs.w}).contiguous(at::MemoryFormat::ChannelsLast);
        for (bool with_residual : {false, true}) {
          INFO("residual " << with_residual);
          const auto y = ops::winograd_conv3x3(x, U, b, relu, with_residual ? r : at::Tensor());
          CHECK(y.sizes() == torch::IntArrayRef{cs.n, cs.k, cs.h, cs.w});
          CHECK(y.is_contiguous(at::MemoryFormat::ChannelsLast));
          auto ref = torch::conv2d(x.to(torch::kDouble), w.to(torch::kDouble), b.to(torch::kDouble), 1, 1);
          auto aten = torch::conv2d(x, w, b, 1, 1);
          if (with_residual) ref += r.to(torch::kDouble), aten += r;
          if (relu) ref.relu_(), aten.relu_();
          const double scale = ref.abs().max().item<double>();
          const double err = (y.to(torch::kDouble) - ref).abs().max().item<double>() / scale;
          const double err_aten = (aten.to(torch::kDouble) - ref).abs().max().item<double>() / scale;
          // F(4x4)'s transforms have larger coefficients (up to 8 where F(2x2)'s are 1): about 2x
          // oneDNN's error at ResNet's widths (bench/winograd_parts.cpp) where F(2x2)'s is a third of it
          CHECK(err <= (tile == 2 ? std::max(4 * err_aten, 1e-6) : std::max(8 * err_aten, 4e-6)));
          if (relu) CHECK(y.min().item<float>() >= 0.0f);
          if (with_residual) {  // summed into the residual's memory: the same numbers
            auto into = r.clone();
            const auto y2 = ops::winograd_conv3x3(x, U, b, relu, into, true);
            CHECK(y2.data_ptr() == into.data_ptr());
            CHECK(torch::equal(y2, y));
          }
        }
      }
  }
  {  // the tile for ResNet-50's stride-1 3x3 convolutions at batch 8, 224 px, on two threads: 4x4 on
     // the 56x56, 28x28 and 14x14 maps (there 3x3 of them and 2x2 tiles on the last two rows and
     // columns), 2x2 at 512 channels
    at::set_num_threads(2);
    CHECK(ops::winograd_tile(8, 56, 56, 64, 64) == 4);
    CHECK(ops::winograd_tile(8, 28, 28, 128, 128) == 4);
    CHECK(ops::winograd_tile(8, 14, 14, 256, 256) == 4);
    CHECK(ops::winograd_tile(8, 7, 7, 512, 512) == 2);
    CHECK(ops::winograd_tile(8, 7, 7, 64, 64) == 2);    // one 4x4 tile and 12 2x2 ones: 0.89 of 2x2 tiles
    CHECK(ops::winograd_tile(1, 30, 30, 64, 64) == 4);
    CHECK(ops::winograd_tile(1, 8, 8, 64, 64) == 2);    // 4 tiles of 4x4: too few for two threads
    CHECK(ops::winograd_tile(0, 56, 56, 64, 64) == 2);  // an empty batch
    CHECK_THROWS(ops::winograd_pack_3x3(torch::randn({8, 8, 3, 3}), 3));
  }
  at::set_num_threads(threads);
  {  // an empty batch; a residual of another shape is refused, also in place
    const auto w = torch::randn({32, 32, 3, 3});
    const auto U = ops::winograd_pack_3x3(w);
    const auto x0 = torch::randn({0, 32, 6, 6}).contiguous(at::MemoryFormat::ChannelsLast);
    CHECK(ops::winograd_conv3x3(x0, U, torch::zeros({32}), true).sizes() == torch::IntArrayRef{0, 32, 6, 6});
    const auto x = torch::randn({1, 32, 6, 6}).contiguous(at::MemoryFormat::ChannelsLast);
    const auto r = torch::randn({1, 32, 6, 5}).contiguous(at::MemoryFormat::ChannelsLast);
    CHECK_THROWS(ops::winograd_conv3x3(x, U, torch::zeros({32}), true, r));
    CHECK_THROWS(ops::winograd_conv3x3(x, U, torch::zeros({32}), true, r, true));
    // no bias (undefined) is a zero bias; a bias of another size is refused
    const auto x2 = torch::randn({2, 32, 7, 9}).contiguous(at::MemoryFormat::ChannelsLast);
    CHECK(torch::equal(ops::winograd_conv3x3(x2, U, {}, false), ops::winograd_conv3x3(x2, U, torch::zeros({32}), false)));
    CHECK_THROWS(ops::winograd_conv3x3(x2, U, torch::zeros({31}), false));
  }
  // inputs it does not take: NCHW memory with maps over 1x1, float64, filters for other channels, a
  // residual of another shape or in NCHW memory (other devices' tensors aside)
  const auto cl = at::MemoryFormat::ChannelsLast;
  const auto U = ops::winograd_pack_3x3(torch::randn({48, 32, 3, 3}));
  const auto x = torch::randn({1, 32, 4, 4}).contiguous(cl);
  CHECK(ops::winograd_conv3x3_supported(x, U, torch::randn({1, 48, 4, 4}).contiguous(cl)));
  CHECK_FALSE(ops::winograd_conv3x3_supported(torch::randn({1, 32, 4, 4}), U));
  CHECK_FALSE(ops::winograd_conv3x3_supported(torch::randn({1, 32, 4, 4}, torch::kDouble).contiguous(cl), U));
  CHECK_FALSE(ops::winograd_conv3x3_supported(torch::randn({1, 16, 4, 4}).contiguous(cl), U));
  CHECK_FALSE(ops::winograd_conv3x3_supported(x, U, torch::randn({1, 32, 4, 4}).contiguous(cl)));
  CHECK_FALSE(ops::winograd_conv3x3_supported(x, U, torch::randn({1, 48, 4, 4})));
}

// Whether this build and CPU run imgtrain's AVX-512 attention kernel (ops/attention.h).
bool attention_kernel_expected() {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  return __builtin_cpu_supports("fma") && (__builtin_cpu_supports("avx512f") || __builtin_cpu_supports("avx2"));
#else
  return false;
#endif
}

// Runs each copy of the attention kernels this CPU has (AVX-512, AVX2, and AVX-512's blocking on
// AVX2 registers) in turn, the default restored after.
struct EachAttentionVariant {
  std::vector<std::string> variants = ops::attention_kernel_variants();
  ~EachAttentionVariant() { ops::use_attention_kernels(""); }
};

TEST_CASE("the attention kernels' copies: the CPU's fastest by default, each selectable", "[ops]") {
  const auto variants = ops::attention_kernel_variants();
  CHECK(variants.empty() == !attention_kernel_expected());
  if (variants.empty()) return;
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
  CHECK(variants.front() == (__builtin_cpu_supports("avx512f") ? "avx512" : "avx2"));
#endif
  CHECK(ops::attention_kernel_variant() == variants.front());
  for (const auto& v : variants) {
    ops::use_attention_kernels(v);
    CHECK(ops::attention_kernel_variant() == v);
  }
  ops::use_attention_kernels("");
  CHECK(ops::attention_kernel_variant() == variants.front());
  CHECK_THROWS_WITH(ops::use_attention_kernels("sse9"), Catch::Contains("no variant 'sse9'"));
}

TEST_CASE("the kernels' aligned scratch starts on 64-byte boundaries", "[ops]") {
  for (size_t n : {1, 3, 16, 1000, 123457}) {
    ops::AlignedVector<float> v(n, 1.0f);
    CHECK(reinterpret_cast<std::uintptr_t>(v.data()) % 64 == 0);
    v.resize(n * 3 + 5);  // and after it grows
    CHECK(reinterpret_cast<std::uintptr_t>(v.data()) % 64 == 0);
    CHECK(v[0] == 1.0f);
  }
}

TEST_CASE("the inference attention kernel equals scaled_dot_product_attention over qkv's output", "[ops]") {
  torch::NoGradGuard ng;
  const auto valid = torch::randn({2, 5, 3 * 64});
  REQUIRE(ops::attention_infer_supported(valid, 1) == attention_kernel_expected());
  if (!attention_kernel_expected()) return;  // elsewhere ViT keeps ATen's kernel (the model tests)
  // ATen's kernel on the same qkv, as timm's Attention calls it
  auto sdpa = [](const at::Tensor& qkv, int64_t heads) {
    const int64_t b = qkv.size(0), n = qkv.size(1), c = qkv.size(2) / 3;
    const auto p = qkv.reshape({b, n, 3, heads, c / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
    return at::scaled_dot_product_attention(p[0], p[1], p[2]).transpose(1, 2).reshape({b, n, c});
  };
  EachAttentionVariant each;
  for (const auto& variant : each.variants) {
  INFO("kernels " << variant);
  ops::use_attention_kernels(variant);
  torch::manual_seed(3);
  // token counts around the kernel's blocks: rows of 6, key panels of 64 and 16 (AVX2: blocks of 16
  // keys, vectors of 8), value chunks of 64
  for (int64_t n : {1, 5, 6, 8, 9, 16, 17, 24, 25, 50, 64, 65, 80, 197})
    for (int64_t heads : {1, 3})
      for (double sigma : {1.0, 4.0}) {  // 4: peaked rows, most probabilities far below the largest
        INFO("tokens " << n << " heads " << heads << " sigma " << sigma);
        const auto qkv = torch::randn({2, n, 3 * heads * 64}) * sigma;
        REQUIRE(ops::attention_infer_supported(qkv, heads));
        const auto got = ops::attention_infer(qkv, heads), want = sdpa(qkv, heads);
        REQUIRE(got.sizes() == want.sizes());
        CHECK(got.is_contiguous());
        CHECK((got - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>()));
      }
  // each image and head on one thread: the same bits on one thread and on two
  const auto qkv = torch::randn({4, 197, 3 * 6 * 64});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = ops::attention_infer(qkv, 6);
  at::set_num_threads(2);
  const auto two = ops::attention_infer(qkv, 6);
  at::set_num_threads(threads);
  CHECK(torch::equal(one, two));
  // a NaN in one query: that token's output is NaN in that head, as ATen's
  auto bad = torch::randn({1, 20, 3 * 2 * 64});
  bad[0][7][64 + 3] = std::nanf("");  // head 1's query of token 7
  const auto nan_got = ops::attention_infer(bad, 2).isnan(), nan_want = sdpa(bad, 2).isnan();
  CHECK(torch::equal(nan_got, nan_want));
  CHECK(nan_got.sum().item<int64_t>() == 64);
  }
  // what it does not take: the caller keeps ATen's kernel
  CHECK_FALSE(ops::attention_infer_supported(valid.to(at::kDouble), 1));
  CHECK_FALSE(ops::attention_infer_supported(torch::randn({2, 3 * 64, 5}).transpose(1, 2), 1));  // strided
  CHECK_FALSE(ops::attention_infer_supported(torch::randn({2, 5, 3 * 2 * 32}), 2));              // head size 32
  CHECK_FALSE(ops::attention_infer_supported(valid, 2));
  CHECK_FALSE(ops::attention_infer_supported(valid[0], 1));  // [N, 3C]
  CHECK(ops::attention_infer_supported(torch::randn({1, 1024, 3 * 64}), 1));
  CHECK_FALSE(ops::attention_infer_supported(torch::randn({1, 1025, 3 * 64}), 1));  // ATen's, faster there
  {
    torch::AutoGradMode on(true);
    CHECK_FALSE(ops::attention_infer_supported(valid.clone().requires_grad_(), 1));
  }
}

TEST_CASE("the training attention kernel's output and qkv gradient equal scaled_dot_product_attention's", "[ops]") {
  const auto probe = torch::randn({1, 5, 3 * 64}).requires_grad_();
  REQUIRE(ops::attention_train_supported(probe, 1) == attention_kernel_expected());
  if (!attention_kernel_expected()) return;
  EachAttentionVariant each;
  for (const auto& variant : each.variants) {
  INFO("kernels " << variant);
  ops::use_attention_kernels(variant);
  torch::manual_seed(5);
  auto grads = [](const at::Tensor& qkv0, int64_t heads, bool ours, const at::Tensor& go) {
    auto qkv = qkv0.clone().requires_grad_();
    at::Tensor o;
    if (ours) {
      o = ops::attention_train(qkv, heads);
    } else {
      const int64_t b = qkv.size(0), n = qkv.size(1), c = qkv.size(2) / 3;
      const auto p = qkv.reshape({b, n, 3, heads, c / heads}).permute({2, 0, 3, 1, 4}).unbind(0);
      o = at::scaled_dot_product_attention(p[0], p[1], p[2]).transpose(1, 2).reshape({b, n, c});
    }
    o.backward(go);
    return std::make_pair(o.detach(), qkv.grad());
  };
  for (int64_t n : {1, 5, 9, 17, 64, 65, 197})
    for (double sigma : {1.0, 3.0}) {
      INFO("tokens " << n << " sigma " << sigma);
      const auto qkv = torch::randn({2, n, 3 * 2 * 64}) * sigma, go = torch::randn({2, n, 2 * 64});
      const auto [o1, g1] = grads(qkv, 2, true, go);
      const auto [o2, g2] = grads(qkv, 2, false, go);
      CHECK((o1 - o2).abs().max().item<double>() <= 1e-5 * std::max(1.0, o2.abs().max().item<double>()));
      REQUIRE(g1.sizes() == g2.sizes());
      const double gscale = std::max(1.0, g2.abs().max().item<double>());
      for (int part = 0; part < 3; ++part) {  // q, k and v's gradients
        INFO("part " << part);
        const auto a = g1.slice(2, part * 128, (part + 1) * 128), b = g2.slice(2, part * 128, (part + 1) * 128);
        CHECK((a - b).abs().max().item<double>() <= 2e-5 * gscale);
      }
    }
  // the same bits on one thread and on two
  const auto qkv = torch::randn({2, 50, 3 * 6 * 64}), go = torch::randn({2, 50, 6 * 64});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = grads(qkv, 6, true, go).second;
  at::set_num_threads(2);
  const auto two = grads(qkv, 6, true, go).second;
  at::set_num_threads(threads);
  CHECK(torch::equal(one, two));
  }
}

TEST_CASE("ViT's training step with its attention kernels equals the modules' within float rounding", "[models]") {
  auto run = [](bool fuse, std::set<std::string>* names) {
    torch::manual_seed(6);
    ModelArgs a;
    a.num_classes = 5;
    a.img_size = 64;  // 17 tokens
    auto m = model_zoo::create_model("vit_tiny_patch16_224", a);
    set_training_fusion(*m, fuse);
    m->train();
    const auto x = torch::randn({2, 3, 64, 64});
    at::Tensor y;
    auto step = [&] {
      y = m->forward(x);
      torch::nn::functional::cross_entropy(y, torch::tensor({1, 3})).backward();
    };
    if (names) *names = ops_called(step);
    else step();
    std::vector<std::pair<std::string, at::Tensor>> out{{"logits", y.detach()}};
    for (auto& p : m->named_parameters()) out.emplace_back("grad " + p.key(), p.value().grad());
    return out;
  };
  std::set<std::string> names;
  const auto ref = run(false, nullptr), fused = run(true, &names);
  CHECK(names.count("imgtrain::attention_forward") == (attention_kernel_expected() ? 1u : 0u));
  CHECK(names.count("imgtrain::attention_backward") == (attention_kernel_expected() ? 1u : 0u));
  REQUIRE(ref.size() == fused.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    INFO(ref[i].first);
    const double scale = std::max(1e-3, ref[i].second.abs().max().item<double>());
    CHECK((fused[i].second - ref[i].second).abs().max().item<double>() <= 1e-4 * scale);
  }
}

// The token counts (dim 1 of the first input) of every aten::layer_norm `f` calls on this thread.
std::vector<int64_t> layer_norm_tokens(const std::function<void()>& f) {
  static thread_local std::vector<int64_t>* out = nullptr;
  std::vector<int64_t> tokens;
  out = &tokens;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& r) -> std::unique_ptr<at::ObserverContext> {
        if (out && std::string(r.name()) == "aten::layer_norm" && !r.inputs().empty() && r.inputs()[0].isTensor())
          out->push_back(r.inputs()[0].toTensor().size(1));
        return nullptr;
      }).needsInputs(true));
  f();
  at::removeCallback(handle);
  out = nullptr;
  return tokens;
}

TEST_CASE("ViT's logits with class-token pooling skip the last block's other rows and equal the whole forward's",
          "[models]") {
  ModelArgs a;
  a.num_classes = 5;
  a.img_size = 64;  // 17 tokens
  a.drop_path_rate = 0.2;
  const auto x = torch::randn({3, 3, 64, 64});
  auto close = [](const at::Tensor& got, const at::Tensor& ref) {
    const double scale = std::max(1e-3, ref.abs().max().item<double>());
    return (got - ref).abs().max().item<double>() <= 1e-4 * scale;
  };
  SECTION("eval, with and without inference fusion") {
    torch::manual_seed(2);
    auto m = model_zoo::create_model("vit_tiny_patch16_224", a);
    m->eval();
    torch::NoGradGuard ng;
    for (bool fuse : {false, true}) {
      INFO("inference fusion " << fuse);
      set_inference_fusion(*m, fuse);
      const auto ref = m->forward_head(m->forward_features(x));
      at::Tensor y;
      const auto tokens = layer_norm_tokens([&] { y = m->forward(x); });
      CHECK(close(y, ref));
      // 12 blocks' norm1 over 17 tokens, 11 norm2 over 17, the last norm2 and the final norm over 1
      REQUIRE(tokens.size() == 25u);
      CHECK(std::count(tokens.begin(), tokens.end(), int64_t(1)) == 2);
      CHECK(std::count(tokens.begin(), tokens.end(), int64_t(17)) == 23);
    }
  }
  SECTION("training with drop path, with and without the attention kernels: logits and gradients") {
    for (bool fuse : {false, true}) {
      INFO("training fusion " << fuse);
      auto run = [&](bool whole) {
        torch::manual_seed(3);
        auto m = model_zoo::create_model("vit_tiny_patch16_224", a);
        set_training_fusion(*m, fuse);
        m->train();
        torch::manual_seed(4);  // the same drop-path draws: one [B, 1, 1] mask per branch, in block order
        const auto y = whole ? m->forward_head(m->forward_features(x)) : m->forward(x);
        torch::nn::functional::cross_entropy(y, torch::tensor({1, 3, 0})).backward();
        std::vector<std::pair<std::string, at::Tensor>> out{{"logits", y.detach()}};
        for (auto& p : m->named_parameters()) out.emplace_back("grad " + p.key(), p.value().grad());
        return out;
      };
      const auto ref = run(true), got = run(false);
      REQUIRE(ref.size() == got.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO(ref[i].first);
        REQUIRE(got[i].second.defined());
        CHECK(close(got[i].second, ref[i].second));
      }
    }
  }
  SECTION("average pooling reads every token: the whole forward, bit for bit") {
    a.global_pool = "avg";
    torch::manual_seed(2);
    auto m = model_zoo::create_model("vit_tiny_patch16_224", a);
    m->eval();
    torch::NoGradGuard ng;
    const auto ref = m->forward_head(m->forward_features(x));
    at::Tensor y;
    const auto tokens = layer_norm_tokens([&] { y = m->forward(x); });
    CHECK(torch::equal(y, ref));
    CHECK(std::count(tokens.begin(), tokens.end(), int64_t(1)) == 0);
  }
}

TEST_CASE("inference fusion of ViT and ConvNeXt: GELU and residual adds as linear post-ops, equal within rounding",
          "[models]") {
  for (const char* name : {"vit_tiny_patch16_224", "convnext_tiny"}) {
    INFO(name);
    torch::manual_seed(0);
    ModelArgs a;
    a.num_classes = 10;
    a.img_size = 64;
    auto m = model_zoo::create_model(name, a);
    {
      torch::NoGradGuard ng;  // a layer scale far from its 1e-6 init, so that a wrong fold shows
      for (auto& p : m->named_parameters())
        if (p.key().find("gamma") != std::string::npos) p.value().uniform_(0.5, 1.5);
    }
    m->eval();
    auto x = torch::randn({2, 3, 64, 64});
    torch::NoGradGuard ng;
    const auto ref = m->forward(x);
    set_inference_fusion(*m, true);
    at::Tensor y;
    const auto names = ops_called([&] { y = m->forward(x); });
    const double scale = ref.abs().max().item<double>();
    CHECK((y - ref).abs().max().item<double>() <= 1e-4 * scale);
    CHECK(names.count("mkldnn::_linear_pointwise"));  // the fused ops did run (their results may
    // equal ATen's to the bit: oneDNN's float32 GEMM and GELU can be the same arithmetic)
    if (std::string(name) == "vit_tiny_patch16_224")
      CHECK(names.count("imgtrain::attention_infer") == (attention_kernel_expected() ? 1u : 0u));
    {  // the patch convolutions (ViT's embedding; ConvNeXt's stem and 3 downsamplings) ran as linears
      set_inference_fusion(*m, false);
      const int plain = op_counts([&] { m->forward(x); })["aten::convolution"];
      set_inference_fusion(*m, true);
      const int fused = op_counts([&] { m->forward(x); })["aten::convolution"];
      CHECK(plain - fused == (std::string(name) == "convnext_tiny" ? 4 : 1));
    }
    {  // a forward that records autograd never fuses
      torch::AutoGradMode on(true);
      CHECK(torch::equal(m->forward(x), ref));
    }
    // channels-last input: ConvNeXt's residual add then runs as fc2's post-op
    const auto xl = x.contiguous(at::MemoryFormat::ChannelsLast);
    set_inference_fusion(*m, false);
    const auto ref_l = m->forward(xl);
    set_inference_fusion(*m, true);
    const auto names_l = ops_called([&] { y = m->forward(xl); });
    CHECK((y - ref_l).abs().max().item<double>() <= 1e-4 * scale);
    if (std::string(name) == "convnext_tiny") CHECK(names_l.count("mkldnn::_linear_pointwise"));
    // weights changed in place between two forwards (an optimizer step between evaluations): the
    // folded copies follow
    for (auto& p : m->named_parameters())
      if (p.key().find("gamma") != std::string::npos || p.key().find("fc2") != std::string::npos ||
          p.key().find("qkv") != std::string::npos || p.key().find("patch_embed.proj.weight") != std::string::npos ||
          p.key().find("stem.0.weight") != std::string::npos ||
          p.key().find("downsample.1.weight") != std::string::npos)
        p.value().mul_(0.7);
    set_inference_fusion(*m, false);
    const auto ref2 = m->forward(xl);
    set_inference_fusion(*m, true);
    y = m->forward(xl);
    CHECK((ref2 - ref_l).abs().max().item<double>() > 1e-3 * scale);  // the change shows
    CHECK((y - ref2).abs().max().item<double>() <= 1e-4 * scale);
    set_inference_fusion(*m, false);
    CHECK(torch::equal(m->forward(xl), ref2));
  }
}

TEST_CASE("a convolution whose kernel is its stride runs as a linear over patches, equal to conv2d", "[models]") {
  using model_zoo::patch_conv_linear;
  using model_zoo::PatchLinearCache;
  torch::NoGradGuard ng;
  torch::manual_seed(0);
  struct Case {
    int64_t in, out, k, hw;
    bool bias;
  };
  for (const auto& c : {Case{3, 96, 4, 32, true}, Case{3, 24, 16, 64, true}, Case{8, 16, 2, 14, false},
                        Case{1, 4, 3, 9, true}}) {
    INFO("in " << c.in << " out " << c.out << " k " << c.k << " bias " << c.bias);
    torch::nn::Conv2d conv(torch::nn::Conv2dOptions(c.in, c.out, c.k).stride(c.k).bias(c.bias));
    const auto x = torch::randn({2, c.in, c.hw, c.hw});
    PatchLinearCache cache;
    for (bool cl : {false, true}) {
      INFO("channels-last input " << cl);
      const auto xi = cl ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
      const auto want = conv(xi);
      const auto got = patch_conv_linear(*conv, xi, &cache);
      REQUIRE(got.defined());
      CHECK(got.sizes() == want.sizes());
      CHECK(got.is_contiguous(at::MemoryFormat::ChannelsLast));
      CHECK((got - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>()));
      CHECK(cache.channels_last == (cl && c.in > 1));  // one channel: NCHW and NHWC are the same memory
    }
    // changed in place: the cached weight follows (the same memory format as the call before, so
    // only the weight's stamp can tell; channels-last's cached weight is a permuted copy)
    conv->weight.mul_(-0.5);
    const auto xl = x.contiguous(at::MemoryFormat::ChannelsLast);
    const auto want = conv(xl), got = patch_conv_linear(*conv, xl, &cache);
    CHECK((got - want).abs().max().item<double>() <= 1e-5 * std::max(1.0, want.abs().max().item<double>()));
  }
  // where it does not apply it says so (undefined) and the caller runs the convolution
  PatchLinearCache cache;
  auto refuses = [&](const torch::nn::Conv2dOptions& o, const at::Tensor& x) {
    torch::nn::Conv2d conv(o);
    return !patch_conv_linear(*conv, x, &cache).defined();
  };
  const auto x = torch::randn({1, 3, 16, 16});
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(2), x));                 // overlapping patches
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4).padding(1), x));      // padding
  CHECK(refuses(torch::nn::Conv2dOptions(3, 6, 4).stride(4).groups(3), x));       // groups
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 5).stride(5), x));                 // 16 not a multiple of 5
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4), x.to(at::kDouble)));  // not float32
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4).dilation(2), x));     // dilation
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, {4, 2}).stride({4, 2}), x));       // not square
  CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4), torch::randn({0, 3, 16, 16})));  // empty batch
  CHECK_FALSE(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4).padding(torch::kValid), x));
  {
    torch::AutoGradMode on(true);  // autograd: the convolution's own backward is wanted
    CHECK(refuses(torch::nn::Conv2dOptions(3, 8, 4).stride(4), x));
  }
}

namespace {
// ConvNeXt-T (10 classes) with its layer scales far from their 1e-6 init, so that a wrong fold or
// a wrong gamma gradient shows in a comparison with the modules
model_zoo::Model convnext_tiny_scaled() {
  ModelArgs a;
  a.num_classes = 10;
  auto m = model_zoo::create_model("convnext_tiny", a);
  torch::NoGradGuard ng;
  for (auto& p : m->named_parameters())
    if (p.key().find("gamma") != std::string::npos) p.value().uniform_(0.5, 1.5);
  return m;
}
}  // namespace

TEST_CASE("bias_gelu_, bias_gelu_keep_ and gelu_grad_: the exact GELU and its gradient as close to float64 as ATen's",
          "[ops]") {
  torch::manual_seed(5);
  // values over GELU's whole range: the tails (erf within rounding of -1 and 1), zero, large inputs
  auto base = torch::cat({torch::randn({64, 200}) * 3, torch::linspace(-12, 12, 64 * 200).reshape({64, 200}),
                          torch::randn({64, 200}) * 40})
                  .reshape({-1, 200});
  base.index_put_({0, 0}, 0.0);
  const auto b = torch::randn({200}) * 0.5;
  const auto truth = at::gelu((base + b).to(torch::kDouble));
  const auto want = at::gelu(base + b);
  auto h = base.clone();
  ops::bias_gelu_(h, b);
  const auto scale = 1.0 + (base + b).abs().to(torch::kDouble);
  const double err_ours = ((h.to(torch::kDouble) - truth).abs() / scale).max().item<double>();
  const double err_aten = ((want.to(torch::kDouble) - truth).abs() / scale).max().item<double>();
  INFO("relative error: ours " << err_ours << ", ATen's " << err_aten);
  CHECK(err_ours <= 1.5 * err_aten + 1e-9);
  CHECK(((h - want).abs() / scale.to(torch::kFloat)).max().item<double>() < 1e-6);
  CHECK(h.index({0, 0}).item<float>() == at::gelu(b.index({0})).item<float>());
  // rows at a stride (a column slice of a wider tensor): the columns outside stay as they were
  auto wide = torch::randn({37, 300});
  auto before = wide.clone();
  ops::bias_gelu_(wide.narrow(1, 50, 200), b);
  CHECK(((wide.narrow(1, 50, 200) - at::gelu(before.narrow(1, 50, 200) + b)).abs().max().item<double>() < 1e-5));
  CHECK(wide.narrow(1, 0, 50).equal(before.narrow(1, 0, 50)));
  CHECK(wide.narrow(1, 250, 50).equal(before.narrow(1, 250, 50)));
  // other dtypes and a transposed h take ATen's ops
  auto hd = base.to(torch::kDouble);
  ops::bias_gelu_(hd, b.to(torch::kDouble));
  CHECK(hd.equal(at::gelu(base.to(torch::kDouble) + b.to(torch::kDouble))));
  auto ht = base.t().contiguous().t();
  ops::bias_gelu_(ht, b);
  CHECK(((ht - want).abs() / scale.to(torch::kFloat)).max().item<double>() < 1e-6);
  auto empty = torch::zeros({0, 200});
  ops::bias_gelu_(empty, b);
  CHECK_THROWS(ops::bias_gelu_(h, torch::randn({199})));

  // training's two: h += b keeping h, gelu(h) returned; and the backward d *= gelu'(h) with gelu(h)
  auto keep = base.clone();
  const auto a = ops::bias_gelu_keep_(keep, b);
  CHECK(keep.equal(base + b));
  CHECK(((a - want).abs() / scale.to(torch::kFloat)).max().item<double>() < 1e-6);
  const auto dy = torch::randn(base.sizes());
  const auto x = base + b;
  const auto grad_truth = at::gelu_backward(dy.to(torch::kDouble), x.to(torch::kDouble));
  const auto grad_aten = at::gelu_backward(dy, x);
  auto d = dy.clone();
  const auto a2 = ops::gelu_grad_(x, d);
  CHECK(a2.equal(a));  // the same arithmetic for the forward in both
  const auto gscale = 1.0 + dy.abs().to(torch::kDouble) * (1.0 + x.abs().to(torch::kDouble));
  const double gerr_ours = ((d.to(torch::kDouble) - grad_truth).abs() / gscale).max().item<double>();
  const double gerr_aten = ((grad_aten.to(torch::kDouble) - grad_truth).abs() / gscale).max().item<double>();
  INFO("gradient's relative error: ours " << gerr_ours << ", ATen's " << gerr_aten);
  CHECK(gerr_ours <= 1.5 * gerr_aten + 1e-9);
  CHECK(((d - grad_aten).abs() / gscale.to(torch::kFloat)).max().item<double>() < 1e-6);
  // float64 and strided inputs through ATen's ops
  auto dd = dy.to(torch::kDouble);
  CHECK(ops::gelu_grad_(x.to(torch::kDouble), dd).equal(at::gelu(x.to(torch::kDouble))));
  CHECK(dd.equal(at::gelu_backward(dy.to(torch::kDouble), x.to(torch::kDouble))));
  auto dt = dy.t().contiguous().t();
  ops::gelu_grad_(x, dt);
  CHECK(((dt - grad_aten).abs() / gscale.to(torch::kFloat)).max().item<double>() < 1e-6);
  CHECK_THROWS(ops::gelu_grad_(x, torch::zeros({3, 3})));
}

TEST_CASE("inference: ConvNeXt's first stages run LayerNorm, MLP and residual on tiles of pixels, equal within rounding",
          "[models][ops]") {
  // the op alone: tiles of one pixel, of 7 (a partial last tile), of a whole image and more;
  // NCHW maps permuted (strided pixels) and channels-last ones (contiguous)
  torch::manual_seed(21);
  const int64_t N = 3, C = 24, D = 96, H = 5, W = 9;
  auto lw = torch::randn({C}), lb = torch::randn({C}), w1 = torch::randn({D, C}) * 0.2, b1 = torch::randn({D}),
       w2 = torch::randn({C, D}) * 0.1, b2 = torch::randn({C});
  for (bool cl : {false, true}) {
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x = torch::randn({N, C, H, W}).contiguous(fmt).permute({0, 2, 3, 1});
    auto r = torch::randn({N, C, H, W}).contiguous(fmt).permute({0, 2, 3, 1});
    torch::NoGradGuard ng;
    const auto want = r + at::linear(at::gelu(at::linear(at::layer_norm(x, {C}, lw, lb, 1e-6), w1, b1)), w2, b2);
    for (int64_t rows : {int64_t(1), int64_t(7), H * W, int64_t(1000)}) {
      INFO("rows " << rows << (cl ? " channels-last" : " NCHW"));
      const auto got = ops::ln_mlp_residual_tiled(x, lw, lb, 1e-6, w1, b1, w2, b2, r, rows);
      CHECK(got.is_contiguous());
      REQUIRE(got.sizes() == want.sizes());
      CHECK((got - want).abs().max().item<double>() < 1e-5 * want.abs().max().item<double>());
    }
  }
  // in the model: at 224 px the first two stages' maps are large enough to be tiled
  auto m = convnext_tiny_scaled();
  m->eval();
  torch::NoGradGuard ng;
  for (bool cl : {false, true}) {
    INFO((cl ? "channels-last" : "NCHW"));
    auto x = torch::randn({1, 3, 224, 224}).contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    set_inference_fusion(*m, false);
    const auto ref = m->forward(x);
    set_inference_fusion(*m, true);
    at::Tensor y;
    const auto names = ops_called([&] { y = m->forward(x); });
    CHECK(names.count("imgtrain::ln_mlp_residual_tiled"));  // the tiles ran
    CHECK((y - ref).abs().max().item<double>() <= 1e-4 * ref.abs().max().item<double>());
  }
}

TEST_CASE("training: ConvNeXt's LayerNorm, MLP, layer scale and residual on tiles, forward and gradients equal the modules",
          "[models][ops]") {
  // the op against the modules' ops through autograd: tiles of one pixel, of 7 (a partial last
  // tile), of a whole image and more; NCHW maps permuted (strided pixels) and channels-last ones;
  // with a drop-path factor per image (one image dropped) and without; float64 to 1e-10, float32
  // to 1e-4 of the largest value
  const int64_t N = 3, C = 24, D = 96, H = 5, W = 9;
  for (auto dtype : {at::kDouble, at::kFloat}) {
    torch::manual_seed(22);
    const auto o = torch::TensorOptions().dtype(dtype);
    auto lw = torch::randn({C}, o), lb = torch::randn({C}, o), w1 = torch::randn({D, C}, o) * 0.2,
         b1 = torch::randn({D}, o), w2 = torch::randn({C, D}, o) * 0.1, b2 = torch::randn({C}, o),
         gamma = torch::rand({C}, o) + 0.5;
    const double tol = dtype == at::kDouble ? 1e-10 : 1e-4;
    for (bool cl : {false, true}) {
      for (bool dropped : {false, true}) {
        auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
        const auto x0 = torch::randn({N, C, H, W}, o).contiguous(fmt), r0 = torch::randn({N, C, H, W}, o).contiguous(fmt);
        const auto g = torch::randn({N, C, H, W}, o).contiguous(fmt);
        const auto scale = dropped ? torch::tensor({2.0, 0.0, 2.0}, o) : at::Tensor();
        auto leaves = [&] {
          std::vector<at::Tensor> v;
          for (const auto& t : {x0, r0, lw, lb, w1, b1, w2, b2, gamma}) v.push_back(t.clone().requires_grad_(true));
          return v;
        };
        auto ref = leaves();
        auto xr = ref[0].permute({0, 2, 3, 1});
        auto branch = at::linear(at::gelu(at::linear(at::layer_norm(xr, {C}, ref[2], ref[3], 1e-6), ref[4], ref[5])),
                                 ref[6], ref[7])
                          .permute({0, 3, 1, 2})
                          .mul(ref[8].reshape({1, -1, 1, 1}));
        if (dropped) branch = branch * scale.reshape({-1, 1, 1, 1});
        const auto want = branch + ref[1];
        want.backward(g);
        for (int64_t rows : {int64_t(1), int64_t(7), H * W, int64_t(1000)}) {
          INFO("rows " << rows << (cl ? " channels-last" : " NCHW") << (dropped ? " drop path" : "") << " "
                       << c10::toString(dtype));
          auto got_l = leaves();
          REQUIRE(ops::ln_mlp_tiled_train_supported(got_l[0].permute({0, 2, 3, 1})));
          const auto got = ops::ln_mlp_residual_tiled_train(got_l[0].permute({0, 2, 3, 1}), got_l[2], got_l[3], 1e-6,
                                                            got_l[4], got_l[5], got_l[6], got_l[7], got_l[8], scale,
                                                            got_l[1].permute({0, 2, 3, 1}), rows)
                               .permute({0, 3, 1, 2});
          CHECK(got.is_contiguous(at::MemoryFormat::ChannelsLast));
          const double m = want.abs().max().item<double>();
          CHECK((got - want).abs().max().item<double>() <= tol * m);
          got.backward(g);
          for (size_t i = 0; i < ref.size(); ++i) {
            INFO("gradient of input " << i);
            REQUIRE(got_l[i].grad().defined());
            REQUIRE(got_l[i].grad().sizes() == ref[i].grad().sizes());
            const double gm = std::max(1e-30, ref[i].grad().abs().max().item<double>());
            CHECK((got_l[i].grad() - ref[i].grad()).abs().max().item<double>() <= tol * gm);
          }
        }
      }
    }
  }
  // the bits do not depend on the number of threads: 40 tiles in 16 fixed groups
  {
    torch::manual_seed(23);
    auto x0 = torch::randn({4, C, 10, 10}), r0 = torch::randn({4, C, 10, 10}), g = torch::randn({4, C, 10, 10});
    auto lw = torch::randn({C}), lb = torch::randn({C}), w1 = torch::randn({D, C}) * 0.2, b1 = torch::randn({D}),
         w2 = torch::randn({C, D}) * 0.1, b2 = torch::randn({C}), gamma = torch::rand({C});
    auto run = [&](int threads) {
      const int before = at::get_num_threads();
      at::set_num_threads(threads);
      std::vector<at::Tensor> l;
      for (const auto& t : {x0, lw, lb, w1, b1, w2, b2, gamma}) l.push_back(t.clone().requires_grad_(true));
      auto y = ops::ln_mlp_residual_tiled_train(l[0].permute({0, 2, 3, 1}), l[1], l[2], 1e-6, l[3], l[4], l[5], l[6],
                                                l[7], at::Tensor(), r0.permute({0, 2, 3, 1}), 10);
      y.backward(g.permute({0, 2, 3, 1}));
      at::set_num_threads(before);
      std::vector<at::Tensor> out = {y};
      for (auto& t : l) out.push_back(t.grad());
      return out;
    };
    const auto one = run(1), two = run(2), three = run(3);
    for (size_t i = 0; i < one.size(); ++i) {
      INFO("tensor " << i);
      CHECK(torch::equal(one[i], two[i]));
      CHECK(torch::equal(one[i], three[i]));
    }
  }
  CHECK_FALSE(ops::ln_mlp_tiled_train_supported(torch::randn({2, 3, 4, 5}).to(at::kBFloat16)));
  CHECK_FALSE(ops::ln_mlp_tiled_train_supported(torch::randn({2, 3, 4, 5}).transpose(1, 2)));
  // in the model: ConvNeXt-T training at 224 px with the fusion on runs the tiles in its first two
  // stages, and its loss and gradients match the modules' (float32, 1e-3 of the largest gradient)
  auto m = convnext_tiny_scaled();
  m->train();
  torch::manual_seed(24);
  const auto x = torch::randn({1, 3, 224, 224});
  auto step = [&](bool fuse) {
    set_training_fusion(*m, fuse);
    for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
    at::Tensor y;
    auto names = ops_called([&] {
      y = m->forward(x);
      y.square().sum().backward();
    });
    std::vector<at::Tensor> gr;
    for (auto& p : m->parameters()) gr.push_back(p.grad().clone());
    return std::make_tuple(y.detach(), gr, names);
  };
  const auto [y_ref, g_ref, n_ref] = step(false);
  const auto [y_got, g_got, n_got] = step(true);
  auto tiles_ran = [](const std::set<std::string>& names) {
    return std::any_of(names.begin(), names.end(),
                       [](const std::string& n) { return n.find("LnMlpTrainFunction") != std::string::npos; });
  };
  CHECK(tiles_ran(n_got));
  CHECK_FALSE(tiles_ran(n_ref));
  CHECK((y_got - y_ref).abs().max().item<double>() <= 1e-4 * y_ref.abs().max().item<double>());
  REQUIRE(g_got.size() == g_ref.size());
  for (size_t i = 0; i < g_ref.size(); ++i) {
    INFO("parameter " << i);
    CHECK((g_got[i] - g_ref[i]).abs().max().item<double>() <= 1e-3 * g_ref[i].abs().max().item<double>() + 1e-12);
  }
  set_training_fusion(*m, false);
}

TEST_CASE("inference fusion sums a residual in place only when nothing else holds it", "[models]") {
  // 8 channels: oneDNN's fused convolution; 32: imgtrain's Winograd kernel
  for (int64_t ch : {8, 32}) {
  INFO(ch << " channels");
  torch::manual_seed(4);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(ch, ch, 3).padding(1).bias(false));
  BatchNorm2d bn(ch);
  {
    torch::NoGradGuard ng;
    bn->running_mean.uniform_(-0.3, 0.3);
    bn->running_var.uniform_(0.3, 2.0);
  }
  conv->eval();
  bn->eval();
  conv->weight.set_data(conv->weight.contiguous(at::MemoryFormat::ChannelsLast));
  set_inference_fusion(*bn, true);
  torch::NoGradGuard ng;
  const auto x = torch::randn({2, ch, 10, 12}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto r = torch::randn({2, ch, 10, 12}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto r_before = r.clone();
  const auto want = torch::relu(bn->forward(conv->forward(x)) + r);
  for (auto act : {model_zoo::Act::ReLU, model_zoo::Act::Identity}) {
    INFO("act " << int(act));
    const auto ref = act == model_zoo::Act::ReLU ? want : bn->forward(conv->forward(x)) + r;
    // passed, not handed over: not written
    auto y = model_zoo::conv_bn_act(*conv, *bn, x, act, r);
    CHECK(torch::equal(r, r_before));
    CHECK((y - ref).abs().max().item<double>() < 1e-5);
    // a view of it held elsewhere: not written
    auto own = r.clone();
    const auto view = own.narrow(1, 0, 4);
    const auto view_before = view.clone();
    y = model_zoo::conv_bn_act(*conv, *bn, x, act, std::move(own));
    CHECK(torch::equal(view, view_before));
    // handed over by its only holder: summed into its memory, the same numbers
    auto sole = r.clone();
    const void* mem = sole.data_ptr();
    y = model_zoo::conv_bn_act(*conv, *bn, x, act, std::move(sole));
    CHECK(y.data_ptr() == mem);
    CHECK((y - ref).abs().max().item<double>() < 1e-5);
    CHECK(ops_called([&] { model_zoo::conv_bn_act(*conv, *bn, x, act, r); }).count("imgtrain::winograd_conv3x3") ==
          size_t(ch == 32));
  }
  }
  // in a model: a block whose shortcut is the stage's input (resnet18's layer1.0), given an input
  // the caller keeps
  ModelArgs a;
  auto m = model_zoo::create_model("resnet18", a);
  m->eval();
  engine::to_channels_last(*m);
  auto layer1 = m->named_children()["layer1"]->as<torch::nn::SequentialImpl>();
  REQUIRE(layer1 != nullptr);
  const auto in = torch::randn({1, 64, 16, 16}).contiguous(at::MemoryFormat::ChannelsLast);
  const auto in_before = in.clone();
  const auto ref = layer1->forward(in);
  set_inference_fusion(*m, true);
  const auto out = layer1->forward(in);
  CHECK(torch::equal(in, in_before));
  CHECK((out - ref).abs().max().item<double>() <= 1e-4 * ref.abs().max().item<double>());
}

TEST_CASE("inference fusion on does not change training: outputs, gradients and statistics bitwise", "[models]") {
  auto run = [](bool fuse) {
    torch::manual_seed(1);
    ModelArgs a;
    a.num_classes = 5;
    a.drop_path_rate = 0.1;
    auto m = model_zoo::create_model("resnet18", a);
    set_inference_fusion(*m, fuse);
    m->train();
    auto x = torch::randn({4, 3, 32, 32});
    auto y = m->forward(x);
    y.square().sum().backward();
    std::vector<at::Tensor> out{y.detach()};
    for (auto& p : m->parameters()) out.push_back(p.grad().clone());
    for (auto& b : m->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto plain = run(false), fused = run(true);
  REQUIRE(plain.size() == fused.size());
  for (size_t i = 0; i < plain.size(); ++i) CHECK(torch::equal(plain[i], fused[i]));
}

namespace {

// torch's modules for act(batch_norm(x) + residual) in training mode, the reference of the fused kernel
at::Tensor bn_act_reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& rm,
                            const at::Tensor& rv, double momentum, double eps, ops::NormAct act,
                            const at::Tensor& residual) {
  auto y = at::batch_norm(x, w, b, rm, rv, /*training=*/true, momentum, eps, /*cudnn_enabled=*/false);
  if (residual.defined()) y = y + residual;
  switch (act) {
    case ops::NormAct::None: return y;
    case ops::NormAct::ReLU: return y.relu();
    case ops::NormAct::ReLU6: return torch::hardtanh(y, 0, 6);
    case ops::NormAct::SiLU: return torch::silu(y);
    case ops::NormAct::HardSwish: return torch::hardswish(y);
  }
  return y;
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

// The fused training BatchNorm on `dev` against torch's ops there, forward and backward: shapes
// with tails of the CPU's 16-lane and 64-row blocks, a plane longer than a 1,024-value chunk, 1x1
// maps (both layouts at once), a large mean against a small spread (shifted sums), and (CUDA's
// chunks of 4,096 values per channel) 16,200 values per channel.
void fused_bn_matches_modules(torch::Device dev) {
  using ops::NormAct;
  struct Case {
    std::vector<int64_t> shape;
    double offset, spread;
  };
  const Case cases[] = {{{3, 19, 7, 5}, 0.0, 1.0}, {{2, 8, 40, 33}, 0.5, 2.0}, {{4, 24, 1, 1}, 0.0, 1.0},
                        {{2, 5, 9, 9}, 50.0, 0.1}, {{9, 33, 45, 40}, 0.2, 1.0}};
  for (const auto& cs : cases)
    for (auto act : {NormAct::None, NormAct::ReLU, NormAct::ReLU6, NormAct::SiLU, NormAct::HardSwish})
      for (bool res : {false, true})
        for (bool cl : {false, true}) {
          INFO("shape " << cs.shape << " act " << int(act) << " residual " << res << " channels-last " << cl);
          torch::manual_seed(3);
          const int64_t C = cs.shape[1];
          auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
          auto x0 = (torch::randn(cs.shape) * cs.spread + cs.offset).contiguous(fmt).to(dev);
          auto r0 = res ? (torch::randn(cs.shape) * 3).contiguous(fmt).to(dev) : at::Tensor();
          // pre-activations on both sides of the kinks
          auto w0 = (torch::rand({C}) + 0.5).to(dev), b0 = (torch::randn({C}) * 2).to(dev);
          auto gout = torch::randn(cs.shape).contiguous(fmt).to(dev);
          const auto rm0 = torch::randn({C}).to(dev), rv0 = (torch::rand({C}) + 0.5).to(dev);
          auto run = [&](bool fused, at::Tensor& rm, at::Tensor& rv) {
            auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
            auto b = b0.clone().requires_grad_(true);
            auto r = res ? r0.clone().requires_grad_(true) : at::Tensor();
            rm = rm0.clone();
            rv = rv0.clone();
            REQUIRE(ops::batch_norm_act_supported(x, r));
            auto y = fused ? ops::batch_norm_act_train(x, w, b, rm, rv, 0.1, 1e-5, act, r)
                           : bn_act_reference(x, w, b, rm, rv, 0.1, 1e-5, act, r);
            y.backward(gout);
            std::vector<at::Tensor> out{y.detach(), x.grad(), w.grad(), b.grad()};
            if (res) out.push_back(r.grad());
            return out;
          };
          at::Tensor rm1, rv1, rm2, rv2;
          const auto want = run(false, rm1, rv1);
          const auto got = run(true, rm2, rv2);
          CHECK(got[0].is_contiguous(fmt));
          CHECK(got[1].is_contiguous(fmt));
          const char* what[] = {"output", "grad x", "grad weight", "grad bias", "grad residual"};
          for (size_t i = 0; i < want.size(); ++i) {
            INFO(what[i]);
            CHECK(rel_err(got[i], want[i]) < 2e-4);
          }
          CHECK(rel_err(rm2, rm1) < 1e-5);
          CHECK(rel_err(rv2, rv1) < 1e-4);
        }
}

}  // namespace

TEST_CASE("training fusion: BatchNorm + residual + activation in one kernel equals torch's ops, forward and backward",
          "[ops][models]") {
  using ops::NormAct;
  fused_bn_matches_modules(torch::Device(torch::kCPU));
  // the kernels do split their work: built with OpenMP, at::parallel_for runs on the threads asked
  // for (without it, it silently ran everything on the calling thread)
  {
    const int before = at::get_num_threads();
    at::set_num_threads(2);
#ifdef IMGTRAIN_KERNELS_OPENMP
    CHECK(ops::kernel_threads() == 2);
#else
    WARN("built without OpenMP: imgtrain's kernels run on one thread");
#endif
    at::set_num_threads(1);
    CHECK(ops::kernel_threads() == 1);
    at::set_num_threads(before);
  }
  // the bits do not depend on the number of threads (fixed blocks, fixed order of the sums)
  for (bool cl : {false, true}) {
    torch::manual_seed(4);
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x0 = torch::randn({4, 32, 30, 30}).contiguous(fmt), g = torch::randn({4, 32, 30, 30}).contiguous(fmt);
    auto res = torch::randn({4, 32, 30, 30}).contiguous(fmt);
    auto run = [&](int threads) {
      const int before = at::get_num_threads();
      at::set_num_threads(threads);
      auto x = x0.clone().requires_grad_(true);
      auto w = torch::ones({32}).requires_grad_(true), b = torch::zeros({32}).requires_grad_(true);
      auto rm = torch::zeros({32}), rv = torch::ones({32});
      auto y = ops::batch_norm_act_train(x, w, b, rm, rv, 0.1, 1e-5, NormAct::SiLU, res);
      y.backward(g);
      at::set_num_threads(before);
      return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), rm, rv};
    };
    const auto one = run(1), two = run(2), three = run(3);
    for (size_t i = 0; i < one.size(); ++i) {
      CHECK(torch::equal(one[i], two[i]));
      CHECK(torch::equal(one[i], three[i]));
    }
  }
  // what the kernel does not take: the caller keeps torch's modules
  CHECK(ops::batch_norm_act_supported(torch::randn({2, 3, 4, 4}).to(at::kDouble), {}));  // plain loops
  CHECK_FALSE(ops::batch_norm_act_supported(torch::randn({2, 3, 4, 4}).to(at::kBFloat16), {}));
  CHECK_FALSE(ops::batch_norm_act_supported(torch::randn({2, 3, 4, 4}).to(at::kDouble), torch::randn({2, 3, 4, 4})));
  CHECK_FALSE(ops::batch_norm_act_supported(torch::randn({2, 3, 4, 4}).transpose(2, 3), {}));
  CHECK_FALSE(ops::batch_norm_act_supported(torch::randn({1, 3, 1, 1}), {}));
  CHECK_FALSE(ops::batch_norm_act_supported(torch::randn({2, 3, 4, 4}),
                                            torch::randn({2, 3, 4, 4}).contiguous(at::MemoryFormat::ChannelsLast)));
}

namespace {

// x * gate(conv(act(conv(mean(x))))) through autograd, as the zoo's modules compute it
at::Tensor se_reference(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                        const at::Tensor& b2, ops::SeAct act, ops::SeGate gate) {
  using ops::SeAct;
  using ops::SeGate;
  auto z = at::conv2d(x.mean({2, 3}, true), w1, b1);
  switch (act) {
    case SeAct::ReLU: z = z.relu(); break;
    case SeAct::ReLU6: z = z.clamp(0, 6); break;
    case SeAct::SiLU: z = at::silu(z); break;
    case SeAct::HardSwish: z = at::hardswish(z); break;
    case SeAct::GELU: z = at::gelu(z); break;
  }
  auto s = at::conv2d(z, w2, b2);
  return x * (gate == SeGate::Sigmoid ? s.sigmoid() : at::hardsigmoid(s));
}

// The squeeze-and-excite function on `dev` against torch's ops there. Shapes: 1x1 maps, a plane
// longer than a 1,024-value chunk, a tail of the 64-pixel rows and of the 16 lanes, a batch of one.
void fused_se_matches_modules(torch::Device dev) {
  using ops::SeAct;
  using ops::SeGate;
  const auto reference = se_reference;
  const std::vector<std::vector<int64_t>> shapes = {{3, 19, 7, 5}, {2, 8, 40, 33}, {4, 24, 1, 1}, {1, 40, 9, 9}};
  for (const auto& shape : shapes)
    for (auto act : {SeAct::ReLU, SeAct::ReLU6, SeAct::SiLU, SeAct::HardSwish, SeAct::GELU})
      for (auto gate : {SeGate::Sigmoid, SeGate::HardSigmoid})
        for (bool cl : {false, true}) {
          INFO("shape " << shape << " act " << int(act) << " gate " << int(gate) << " channels-last " << cl);
          torch::manual_seed(5);
          const int64_t C = shape[1], R = std::max<int64_t>(1, C / 4);
          auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
          auto x0 = torch::randn(shape).contiguous(fmt).to(dev), g = torch::randn(shape).contiguous(fmt).to(dev);
          // weights large enough that the activation and the gate see both sides of their kinks
          auto w10 = torch::randn({R, C, 1, 1}).to(dev), b10 = torch::randn({R}).to(dev),
               w20 = (torch::randn({C, R, 1, 1}) * 2).to(dev), b20 = torch::randn({C}).to(dev);
          auto run = [&](bool fused) {
            auto x = x0.clone().requires_grad_(true);
            auto w1 = w10.clone().requires_grad_(true), b1 = b10.clone().requires_grad_(true);
            auto w2 = w20.clone().requires_grad_(true), b2 = b20.clone().requires_grad_(true);
            REQUIRE(ops::se_gate_supported(x, w1));
            auto y = fused ? ops::se_gate_train(x, w1, b1, w2, b2, act, gate) : reference(x, w1, b1, w2, b2, act, gate);
            y.backward(g);
            return std::vector<at::Tensor>{y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
          };
          const auto want = run(false), got = run(true);
          CHECK(got[0].is_contiguous(fmt));
          CHECK(got[1].is_contiguous(fmt));
          CHECK(torch::equal(got[0], want[0]));  // the forward is ATen's own ops
          const char* what[] = {"output", "grad x", "grad w_reduce", "grad b_reduce", "grad w_expand", "grad b_expand"};
          for (size_t i = 1; i < want.size(); ++i) {
            INFO(what[i]);
            CHECK(rel_err(got[i], want[i]) < 2e-4);
          }
        }
}

}  // namespace

TEST_CASE("training fusion: squeeze-and-excite as one function equals torch's ops, forward and backward", "[ops][models]") {
  using ops::SeAct;
  using ops::SeGate;
  const auto reference = se_reference;
  fused_se_matches_modules(torch::Device(torch::kCPU));
  // where every sum is exact (small integers and halves), the gate's gradient is exact in any order,
  // and then every gradient is bitwise autograd's: the same operations in the same order
  for (bool cl : {false, true}) {
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    torch::manual_seed(6);
    auto x0 = (torch::randint(-4, 5, {2, 12, 5, 7}) / 2.0).contiguous(fmt);
    auto g = (torch::randint(-4, 5, {2, 12, 5, 7}) / 4.0).contiguous(fmt);
    auto w10 = torch::randint(-2, 3, {3, 12, 1, 1}) / 4.0, b10 = torch::randint(-2, 3, {3}) / 4.0;
    auto w20 = torch::randint(-2, 3, {12, 3, 1, 1}) / 4.0, b20 = torch::randint(-2, 3, {12}) / 4.0;
    auto run = [&](bool fused) {
      auto x = x0.clone().requires_grad_(true);
      auto w1 = w10.clone().requires_grad_(true), b1 = b10.clone().requires_grad_(true);
      auto w2 = w20.clone().requires_grad_(true), b2 = b20.clone().requires_grad_(true);
      auto y = fused ? ops::se_gate_train(x, w1, b1, w2, b2, SeAct::ReLU, SeGate::HardSigmoid)
                     : reference(x, w1, b1, w2, b2, SeAct::ReLU, SeGate::HardSigmoid);
      y.backward(g);
      return std::vector<at::Tensor>{y.detach(), x.grad(), w1.grad(), b1.grad(), w2.grad(), b2.grad()};
    };
    const auto want = run(false), got = run(true);
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("tensor " << i << (cl ? " channels-last" : " NCHW"));
      CHECK(torch::equal(got[i], want[i]));
    }
  }
  // the bits do not depend on the number of threads (at a batch of 16, where ATen's 1x1
  // convolutions take oneDNN whatever the thread count; below it, one thread takes another path)
  for (bool cl : {false, true}) {
    torch::manual_seed(7);
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x0 = torch::randn({16, 32, 20, 20}).contiguous(fmt), g = torch::randn({16, 32, 20, 20}).contiguous(fmt);
    auto w1 = torch::randn({8, 32, 1, 1}), b1 = torch::randn({8}), w2 = torch::randn({32, 8, 1, 1}),
         b2 = torch::randn({32});
    auto run = [&](int threads) {
      const int before = at::get_num_threads();
      at::set_num_threads(threads);
      auto x = x0.clone().requires_grad_(true);
      auto y = ops::se_gate_train(x, w1, b1, w2, b2, SeAct::SiLU, SeGate::Sigmoid);
      y.backward(g);
      at::set_num_threads(before);
      return x.grad();
    };
    const auto one = run(1);
    CHECK(torch::equal(one, run(2)));
    CHECK(torch::equal(one, run(3)));
  }
  CHECK(ops::se_gate_supported(torch::randn({2, 3, 4, 4}).to(at::kDouble), torch::randn({1, 3, 1, 1}).to(at::kDouble)));
  CHECK_FALSE(ops::se_gate_supported(torch::randn({2, 3, 4, 4}), torch::randn({1, 3, 1, 1}).to(at::kDouble)));
  CHECK_FALSE(ops::se_gate_supported(torch::randn({2, 3, 4, 4}).to(at::kBFloat16), torch::randn({1, 3, 1, 1})));
  CHECK_FALSE(ops::se_gate_supported(torch::randn({2, 3, 4, 4}).transpose(2, 3), torch::randn({1, 3, 1, 1})));
}

TEST_CASE("depthwise convolution: imgtrain's weight gradient equals ATen's, forward and backward", "[ops][models]") {
  // shapes: one full 16-channel block, a tail of 3 channels, planes narrower than the filter, a
  // plane of one row, more than one block with a tail of the 8 doubles
  const std::vector<std::vector<int64_t>> shapes = {{2, 16, 9, 11}, {3, 19, 7, 5}, {1, 40, 3, 3}, {2, 5, 1, 6}, {2, 37, 12, 12}};
  for (auto dtype : {at::kFloat, at::kDouble})
    for (const auto& shape : shapes)
      for (int64_t k : {3, 5, 7})
        for (int64_t stride : {1, 2})
          for (int64_t pad : {k / 2, int64_t(0), int64_t(1)})
            for (bool cl : {false, true})
              for (bool bias : {true, false}) {
                torch::manual_seed(11);
                const int64_t C = shape[1];
                auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
                auto x0 = torch::randn(shape).to(dtype).contiguous(fmt);
                auto w0 = torch::randn({C, 1, k, k}).to(dtype), b0 = torch::randn({C}).to(dtype);
                if (!ops::depthwise_conv_supported(x0, w0, stride, pad, 1, C)) {
                  // only where the padded plane is smaller than the filter
                  CHECK((shape[2] + 2 * pad < k || shape[3] + 2 * pad < k));
                  continue;
                }
                INFO("dtype " << dtype << " shape " << shape << " k " << k << " stride " << stride << " pad " << pad
                              << " channels-last " << cl << " bias " << bias);
                at::Tensor g;
                auto run = [&](bool ours) {
                  auto x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
                  auto b = bias ? b0.clone().requires_grad_(true) : at::Tensor();
                  auto y = ours ? ops::depthwise_conv_train(x, w, b, stride, pad)
                                : at::conv2d(x, w, b, {stride, stride}, {pad, pad}, {1, 1}, C);
                  if (!g.defined()) g = torch::randn(y.sizes()).to(dtype);
                  y.backward(g);
                  return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), bias ? b.grad() : torch::zeros({1})};
                };
                const auto want = run(false), got = run(true);
                CHECK(torch::equal(got[0], want[0]));  // the forward is ATen's
                const double tol = dtype == at::kDouble ? 1e-12 : 2e-5;
                const char* what[] = {"output", "grad x", "grad w", "grad b"};
                for (size_t i = 1; i < want.size(); ++i) {
                  INFO(what[i]);
                  REQUIRE(got[i].sizes() == want[i].sizes());
                  CHECK(rel_err(got[i], want[i]) < tol);
                }
              }
  // where every product and sum is exact (halves and quarters), the weight and bias gradients are
  // ATen's bit for bit: a wrong tap, offset or border fails here whatever the tolerance above
  for (bool cl : {false, true}) {
    torch::manual_seed(12);
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x0 = (torch::randint(-4, 5, {3, 21, 10, 13}) / 2.0).contiguous(fmt);
    auto w0 = torch::randint(-2, 3, {21, 1, 7, 7}) / 4.0, b0 = torch::randint(-2, 3, {21}) / 4.0;
    for (int64_t stride : {1, 2}) {
      auto g = (torch::randint(-4, 5, at::conv2d(x0, w0, b0, stride, 3, 1, 21).sizes()) / 4.0).contiguous(fmt);
      auto [gw, gb] = ops::depthwise_conv_weight_grad(x0, g, 7, stride, 3);
      auto want = at::convolution_backward(g, x0, w0, std::vector<int64_t>{21}, {stride, stride}, {3, 3}, {1, 1}, false,
                                           {0, 0}, 21, {false, true, true});
      INFO("stride " << stride << (cl ? " channels-last" : " NCHW"));
      CHECK(torch::equal(gw, std::get<1>(want)));
      CHECK(torch::equal(gb, std::get<2>(want)));
    }
  }
  // the bits do not depend on the number of threads
  {
    torch::manual_seed(13);
    auto x = torch::randn({4, 96, 14, 14}), g = torch::randn({4, 96, 14, 14});
    auto run = [&](int threads) {
      const int before = at::get_num_threads();
      at::set_num_threads(threads);
      auto r = ops::depthwise_conv_weight_grad(x, g, 7, 1, 3);
      at::set_num_threads(before);
      return r;
    };
    const auto one = run(1), two = run(2), three = run(3);
    CHECK(torch::equal(one.first, two.first));
    CHECK(torch::equal(one.first, three.first));
    CHECK(torch::equal(one.second, three.second));
  }
  auto x = torch::randn({2, 8, 6, 6}), w = torch::randn({8, 1, 3, 3});
  CHECK(ops::depthwise_conv_supported(x, w, 1, 1, 1, 8));
  CHECK(ops::depthwise_conv_supported(x.to(at::kDouble), w.to(at::kDouble), 2, 1, 1, 8));
  CHECK_FALSE(ops::depthwise_conv_supported(x.to(at::kBFloat16), w.to(at::kBFloat16), 1, 1, 1, 8));
  CHECK_FALSE(ops::depthwise_conv_supported(x, w.to(at::kDouble), 1, 1, 1, 8));
  CHECK_FALSE(ops::depthwise_conv_supported(x, torch::randn({8, 1, 4, 4}), 1, 1, 1, 8));  // even filter
  CHECK_FALSE(ops::depthwise_conv_supported(x, w, 3, 1, 1, 8));                         // stride 3
  CHECK_FALSE(ops::depthwise_conv_supported(x, w, 1, 2, 2, 8));                         // dilation 2
  CHECK_FALSE(ops::depthwise_conv_supported(x, torch::randn({8, 2, 3, 3}), 1, 1, 1, 4));  // groups of two
}

TEST_CASE("training fusion in the zoo: float64 equals torch's modules, float32 is as close to float64 as they are",
          "[models]") {
  // float64: the fused layers (the same loops in double) against torch's modules in float64, a
  // whole training step of five families: wiring (which layers fuse, activation, residual, saved
  // tensors, gradients returned) and arithmetic at float64 exactness.
  // float32: the forward values (logits, running statistics) of the fused step are as close to
  // float64 as the modules' float32 step is (whose rounding is the yardstick). Gradients are held
  // to torch's ops per kernel (previous test) but not here: a pre-activation within float32
  // rounding of a kink (ReLU6 at 0: 6.4e-6 in float64, 0 in one float32 order) flips its mask in
  // either float32 step by chance, in about half of mobilenetv2's seeds at 48 px for the modules
  // and the fused kernel alike, and moves every gradient below it by a visible fraction.
  auto run = [](const char* name, bool cl, bool fuse, at::ScalarType dtype) {
    torch::manual_seed(2);
    ModelArgs a;
    a.num_classes = 7;
    auto m = model_zoo::create_model(name, a);
    m->to(dtype);
    if (cl) engine::to_channels_last(*m);
    set_training_fusion(*m, fuse);
    m->train();
    auto x = torch::randn({3, 3, 48, 48}).to(dtype);
    if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    auto y = m->forward(x);
    torch::nn::functional::cross_entropy(y, torch::tensor({1, 4, 6})).backward();
    std::vector<std::pair<std::string, at::Tensor>> out{{"logits", y.detach().to(at::kDouble)}};
    for (auto& p : m->named_parameters()) out.emplace_back("grad " + p.key(), p.value().grad().to(at::kDouble));
    for (auto& b : m->named_buffers()) out.emplace_back(b.key(), b.value().clone());
    return out;
  };
  for (const char* name : {"resnet18", "resnet50d", "efficientnet_b0", "mobilenetv3_large_100", "mobilenetv2_100"})
    for (bool cl : {false, true}) {
      INFO(name << (cl ? " channels-last" : " NCHW"));
      const auto ref = run(name, cl, false, at::kDouble), fused64 = run(name, cl, true, at::kDouble);
      const auto plain = run(name, cl, false, at::kFloat), fused = run(name, cl, true, at::kFloat),
                 again = run(name, cl, true, at::kFloat);
      REQUIRE(ref.size() == fused64.size());
      REQUIRE(ref.size() == fused.size());
      double grad_scale = 0;
      for (const auto& [n, t] : ref)
        if (n.rfind("grad ", 0) == 0) grad_scale = std::max(grad_scale, t.abs().max().item<double>());
      bool differs64 = false, differs = false;
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO(ref[i].first);
        const auto& want = ref[i].second;
        CHECK(torch::equal(fused[i].second, again[i].second));  // deterministic
        differs = differs || !torch::equal(fused[i].second, plain[i].second);
        differs64 = differs64 || !torch::equal(fused64[i].second, want);
        if (want.scalar_type() == at::kLong) {
          CHECK(torch::equal(want, fused64[i].second));  // num_batches_tracked moved once
          CHECK(torch::equal(want, fused[i].second));
          continue;
        }
        const bool grad = ref[i].first.rfind("grad ", 0) == 0;
        const double denom = std::max(want.abs().max().item<double>(), 1e-3 * (grad ? grad_scale : 1.0));
        auto err = [&](const at::Tensor& t) { return (t.to(at::kDouble) - want).abs().max().item<double>() / denom; };
        CHECK(err(fused64[i].second) < 1e-10);
        if (grad) continue;
        const double e_fused = err(fused[i].second), e_plain = err(plain[i].second);
        INFO("error against float64: fused " << e_fused << ", modules " << e_plain);
        CHECK(e_fused <= 4 * e_plain + 1e-5);
      }
      CHECK(differs);    // the fused kernel did run
      CHECK(differs64);
    }
}

TEST_CASE("training fusion of frozen BatchNorms: folded into the convolutions, equal to the modules", "[models]") {
  // torchvision's FrozenBatchNorm2d (a detector's body started from weights): with training fusion
  // on, conv_bn_act folds it into the convolution. float64: equal to the modules to 1e-10 (wiring:
  // which layers fold, residual, activation, gradients to the weights that train); float32: within
  // rounding. The stem stays frozen, as with --trainable-backbone-layers 3.
  auto run = [](const char* name, bool cl, bool fuse, at::ScalarType dtype) {
    torch::manual_seed(5);
    ModelArgs a;
    a.num_classes = 7;
    auto m = model_zoo::create_model(name, a);
    {
      torch::NoGradGuard ng;
      for (auto& b : m->named_buffers())  // statistics a trained body would have
        if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.5, 2.0);
        else if (b.key().find("running_mean") != std::string::npos) b.value().normal_(0, 0.3);
      for (auto& p : m->named_parameters())
        if (p.key().find("bn") != std::string::npos && p.key().find("weight") != std::string::npos) p.value().uniform_(0.5, 1.5);
    }
    for (auto& mod : m->modules(false))
      if (auto* bn = mod->as<imgtrain::BatchNorm2dImpl>()) bn->freeze(1e-5);
    for (auto& p : m->named_parameters())
      if (p.key().rfind("conv1", 0) == 0 || p.key().rfind("layer1", 0) == 0) p.value().requires_grad_(false);
    m->to(dtype);
    if (cl) engine::to_channels_last(*m);
    set_training_fusion(*m, fuse);
    m->train();
    auto x = torch::randn({2, 3, 64, 64}).to(dtype);
    if (cl) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    auto y = m->forward(x);
    torch::nn::functional::cross_entropy(y, torch::tensor({1, 4})).backward();
    std::vector<std::pair<std::string, at::Tensor>> out{{"logits", y.detach().to(at::kDouble)}};
    for (auto& p : m->named_parameters())
      out.emplace_back("grad " + p.key(), p.value().grad().defined() ? p.value().grad().to(at::kDouble) : at::Tensor());
    for (auto& b : m->named_buffers()) out.emplace_back(b.key(), b.value().clone());
    return out;
  };
  for (const char* name : {"resnet18", "resnet50d"})
    for (bool cl : {false, true}) {
      INFO(name << (cl ? " channels-last" : " NCHW"));
      const auto ref = run(name, cl, false, at::kDouble), fused64 = run(name, cl, true, at::kDouble);
      const auto fused = run(name, cl, true, at::kFloat);
      REQUIRE(ref.size() == fused64.size());
      int64_t trained = 0;
      bool differs64 = false;
      for (size_t i = 0; i < ref.size(); ++i) {
        INFO(ref[i].first);
        const auto& want = ref[i].second;
        REQUIRE(want.defined() == fused64[i].second.defined());  // the same weights train
        if (!want.defined()) continue;
        trained += ref[i].first.rfind("grad ", 0) == 0;
        if (want.scalar_type() == at::kLong) {  // a frozen BatchNorm's counter does not move
          CHECK(torch::equal(want, fused64[i].second));
          continue;
        }
        differs64 = differs64 || !torch::equal(fused64[i].second, want);
        const double denom = std::max(want.abs().max().item<double>(), 1e-12);
        CHECK((fused64[i].second - want).abs().max().item<double>() / denom < 1e-10);
        CHECK((fused[i].second.to(at::kDouble) - want).abs().max().item<double>() / denom < 2e-3);
      }
      CHECK(trained > 10);
      CHECK(differs64);  // the folded path did run
    }
}

TEST_CASE("convolutions with taps on padding only run trimmed: same outputs and gradients as the full kernel", "[models]") {
  // float64: the trimmed convolution (or Linear) sums the same non-zero products as the full
  // kernel, so outputs and gradients agree to rounding; a cut tap's gradient is exactly zero
  struct Case {
    std::vector<int64_t> x, w, stride, padding, dilation;
    int64_t groups;
    bool trims;
  };
  const std::vector<Case> cases = {
      {{3, 8, 1, 1}, {6, 8, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 1, true},     // centre tap: a Linear
      {{3, 8, 2, 2}, {6, 8, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, true},     // 2x2 -> 1x1, stride 2: a Linear
      {{2, 8, 1, 1}, {8, 1, 5, 5}, {1, 1}, {2, 2}, {1, 1}, 8, true},     // depthwise 5x5 on 1x1
      {{2, 4, 1, 3}, {5, 4, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 1, true},     // rows cut, columns kept
      {{2, 4, 2, 2}, {5, 4, 3, 3}, {1, 1}, {2, 2}, {2, 2}, 1, true},     // dilation 2 on 2x2
      {{2, 4, 2, 2}, {5, 4, 3, 3}, {1, 1}, {1, 1}, {1, 1}, 1, false},    // 2x2, stride 1: every tap used
      {{2, 4, 7, 7}, {5, 4, 3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, false},    // ordinary maps
      {{2, 4, 5, 5}, {5, 4, 1, 1}, {1, 1}, {0, 0}, {1, 1}, 1, false},    // 1x1 kernel
  };
  for (const auto format : {at::MemoryFormat::Contiguous, at::MemoryFormat::ChannelsLast})
    for (const auto& c : cases) {
      INFO("x " << Catch::Detail::stringify(c.x) << " w " << Catch::Detail::stringify(c.w) << " stride "
                << Catch::Detail::stringify(c.stride) << " dilation " << Catch::Detail::stringify(c.dilation)
                << (format == at::MemoryFormat::ChannelsLast ? " channels-last" : ""));
      torch::manual_seed(3);
      auto x = torch::randn(c.x, torch::kFloat64).contiguous(format).requires_grad_();
      auto w = (format == at::MemoryFormat::ChannelsLast ? engine::channels_last_weight(torch::randn(c.w, torch::kFloat64))
                                                         : torch::randn(c.w, torch::kFloat64))
                   .requires_grad_();
      auto b = torch::randn({c.w[0]}, torch::kFloat64).requires_grad_();
      auto y = model_zoo::trimmed_conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
      REQUIRE(y.defined() == c.trims);
      if (!y.defined()) continue;
      auto ref = at::conv2d(x, w, b, c.stride, c.padding, c.dilation, c.groups);
      REQUIRE(y.sizes() == ref.sizes());
      CHECK(torch::allclose(y, ref, 1e-12, 1e-12));
      auto g = torch::randn_like(ref);
      auto got = torch::autograd::grad({y}, {x, w, b}, {g});
      auto want = torch::autograd::grad({ref}, {x, w, b}, {g});
      for (int i = 0; i < 3; ++i) CHECK(torch::allclose(got[i], want[i], 1e-12, 1e-12));
      // the weight's gradient in the weight's layout: AccumulateGrad keeps it rather than copying
      CHECK(got[1].suggest_memory_format() == w.suggest_memory_format());
      CHECK(got[1].is_contiguous(w.suggest_memory_format()));
    }
  // channels-last input: same numbers, in float32 within rounding
  auto x = torch::randn({4, 16, 2, 2}).contiguous(at::MemoryFormat::ChannelsLast);
  auto w = torch::randn({32, 16, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast);
  auto y = model_zoo::trimmed_conv2d(x, w, {}, {2, 2}, {1, 1}, {1, 1}, 1);
  REQUIRE(y.defined());
  CHECK(torch::allclose(y, at::conv2d(x, w, {}, {2, 2}, {1, 1}), 1e-5, 1e-5));
}

TEST_CASE("ConvNeXt refuses inputs under 32 px by name and each family names its fused training kernels", "[models]") {
  ModelArgs a;
  a.num_classes = 10;
  a.img_size = 31;
  try {
    model_zoo::create_model("convnext_tiny", a);
    FAIL("no error for --img-size 31");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Catch::Contains("--img-size 31: convnext_tiny needs at least 32 px"));
  }
  a.img_size = 0;
  auto m = model_zoo::create_model("convnext_tiny", a);
  m->eval();
  torch::NoGradGuard ng;
  CHECK(m->forward(torch::randn({1, 3, 32, 40})).sizes() == std::vector<int64_t>{1, 10});
  try {
    m->forward(torch::randn({1, 3, 64, 31}));
    FAIL("no error for a 64x31 input");
  } catch (const UserError& e) {
    CHECK_THAT(e.what(), Catch::Contains("input 64x31: convnext_tiny needs at least 32x32 pixels"));
  }
  CHECK_THAT(model_zoo::cpu_training_fused_kernels("vit_small_patch16_224"), Catch::Contains("attention"));
  CHECK_THAT(model_zoo::cpu_training_fused_kernels("convnext_tiny"), Catch::Contains("MLP on tiles"));
  CHECK_THAT(model_zoo::cpu_training_fused_kernels("resnet50"), Catch::Contains("BatchNorm fused"));
  CHECK(model_zoo::cpu_training_fused_kernels("nonexistent") == "");
  CHECK(model_zoo::cpu_training_fused("vit_small_patch16_224"));
  CHECK(model_zoo::cpu_training_fused("convnext_tiny"));
}

TEST_CASE("channels_last_weight gives strides torch reads as channels-last also with one input channel per group",
          "[models]") {
  // [O, 1, kh, kw] keeps its NCHW strides under contiguous(ChannelsLast) (the same bytes), which
  // torch reads as NCHW: oneDNN's convolution over a 1-channel input then wrote an NCHW output
  torch::manual_seed(5);
  for (const auto& shape : {std::vector<int64_t>{8, 1, 7, 7}, {16, 1, 3, 3}, {8, 4, 3, 3}, {8, 4, 1, 1}}) {
    INFO(Catch::Detail::stringify(shape));
    const auto w = torch::randn(shape);
    const auto cl = engine::channels_last_weight(w);
    CHECK(torch::equal(cl, w));
    CHECK(cl.is_contiguous(at::MemoryFormat::ChannelsLast));
    if (shape[1] == 1) {
      CHECK(w.contiguous(at::MemoryFormat::ChannelsLast).suggest_memory_format() == at::MemoryFormat::Contiguous);
      CHECK(cl.suggest_memory_format() == at::MemoryFormat::ChannelsLast);
    } else {
      CHECK(cl.strides() == w.contiguous(at::MemoryFormat::ChannelsLast).strides());  // untouched
    }
  }
  // a 1-channel stem and a depthwise convolution write channels-last outputs with it
  const auto x = torch::randn({2, 1, 12, 12});
  const auto stem = torch::randn({8, 1, 7, 7});
  CHECK_FALSE(at::conv2d(x, stem.contiguous(at::MemoryFormat::ChannelsLast), {}, 2, 3)
                  .is_contiguous(at::MemoryFormat::ChannelsLast));
  const auto y = at::conv2d(x, engine::channels_last_weight(stem), {}, 2, 3);
  CHECK(y.is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK_FALSE(y.is_contiguous());
  CHECK(torch::allclose(y, at::conv2d(x, stem, {}, 2, 3), 1e-5, 1e-5));
  // to_channels_last on a module: the same values, every 4-D weight read as channels-last
  torch::nn::Sequential m(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).groups(8)),
                          torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 4, 3)));
  std::vector<at::Tensor> before;
  for (const auto& p : m->parameters()) before.push_back(p.detach().clone());
  engine::to_channels_last(*m);
  size_t i = 0;
  for (const auto& p : m->parameters()) {
    CHECK(torch::equal(p, before[i++]));
    if (p.dim() == 4) CHECK(p.suggest_memory_format() == at::MemoryFormat::ChannelsLast);
  }
}

// A zoo model in training mode with channels-last weights (10 classes), as the CPU training default runs it.
model_zoo::Model channels_last_training_model(const std::string& name) {
  ModelArgs a;
  a.num_classes = 10;
  auto m = model_zoo::create_model(name, a);
  m->train();
  engine::to_channels_last(*m);
  return m;
}

TEST_CASE("1x1 convolutions over small channels-last maps run as GEMMs in training: same outputs and gradients",
          "[models]") {
  // float32 (the only type it takes): outputs and the three gradients within rounding of
  // at::conv2d's; the output is a channels-last view; and where it does not apply it says so
  torch::manual_seed(5);
  const auto cl = at::MemoryFormat::ChannelsLast;
  // stride 2 over even and odd maps (every other row and column from the first: 13 -> 7, 14 -> 7)
  const std::vector<std::array<int64_t, 5>> shapes{{2, 16, 24, 7, 1}, {3, 40, 8, 14, 1}, {1, 8, 8, 1, 1},
                                                   {2, 16, 24, 13, 2}, {3, 40, 8, 14, 2}, {1, 8, 8, 1, 2}};
  for (const auto& [n, cin, cout, hw, stride] : shapes) {
    INFO("n " << n << " cin " << cin << " cout " << cout << " map " << hw << "x" << hw << " stride " << stride);
    auto x = torch::randn({n, cin, hw, hw}).contiguous(cl).requires_grad_();
    auto w = torch::randn({cout, cin, 1, 1}).contiguous(cl).requires_grad_();
    auto b = torch::randn({cout}).requires_grad_();
    for (bool bias : {false, true}) {
      const auto bb = bias ? b : at::Tensor();
      auto y = model_zoo::pointwise_gemm(x, w, bb, {stride, stride}, {0, 0}, 1);
      REQUIRE(y.defined());
      auto ref = at::conv2d(x, w, bb, stride);
      REQUIRE(y.sizes() == ref.sizes());
      CHECK(y.is_contiguous(cl));
      CHECK(torch::allclose(y, ref, 1e-4, 1e-4));
      auto g = torch::randn_like(ref);
      std::vector<at::Tensor> in = {x, w};
      if (bias) in.push_back(b);
      auto got = torch::autograd::grad({y}, in, {g});
      auto want = torch::autograd::grad({ref}, in, {g});
      for (size_t i = 0; i < in.size(); ++i) {
        INFO("gradient " << i);
        REQUIRE(got[i].sizes() == want[i].sizes());
        CHECK(torch::allclose(got[i], want[i], 1e-4, 1e-3));
      }
    }
  }
  auto x = torch::randn({2, 16, 7, 7}).contiguous(cl);
  auto w = torch::randn({8, 16, 1, 1}).contiguous(cl);
  CHECK(model_zoo::pointwise_gemm(x, w, {}, {1, 1}, {0, 0}, 1).defined());
  const auto x210 = torch::randn({2, 16, 15, 14}).contiguous(cl);  // 210 pixels
  CHECK_FALSE(model_zoo::pointwise_gemm(x210, w, {}, {1, 1}, {0, 0}, 1).defined());
  CHECK_FALSE(model_zoo::pointwise_gemm(torch::randn({2, 16, 7, 7}), w, {}, {1, 1}, {0, 0}, 1).defined());  // NCHW
  CHECK_FALSE(model_zoo::pointwise_gemm(x, w, {}, {3, 3}, {0, 0}, 1).defined());                            // stride 3
  CHECK_FALSE(model_zoo::pointwise_gemm(x, w, {}, {2, 1}, {0, 0}, 1).defined());                            // 2 x 1
  // stride 2 (a ResNet's downsampling shortcut): the output's pixels count, 15x15 from 30x30 too many
  CHECK(model_zoo::pointwise_gemm(torch::randn({2, 16, 28, 28}).contiguous(cl), w, {}, {2, 2}, {0, 0}, 1).defined());
  CHECK_FALSE(model_zoo::pointwise_gemm(torch::randn({2, 16, 30, 30}).contiguous(cl), w, {}, {2, 2}, {0, 0}, 1).defined());
  CHECK_FALSE(model_zoo::pointwise_gemm(x, torch::randn({8, 16, 3, 3}), {}, {1, 1}, {1, 1}, 1).defined());  // 3x3
  CHECK_FALSE(model_zoo::pointwise_gemm(x.to(at::kDouble), w.to(at::kDouble), {}, {1, 1}, {0, 0}, 1).defined());
  {
    torch::NoGradGuard ng;  // inference keeps oneDNN's convolution
    CHECK_FALSE(model_zoo::pointwise_gemm(x, w, {}, {1, 1}, {0, 0}, 1).defined());
  }
  // in a model: ResNet-50's training step at 224 px runs its last stages' 1x1 convolutions so
  auto m = channels_last_training_model("resnet50");
  const auto in = torch::randn({1, 3, 224, 224}).contiguous(cl);
  // the features alone (no classifier's addmm): a GEMM among them is a 1x1 convolution's
  const auto names = ops_called([&] { m->forward_features(in).sum().backward(); });
  CHECK(names.count("aten::mm"));
}

TEST_CASE("Dense 3x3 convolutions in training: the weight gradient as GEMMs over shifted rows, Winograd at stride 1",
          "[models][ops]") {
  const auto cl = at::MemoryFormat::ChannelsLast;
  // where every product and sum is exact (halves and quarters), the weight gradient is ATen's bit
  // for bit whatever the order of the sums: a wrong tap, phase, offset or border fails here. Kernel
  // sizes, strides and paddings beyond the 3x3 the models use, odd and non-square maps, one pixel.
  struct Geo {
    int64_t n, ci, co, h, w, k, s, p;
  };
  const std::vector<Geo> geos{{2, 5, 7, 9, 9, 3, 1, 1},  {3, 4, 6, 8, 11, 3, 2, 1}, {2, 3, 5, 7, 7, 3, 2, 1},
                              {1, 6, 4, 1, 1, 3, 1, 1},  {2, 4, 3, 2, 3, 3, 2, 1},  {2, 5, 4, 10, 9, 5, 1, 2},
                              {2, 3, 4, 11, 8, 5, 2, 2}, {2, 4, 5, 8, 8, 2, 2, 0},  {2, 4, 6, 9, 10, 1, 2, 0},
                              {2, 3, 4, 12, 13, 3, 3, 1}, {2, 3, 4, 6, 7, 3, 1, 0}, {1, 3, 2, 5, 5, 3, 1, 2},
                              {2, 3, 3, 9, 8, 4, 2, 1},  {1, 3, 2, 4, 4, 3, 1, 3}};
  for (const auto& g : geos) {
    INFO("n " << g.n << " ci " << g.ci << " co " << g.co << " map " << g.h << "x" << g.w << " k " << g.k << " stride "
              << g.s << " pad " << g.p);
    torch::manual_seed(21);
    auto x = (torch::randint(-4, 5, {g.n, g.ci, g.h, g.w}) / 2.0).to(at::kFloat).contiguous(cl);
    auto w = (torch::randint(-2, 3, {g.co, g.ci, g.k, g.k}) / 4.0).to(at::kFloat).contiguous(cl);
    auto gy = (torch::randint(-4, 5, at::conv2d(x, w, {}, g.s, g.p).sizes()) / 4.0).to(at::kFloat).contiguous(cl);
    auto want = std::get<1>(at::convolution_backward(gy, x, w, std::nullopt, {g.s, g.s}, {g.p, g.p}, {1, 1}, false,
                                                     {0, 0}, 1, {false, true, false}));
    auto got = ops::dense_conv_weight_grad(x, gy, g.k, g.s, g.p);
    REQUIRE(got.sizes() == want.sizes());
    CHECK(got.is_contiguous(cl));
    CHECK(torch::equal(got, want));
    // NCHW inputs give the same numbers
    CHECK(torch::equal(ops::dense_conv_weight_grad(x.contiguous(), gy.contiguous(), g.k, g.s, g.p), got));
  }
  // through autograd, random data, against float64: at stride 1 with at most 256 channels the
  // forward and the input gradient are Winograd's (within 4x ATen's float32 error), else ATen's own
  // (equal bits); the weight and bias gradients within float rounding
  for (int64_t stride : {1, 2})
    for (bool bias : {false, true})
      for (const auto& [ci, co, hw] : std::vector<std::array<int64_t, 3>>{{64, 72, 14}, {64, 72, 7}, {72, 64, 9},
                                                                          {264, 64, 6}, {64, 72, 32}}) {
        const bool winograd = stride == 1 && ci <= ops::kDenseWinogradMaxChannels && co <= ops::kDenseWinogradMaxChannels;
        // 32x32 maps (where inference would take F(4x4, 3x3)) train by F(2x2, 3x3) as well
        INFO("stride " << stride << " bias " << bias << " channels " << ci << " -> " << co << " map " << hw
                       << " winograd " << winograd);
        torch::manual_seed(22);
        auto x0 = torch::randn({2, ci, hw, hw}).contiguous(cl), w0 = torch::randn({co, ci, 3, 3}).contiguous(cl);
        auto b0 = torch::randn({co});
        REQUIRE(ops::dense_conv_supported(x0, w0, stride, 1, 1, 1));
        const auto gy = torch::randn(at::conv2d(x0, w0, {}, stride, 1).sizes()).contiguous(cl);
        auto run = [&](bool ours, at::ScalarType dt) {
          auto x = x0.to(dt).clone().requires_grad_(), w = w0.to(dt).clone().requires_grad_();
          auto b = bias ? b0.to(dt).clone().requires_grad_() : at::Tensor();
          auto y = ours ? ops::dense_conv_train(x, w, b, stride, 1) : at::conv2d(x, w, b, stride, 1);
          y.backward(gy.to(dt));
          std::vector<at::Tensor> r{y.detach(), x.grad(), w.grad(), bias ? b.grad() : torch::zeros({1}, dt)};
          for (auto& t : r) t = t.to(at::kDouble);
          return r;
        };
        const auto exact = run(false, at::kDouble), aten = run(false, at::kFloat), got = run(true, at::kFloat);
        for (size_t i = 0; i < 2; ++i) {
          INFO((i == 0 ? "output" : "input gradient"));
          if (winograd)
            CHECK(rel_err(got[i], exact[i]) <= 4 * rel_err(aten[i], exact[i]) + 1e-7);
          else
            CHECK(torch::equal(got[i], aten[i]));
        }
        for (size_t i = 2; i < got.size(); ++i) {
          INFO("gradient " << i);
          REQUIRE(got[i].sizes() == exact[i].sizes());
          CHECK(rel_err(got[i], exact[i]) < 2e-5);
        }
      }
  // Winograd's filters packed in float32 each step: those packed once in float64, within rounding,
  // and the input gradient's (transposed, rotated) ones
  {
    torch::manual_seed(23);
    const auto w = torch::randn({40, 24, 3, 3}).contiguous(cl);
    const auto fwd = ops::winograd_pack_3x3_train(w, false), back = ops::winograd_pack_3x3_train(w, true);
    REQUIRE(fwd.sizes() == at::IntArrayRef{16, 24, 40});
    REQUIRE(back.sizes() == at::IntArrayRef{16, 40, 24});
    CHECK(rel_err(fwd, ops::winograd_pack_3x3(w)) < 1e-6);
    CHECK(rel_err(back, ops::winograd_pack_3x3(w.transpose(0, 1).flip({2, 3}))) < 1e-6);
    CHECK(torch::equal(ops::winograd_pack_3x3_train(w.contiguous(), true), back));  // any weight layout
  }
  // what it takes: float32 channels-last, 3x3, stride 1 or 2, padding 1, one group, >= 64 channels
  auto x = torch::randn({2, 64, 8, 8}).contiguous(cl), w = torch::randn({64, 64, 3, 3}).contiguous(cl);
  CHECK(ops::dense_conv_supported(x, w, 1, 1, 1, 1));
  CHECK(ops::dense_conv_supported(x, w, 2, 1, 1, 1));
  CHECK_FALSE(ops::dense_conv_supported(x, w, 3, 1, 1, 1));
  CHECK_FALSE(ops::dense_conv_supported(x, w, 1, 0, 1, 1));
  CHECK_FALSE(ops::dense_conv_supported(x, w, 1, 1, 2, 1));
  CHECK_FALSE(ops::dense_conv_supported(x.contiguous(), w, 1, 1, 1, 1));  // NCHW
  CHECK_FALSE(ops::dense_conv_supported(x.to(at::kDouble), w.to(at::kDouble), 1, 1, 1, 1));
  CHECK_FALSE(ops::dense_conv_supported(x, torch::randn({64, 32, 3, 3}).contiguous(cl), 1, 1, 1, 2));  // groups
  CHECK_FALSE(ops::dense_conv_supported(x.narrow(1, 0, 32).contiguous(cl), torch::randn({64, 32, 3, 3}).contiguous(cl),
                                        1, 1, 1, 1));  // 32 channels in
  CHECK_FALSE(ops::dense_conv_supported(x, torch::randn({64, 64, 5, 5}).contiguous(cl), 1, 2, 1, 1));
  // in a model: a ResNet's training step takes it for its 3x3 convolutions; evaluation does not
  auto m = channels_last_training_model("resnet18");
  const auto in = torch::randn({2, 3, 64, 64}).contiguous(cl);
  const auto took = [](const std::set<std::string>& names) { return test::any_contains(names, "DenseConvFunction"); };
  const auto names = ops_called([&] { m->forward_features(in).sum().backward(); });
  CHECK(took(names));
  CHECK(names.count("imgtrain::winograd_conv3x3"));  // its 64- to 256-channel stages
  m->eval();
  CHECK_FALSE(took(ops_called([&] { m->forward_features(in).sum().backward(); })));
}

TEST_CASE("Plain 3x3 convolutions in inference run by Winograd on channels-last maps, within its rounding of ATen's",
          "[models][ops]") {
  // a detector's FPN, RPN and mask head convolutions (no BatchNorm): model_zoo's conv_module_forward
  // with inference kernels on takes Winograd's F(4x4, 3x3) or F(2x2, 3x3) in eval mode without
  // autograd, the filters packed on each call, so that a weight changed between calls is used at once
  const auto cl = at::MemoryFormat::ChannelsLast;
  struct Threads {  // two threads (the tile choice depends on the count), restored however the test ends
    int before = at::get_num_threads();
    Threads() { at::set_num_threads(2); }
    ~Threads() { at::set_num_threads(before); }
  } threads;
  torch::manual_seed(31);
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(48, 40, 3).padding(1));
  conv->eval();
  for (const auto& [n, hw] : std::vector<std::pair<int64_t, int64_t>>{{2, 32}, {3, 14}, {1, 5}}) {
    const int tile = ops::winograd_tile(n, hw, hw, 48, 40);
    INFO("batch " << n << " map " << hw << " tile " << tile);
    const auto x = torch::randn({n, 48, hw, hw}).contiguous(cl);
    torch::NoGradGuard ng;
    at::Tensor y;
    const auto ran = ops_called([&] { y = model_zoo::conv_module_forward(*conv, x, true); });
    CHECK(ran.count("imgtrain::winograd_conv3x3"));
    CHECK_FALSE(ran.count("aten::conv2d"));
    const auto exact = at::conv2d(x.to(at::kDouble), conv->weight.to(at::kDouble), conv->bias.to(at::kDouble), 1, 1);
    const auto aten = at::conv2d(x, conv->weight, conv->bias, 1, 1);
    const double scale = exact.abs().max().item<double>();
    const double err = (y.to(at::kDouble) - exact).abs().max().item<double>() / scale,
                 err_aten = (aten.to(at::kDouble) - exact).abs().max().item<double>() / scale;
    CHECK(err <= (tile == 2 ? std::max(4 * err_aten, 1e-6) : std::max(8 * err_aten, 4e-6)));
    CHECK(y.is_contiguous(cl));
    if (hw == 32) {  // a weight changed in place between calls: the next call uses it
      CHECK(tile == 4);
      conv->weight.mul_(-2);
      const auto y2 = model_zoo::conv_module_forward(*conv, x, true);
      const auto want = at::conv2d(x.to(at::kDouble), conv->weight.to(at::kDouble), conv->bias.to(at::kDouble), 1, 1);
      CHECK((y2.to(at::kDouble) - want).abs().max().item<double>() <= 8e-6 * want.abs().max().item<double>());
      conv->weight.div_(-2);
    }
  }
  // not taken: inference kernels off (torch's modules), with autograd recording, NCHW maps, fewer
  // than 32 channels, stride 2, training mode
  const auto x = torch::randn({2, 48, 16, 16}).contiguous(cl);
  auto takes = [&](torch::nn::Conv2dImpl& c, const at::Tensor& in, bool on = true) {
    return ops_called([&] { model_zoo::conv_module_forward(c, in, on); }).count("imgtrain::winograd_conv3x3") > 0;
  };
  {
    torch::NoGradGuard ng;
    CHECK(takes(*conv, x));
    CHECK_FALSE(takes(*conv, x, false));
    CHECK_FALSE(takes(*conv, x.contiguous()));
    torch::nn::Conv2d narrow(torch::nn::Conv2dOptions(48, 16, 3).padding(1));
    narrow->eval();
    CHECK_FALSE(takes(*narrow, x));
    torch::nn::Conv2d strided(torch::nn::Conv2dOptions(48, 40, 3).padding(1).stride(2));
    strided->eval();
    CHECK_FALSE(takes(*strided, x));
  }
  CHECK_FALSE(takes(*conv, x));  // autograd on
  conv->train();
  {
    torch::NoGradGuard ng;
    CHECK_FALSE(takes(*conv, x));  // training mode, no autograd: ATen's
  }
}

TEST_CASE("CUDA: the fused training BatchNorm equals torch's ops on the device and gives the same bits every run",
          "[cuda][ops]") {
  test::skip_unless(torch::cuda::is_available());
  const torch::Device dev(torch::kCUDA, 0);
  fused_bn_matches_modules(dev);
  for (bool cl : {false, true}) {
    INFO("channels-last " << cl);
    torch::manual_seed(4);
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x0 = torch::randn({8, 40, 30, 30}).contiguous(fmt), g = torch::randn({8, 40, 30, 30}).contiguous(fmt);
    auto res = torch::randn({8, 40, 30, 30}).contiguous(fmt);
    auto run = [&](torch::Device d) {
      auto x = x0.to(d).requires_grad_(true);
      auto w = torch::ones({40}, d).requires_grad_(true), b = torch::zeros({40}, d).requires_grad_(true);
      auto rm = torch::zeros({40}, d), rv = torch::ones({40}, d);
      auto y = ops::batch_norm_act_train(x, w, b, rm, rv, 0.1, 1e-5, ops::NormAct::SiLU, res.to(d));
      y.backward(g.to(d));
      std::vector<at::Tensor> out{y.detach(), x.grad(), w.grad(), rm, rv};
      for (auto& t : out) t = t.to(torch::kCPU);
      return out;
    };
    const auto a = run(dev), b = run(dev), host = run(torch::Device(torch::kCPU));
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("tensor " << i);
      CHECK(torch::equal(a[i], b[i]));       // no atomics: the same bits every run
      CHECK(rel_err(a[i], host[i]) < 1e-4);  // the CPU kernel's arithmetic, to float rounding
    }
  }
}

TEST_CASE("CUDA: squeeze-and-excite's fused backward equals torch's ops on the device, the same bits every run",
          "[cuda][ops]") {
  test::skip_unless(torch::cuda::is_available());
  const torch::Device dev(torch::kCUDA, 0);
  fused_se_matches_modules(dev);
  for (bool cl : {false, true}) {
    INFO("channels-last " << cl);
    torch::manual_seed(7);
    auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    auto x0 = torch::randn({16, 40, 20, 20}).contiguous(fmt).to(dev), g = torch::randn({16, 40, 20, 20}).contiguous(fmt).to(dev);
    auto w1 = torch::randn({8, 40, 1, 1}, dev), b1 = torch::randn({8}, dev), w2 = torch::randn({40, 8, 1, 1}, dev),
         b2 = torch::randn({40}, dev);
    auto run = [&] {
      auto x = x0.clone().requires_grad_(true);
      auto y = ops::se_gate_train(x, w1, b1, w2, b2, ops::SeAct::SiLU, ops::SeGate::Sigmoid);
      y.backward(g);
      return x.grad();
    };
    CHECK(torch::equal(run(), run()));
  }
}

TEST_CASE("CPU training defaults: NHWC and fused kernels for the BatchNorm convnets, fused in NCHW for ConvNeXt",
          "[models]") {
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 0);
  const auto fp32 = engine::resolve_amp(false, "", ""), bf16 = engine::resolve_amp(true, "bfloat16", "");
  for (const char* name : {"resnet50", "efficientnet_b0", "mobilenetv3_large_100"}) {
    INFO(name);
    CHECK(engine::nhwc_fused_training_default(name, cpu, fp32));
    CHECK(engine::fused_training_default(name, cpu, fp32));
    CHECK_FALSE(engine::fused_training_default(name, cpu, bf16));
    CHECK_FALSE(engine::fused_training_default(name, gpu, fp32));
  }
  CHECK_FALSE(engine::nhwc_fused_training_default("convnext_tiny", cpu, fp32));
  CHECK(engine::fused_training_default("convnext_tiny", cpu, fp32));
  CHECK_FALSE(engine::fused_training_default("convnext_tiny", cpu, bf16));
  CHECK_FALSE(engine::fused_training_default("convnext_tiny", gpu, fp32));
  CHECK_FALSE(engine::nhwc_fused_training_default("vit_small_patch16_224", cpu, fp32));
  CHECK(engine::fused_training_default("vit_small_patch16_224", cpu, fp32));  // the attention kernels
  CHECK_FALSE(engine::fused_training_default("vit_small_patch16_224", gpu, fp32));
  CHECK_FALSE(engine::fused_training_default("no_such_model", cpu, fp32));
}

TEST_CASE("a validation split with the train split's first classes is not warned about", "[engine][folder]") {
  // Each split's labels are its own sorted folder names: a validation split holding the train
  // split's first classes has the same indices; one that skips a class does not, and is warned.
  test::TempDir d("splits");
  cv::Mat im(8, 8, CV_8UC3, cv::Scalar(10, 20, 30));
  std::vector<uchar> png;
  cv::imencode(".png", im, png);
  const std::string bytes(png.begin(), png.end());
  for (auto f : {"train/cat/1.png", "train/dog/2.png", "train/eel/3.png", "val/cat/4.png", "val/dog/5.png",
                 "other/cat/6.png", "other/eel/7.png"})
    test::write_file(d / f, bytes);
  auto warnings = [&](const std::string& val) {
    auto cfg = *cli::parse(cli::Command::Train, {"--data-dir", d.path.string(), "--val-split", val, "--model",
                                                 "resnet18", "-b", "1", "--img-size", "32"});
    return test::stderr_of([&] { tasks::create_train_task(cfg, 0, 1); }, d);
  };
  CHECK(warnings("val").find("not the train split's") == std::string::npos);
  CHECK_THAT(warnings("other"), Catch::Contains("the validation split's classes (cat, eel) are not the train split's "
                                                "(cat, dog, eel)"));
}

TEST_CASE("a checkpoint's args.yaml values are read back as text", "[engine]") {
  engine::CheckpointMeta m;
  m.args = "opt: \"sgd\"\nmax_size: 1333\nname: 'it''s'\npath: \"a\\\"b\"\noptx: adamw\n";
  CHECK(m.arg("opt") == std::optional<std::string>("sgd"));
  CHECK(m.arg("max_size") == std::optional<std::string>("1333"));
  CHECK(m.arg("name") == std::optional<std::string>("it's"));
  CHECK(m.arg("path") == std::optional<std::string>("a\"b"));
  CHECK(!m.arg("op").has_value());
  CHECK(!m.arg("lr").has_value());
}

TEST_CASE("the normalisation flags (--mean, --std) replace the model's, also when validating the run's checkpoint", "[engine]") {
  const auto& d = model_zoo::model_defaults("resnet18");
  engine::DataOverrides o;
  o.mean = {0.5};
  o.std_dev = {0.1, 0.2, 0.3};
  auto dc = engine::resolve_data_config(o, d);
  CHECK(dc.mean == std::vector<double>{0.5, 0.5, 0.5});  // timm: one value for every channel
  CHECK(dc.std == std::vector<double>{0.1, 0.2, 0.3});
  o.in_chans = 1;
  CHECK_THAT(test::error_text<UserError>([&] { engine::resolve_data_config(o, d); }),
             Catch::Contains("--std 0.1 0.2 0.3: give one value or one per input channel (1)"));
  // validate --checkpoint takes the run's values from its args.yaml unless the flags are given
  test::TempDir dir("meanstd");
  cv::Mat im(8, 8, CV_8UC3, cv::Scalar(10, 20, 30));
  std::vector<uchar> png;
  cv::imencode(".png", im, png);
  test::write_file(dir / "val/a/1.png", std::string(png.begin(), png.end()));
  engine::CheckpointMeta m;
  m.arch = "resnet18";
  m.num_classes = 2;
  m.args = "mean: [0.25, 0.5, 0.75]\nstd: []\n";
  auto cfg = *cli::parse(cli::Command::Validate, {"--data-dir", dir.path.string(), "--split", "val"});
  auto s = tasks::create_validate_task(cfg, &m);
  CHECK(s.data.mean == std::vector<double>{0.25, 0.5, 0.75});
  CHECK(s.data.std == std::vector<double>(d.std.begin(), d.std.end()));
  cfg = *cli::parse(cli::Command::Validate, {"--data-dir", dir.path.string(), "--split", "val", "--mean", "0.1"});
  CHECK(tasks::create_validate_task(cfg, &m).data.mean == std::vector<double>{0.1, 0.1, 0.1});
}
