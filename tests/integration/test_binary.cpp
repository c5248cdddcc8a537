// Drives the real imgtrain binary on small real data: Fashion-MNIST images written as PNG folders.
#include "data/dataset.h"
#include "engine/checkpoint.h"
#include "io/weights.h"
#include "io/safetensors.h"
#include "model_zoo/registry.h"
#include "test_util.h"
#include "integration/fixtures.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <opencv2/imgcodecs.hpp>
#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>

namespace fs = std::filesystem;
using namespace imgtrain;

namespace {

const std::string kBin = IMGTRAIN_BIN;
const std::string kPython = std::string(IMGTRAIN_SOURCE_DIR) + "/.venv/bin/python";

// A user error: exit code 2, one line of message, no crash.
void expect_user_error(const test::RunResult& r, const std::string& needle) {
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("imgtrain: error:") && Catch::Contains(needle));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}

const std::string kSmallArgs =
    " --model resnet18 --img-size 28 --in-chans 1 -b 50 -vb 250 --lr 0.1 --warmup-epochs 0 --scale 0.7 1.0"
    " --train-interpolation bilinear --weight-decay 1e-4 -j 2 --device cpu --log-interval 20 ";

}  // namespace

TEST_CASE("trains far above chance, validates, resumes at the next epoch, loads in timm", "[integration]") {
  auto data = test::fmnist_folder();
  test::TempDir out("train");
  auto r = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 3 --output " + out.path.string() +
                     " --experiment run");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::string run = out / "run";
  for (auto f : {"args.yaml", "summary.csv", "last.safetensors", "model_best.safetensors", "checkpoint-2.safetensors",
                 "log.txt"})
    CHECK(fs::exists(run + "/" + f));
  CHECK_THAT(r.output, Catch::Contains("Train: 2 [  39/40 (100%)]") && Catch::Contains("*** Best metric:"));
  // a ResNet on the CPU in float32: channels-last and the fused BatchNorm kernels by default
  CHECK_THAT(r.output, Catch::Contains("Training layout channels-last (NHWC), BatchNorm fused"));
  // log.txt holds the whole run, the lines before the run folder existed too
  const std::string log_txt = test::read_file(run + "/log.txt");
  CHECK_THAT(log_txt, Catch::Contains("Model resnet18 created, param count:") && Catch::Contains("Scheduled epochs") &&
                          Catch::Contains("*** Best metric:"));
  auto rows = test::read_csv(run + "/summary.csv");
  REQUIRE(rows.size() == 4);
  CHECK(rows[0] == std::vector<std::string>{"epoch", "train_loss", "eval_loss", "eval_top1", "eval_top5", "lr"});
  double top1 = std::stod(rows[3][3]);
  CHECK(top1 > 60.0);  // chance is 10%

  // validate on the same split reproduces the last epoch's accuracy.
  auto v = test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --data-dir " + data +
                     " --model resnet18 --device cpu -b 100");
  INFO(v.output);
  REQUIRE(v.code == 0);
  std::smatch m;
  std::string vo = v.output;
  REQUIRE(std::regex_search(vo, m, std::regex("\"top1\": ([0-9.]+)")));
  CHECK(std::stod(m[1]) == Approx(top1).margin(1e-3));
  auto vr = test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --data-dir " + data +
                      " --device cpu -b 100 --results-file " + (out / "val.csv"));
  INFO(vr.output);
  REQUIRE(vr.code == 0);
  auto vrows = test::read_csv(out / "val.csv");
  REQUIRE(vrows.size() == 2);
  CHECK(vrows[0] == std::vector<std::string>{"model", "top1", "top1_err", "top5", "top5_err", "param_count",
                                             "img_size", "crop_pct", "interpolation"});
  CHECK(vrows[1][0] == "resnet18");
  CHECK(std::stod(vrows[1][1]) == Approx(top1).margin(1e-3));
  // --fuse-bn (BatchNorm folded into the convolutions, oneDNN post-ops): the same accuracy up to
  // an image whose two best logits are within float rounding of each other
  for (const char* layout : {"", " --channels-last"}) {
    auto vf = test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --data-dir " + data +
                        " --device cpu -b 100 --fuse-bn" + layout);
    INFO(vf.output);
    REQUIRE(vf.code == 0);
    std::string vfo = vf.output;
    REQUIRE(std::regex_search(vfo, m, std::regex("\"top1\": ([0-9.]+)")));
    CHECK(std::stod(m[1]) == Approx(top1).margin(0.11));
  }
  expect_user_error(test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --data-dir " + data +
                              " --device cpu --fuse-bn --amp"),
                    "--fuse-bn has no effect with --amp");
  // benchmark's inference folds BatchNorm by default: no BatchNorm op runs (the profile's op list)
  const std::string bench = kBin + " benchmark --device cpu --model resnet18 --bench inference -b 2 --img-size 64 "
                                   "--num-warm-iter 1 --num-bench-iter 2 --profile";
  auto fused = test::run(bench);
  INFO(fused.output);
  REQUIRE(fused.code == 0);
  CHECK_THAT(fused.output, Catch::Contains("\"infer_fuse_bn\": true") && Catch::Contains("mkldnn::_convolution_pointwise") &&
                               !Catch::Contains("batch_norm"));
  auto plain = test::run(bench + " --fuse-bn=false");
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.output, Catch::Contains("\"infer_fuse_bn\": false") && Catch::Contains("aten::native_batch_norm"));
  // training with --fuse-bn: BatchNorm, residual add and ReLU run as imgtrain's kernel (no ATen
  // batch_norm op); with --fuse-bn=false torch's modules. A ResNet on the CPU in float32 gets the
  // fused kernels and channels-last by default; --amp keeps timm's defaults.
  const std::string train_bench = kBin + " benchmark --device cpu --model resnet18 --bench train -b 2 --img-size 64 "
                                         "--num-warm-iter 1 --num-bench-iter 2 --profile";
  auto fused_train = test::run(train_bench + " --fuse-bn");
  INFO(fused_train.output);
  REQUIRE(fused_train.code == 0);
  CHECK_THAT(fused_train.output, Catch::Contains("\"train_fuse_bn\": true") && !Catch::Contains("batch_norm"));
  auto default_train = test::run(train_bench);
  INFO(default_train.output);
  REQUIRE(default_train.code == 0);
  CHECK_THAT(default_train.output, Catch::Contains("\"train_fuse_bn\": true") && !Catch::Contains("batch_norm") &&
                                       Catch::Contains("\"train_channels_last\": true"));
  auto plain_train = test::run(train_bench + " --fuse-bn=false --channels-last=false");
  INFO(plain_train.output);
  REQUIRE(plain_train.code == 0);
  CHECK_THAT(plain_train.output, Catch::Contains("\"train_fuse_bn\": false") &&
                                     Catch::Contains("\"train_channels_last\": false") &&
                                     Catch::Contains("aten::native_batch_norm_backward"));
  auto amp_train = test::run(train_bench + " --amp --amp-dtype bfloat16");
  INFO(amp_train.output);
  REQUIRE(amp_train.code == 0);
  CHECK_THAT(amp_train.output, Catch::Contains("\"train_fuse_bn\": false") &&
                                   Catch::Contains("\"train_channels_last\": false"));

  // Resume: continues at epoch 3, not 0, and appends to the same summary.
  auto r2 = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 4 --output " + out.path.string() +
                      " --experiment run --resume " + run + "/last.safetensors");
  INFO(r2.output);
  REQUIRE(r2.code == 0);
  CHECK_THAT(r2.output, Catch::Contains("Resumed from checkpoint") && Catch::Contains("Train: 3 [   0/40"));
  CHECK_THAT(r2.output, !Catch::Contains("Train: 0 ["));
  rows = test::read_csv(run + "/summary.csv");
  REQUIRE(rows.size() == 5);
  CHECK(rows[4][0] == "3");
  auto st = io::load_safetensors(run + "/last.safetensors");
  CHECK(st.metadata.at("epoch") == "3");
  CHECK(st.metadata.at("num_updates") == "160");

  // args.yaml goes back in through -c.
  auto again = test::run(kBin + " train -c " + run + "/args.yaml --epochs 4 --start-epoch 4 --output " +
                         out.path.string() + " --experiment again");
  INFO(again.output);
  CHECK(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("Nothing trained: training starts at epoch 4 and --epochs is 4"));
  // Resuming with another optimizer is said (timm restores what the new one shares by name, silently).
  auto switched = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 4 --opt adamw --output " +
                            out.path.string() + " --experiment switched --resume " + run + "/last.safetensors");
  INFO(switched.output);
  CHECK(switched.code == 0);
  CHECK_THAT(switched.output, Catch::Contains("the checkpoint's optimizer was --opt sgd, this run's is --opt adamw"));
  // validate --use-ema of a checkpoint without EMA weights validates the model, and says so
  auto no_ema = test::run(kBin + " validate --device cpu --data-dir " + data + " --checkpoint " + run +
                          "/last.safetensors --use-ema");
  INFO(no_ema.output);
  CHECK(no_ema.code == 0);
  CHECK_THAT(no_ema.output, Catch::Contains("--use-ema: '") && Catch::Contains("holds no EMA weights"));

  // The checkpoint loads into timm (strict) and gives the same outputs.
  REQUIRE(fs::exists(kPython));  // scripts/setup.sh --test installs timm there
  ModelArgs a;
  a.num_classes = 10;
  a.in_chans = 1;
  auto model = model_zoo::create_model("resnet18", a);
  io::load_state_dict(*model, st, "model.", "last");
  model->eval();
  torch::manual_seed(5);
  auto x = torch::randn({3, 1, 28, 28});
  torch::NoGradGuard ng;
  auto y = model->forward(x);
  io::save_safetensors(out / "x.safetensors", {{"x", x}});
  auto timm_out = [&](const std::string& mode, const std::string& file) {
    auto py = test::run(kPython + " " + IMGTRAIN_SOURCE_DIR + "/tests/parity/timm_forward.py " + mode + " " + file +
                        " resnet18 10 1 " + (out / "x.safetensors") + " " + (out / "y.safetensors"));
    INFO(py.output);
    REQUIRE(py.code == 0);
    return *io::load_safetensors(out / "y.safetensors").find("y");
  };
  CHECK((timm_out("checkpoint", run + "/last.safetensors") - y).abs().max().item<double>() < 1e-4);

  // `imgtrain export` writes a plain state dict that timm's pretrained loader takes.
  auto ex = test::run(kBin + " export --checkpoint " + run + "/last.safetensors --out " + (out / "model.safetensors"));
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  auto exported = io::load_safetensors(out / "model.safetensors");
  CHECK(exported.find("conv1.weight") != nullptr);
  CHECK(exported.find("optim.conv1.weight.momentum_buffer") == nullptr);
  CHECK((timm_out("export", out / "model.safetensors") - y).abs().max().item<double>() < 1e-4);
  expect_user_error(test::run(kBin + " export --checkpoint " + run + "/last.safetensors --out " + (out / "m.bin")),
                    ".safetensors");
  expect_user_error(test::run(kBin + " export --checkpoint " + run + "/last.safetensors --use-ema --out " +
                              (out / "e.safetensors")),
                    "no EMA weights");
  // Resuming a checkpoint of another architecture: one line, before any progress line.
  expect_user_error(test::run(kBin + " train --device cpu --model resnet34 --data-dir " + data + " --resume " + run +
                              "/last.safetensors"),
                    "checkpoint is a resnet18, but --model is resnet34");
  // validate takes the checkpoint's model only where no --model is given: --model resnet50 (the
  // flag's default value, given) is validated as resnet50, which these weights do not fit.
  expect_user_error(test::run(kBin + " validate --device cpu --model resnet50 --data-dir " + data + " --checkpoint " +
                              run + "/last.safetensors"),
                    "do not fit the model");
}

TEST_CASE("pretrained timm weights are found in the offline hub cache and adapted", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  const std::string hub = std::string(IMGTRAIN_PARITY_DIR) + "/hub";
  auto r = test::run("HF_HUB_CACHE=" + hub + " " + kBin + " validate --pretrained --model resnet18 --data-dir " + data +
                     " --in-chans 1 --num-classes 10 --device cpu");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("models--timm--resnet18.a1_in1k/snapshots/0123abcd/model.safetensors") &&
                           Catch::Contains("adapted conv1.weight from 3 to 1 input channels") &&
                           Catch::Contains("classifier fc re-initialised") && Catch::Contains("\"top1\""));
  CHECK_THAT(r.output, Catch::Contains("WARNING: --num-classes 10: '") &&
                           Catch::Contains("so the fc scored here is initialised at random"));
  // Without --num-classes the weights' classifier is scored, with its 1000 classes (timm's
  // validate.py builds the model with the pretrained head), never one initialised for the folder
  auto own = test::run("HF_HUB_CACHE=" + hub + " " + kBin + " validate --pretrained --model resnet18 --data-dir " +
                       data + " --in-chans 1 --device cpu");
  INFO(own.output);
  CHECK(own.code == 0);
  CHECK_THAT(own.output, !Catch::Contains("re-initialised") && !Catch::Contains("WARNING") &&
                             Catch::Contains("param count: 11683240"));  // 1-channel conv1, 1000-class fc
  // An explicit tag that is not in the cache: the error says where it looked.
  test::TempDir empty("hub");
  expect_user_error(test::run("HF_HUB_CACHE=" + empty.path.string() + " " + kBin +
                              " validate --pretrained --model resnet18.tv_in1k --data-dir " + data + " --device cpu"),
                    "models--timm--resnet18.tv_in1k");
  // a tag timm does not have for the model: said as such, not as a missing cache file
  expect_user_error(test::run("HF_HUB_CACHE=" + empty.path.string() + " " + kBin +
                              " validate --pretrained --model resnet18.nosuchtag --data-dir " + data + " --device cpu"),
                    "'nosuchtag' is not one of timm's pretrained tags for resnet18 (a1_in1k, a2_in1k");
  // --pretrained-path with timm's file trains from it.
  test::TempDir out("pre");
  auto t = test::run(kBin + " train --pretrained-path " + hub +
                     "/models--timm--resnet18.a1_in1k/snapshots/0123abcd/model.safetensors --data-dir " + data +
                     kSmallArgs + " --epochs 1 --output " + out.path.string() + " --experiment p");
  INFO(t.output);
  CHECK(t.code == 0);
  CHECK_THAT(t.output, Catch::Contains("Loaded pretrained weights"));
}

TEST_CASE("EMA, accumulation and clipping train, checkpoint, resume and export", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("ema");
  const std::string args = " --data-dir " + data + kSmallArgs + " -b 25 --grad-accum-steps 2 --model-ema " +
                           "--model-ema-decay 0.9 --clip-grad 2 --opt adamw --lr 1e-3 --output " + out.path.string() +
                           " --experiment e";
  auto r = test::run(kBin + " train" + args + " --epochs 1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Test (EMA): [") && Catch::Contains("Train: 0 [   3/4 (100%)]"));
  auto st = io::load_safetensors(out / "e/last.safetensors");
  CHECK(st.find("ema.conv1.weight") != nullptr);
  CHECK(st.find("optim.conv1.weight.exp_avg") != nullptr);
  CHECK(st.metadata.at("num_updates") == "4");  // 8 micro-batches of 25, 2 per update
  auto r2 = test::run(kBin + " train" + args + " --epochs 2 --resume " + (out / "e/last.safetensors"));
  INFO(r2.output);
  REQUIRE(r2.code == 0);
  CHECK_THAT(r2.output, Catch::Contains("Train: 1 [   0/4"));
  auto st2 = io::load_safetensors(out / "e/last.safetensors");
  CHECK(st2.metadata.at("num_updates") == "8");
  auto ex = test::run(kBin + " export --use-ema --checkpoint " + (out / "e/last.safetensors") + " --out " +
                      (out / "ema.safetensors"));
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  auto e = io::load_safetensors(out / "ema.safetensors");
  CHECK(torch::equal(*e.find("conv1.weight"), *st2.find("ema.conv1.weight")));
  CHECK_FALSE(torch::equal(*e.find("conv1.weight"), *st2.find("model.conv1.weight")));
}

TEST_CASE("mixed precision: float16 with a loss scaler, bfloat16 without", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("amp");
  auto r = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 1 --amp --output " +
                     out.path.string() + " --experiment h");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("mixed precision (dynamic loss scaling)"));
  auto st = io::load_safetensors(out / "h/last.safetensors");
  REQUIRE(st.find("scaler.scale") != nullptr);
  CHECK(st.find("scaler.scale")->item<float>() > 0);
  auto b = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 1 --amp-opt-level O1 " +
                     "--amp-dtype bfloat16 --channels-last --output " + out.path.string() + " --experiment b");
  INFO(b.output);
  CHECK(b.code == 0);
  CHECK_THAT(b.output, Catch::Contains("Using native Torch AMP. Training in mixed precision (bfloat16, no loss scaling)."));
  // apex O2 (bfloat16 on the CPU): half weights, float32 BatchNorm and masters in the checkpoint,
  // and it resumes and validates
  const std::string o2 = " train --data-dir " + data + kSmallArgs + " --amp-opt-level O2 --amp-dtype bfloat16 " +
                         "--output " + out.path.string() + " --experiment o2";
  auto c = test::run(kBin + o2 + " --epochs 1");
  INFO(c.output);
  REQUIRE(c.code == 0);
  CHECK_THAT(c.output, Catch::Contains("Using apex O2: bfloat16 weights with float32 master weights. Training in mixed "
                                       "precision (bfloat16, no loss scaling)."));
  auto so = io::load_safetensors(out / "o2/last.safetensors");
  CHECK(so.find("model.conv1.weight")->scalar_type() == at::kBFloat16);
  CHECK(so.find("model.bn1.weight")->scalar_type() == at::kFloat);
  CHECK(so.find("master.conv1.weight")->scalar_type() == at::kFloat);
  CHECK(torch::equal(*so.find("model.conv1.weight"), so.find("master.conv1.weight")->to(at::kBFloat16)));
  auto c2 = test::run(kBin + o2 + " --epochs 2 --resume " + (out / "o2/last.safetensors"));
  INFO(c2.output);
  CHECK(c2.code == 0);
  CHECK_THAT(c2.output, Catch::Contains("Train: 1 ["));
  auto v = test::run(kBin + " validate --data-dir " + data + " --split val --checkpoint " +
                     (out / "o2/last.safetensors") + " -b 50 --device cpu");
  INFO(v.output);
  CHECK(v.code == 0);
}

TEST_CASE("mixup, cutmix and BCE loss train end to end", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("mix");
  auto r = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 2 --mixup 0.2 --cutmix 1.0 " +
                     "--mixup-mode pair --mixup-off-epoch 1 --bce-loss --output " + out.path.string() +
                     " --experiment m");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Train: 1 [   3/4 (100%)]"));
  expect_user_error(test::run(kBin + " train --data-dir " + data + kSmallArgs + " -b 25 --mixup 0.2 --output " +
                              out.path.string()),
                    "even batch size");
}

TEST_CASE("a corrupt image is skipped with a warning naming it, and training completes", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir d("corrupt");
  fs::copy(data, d.path, fs::copy_options::recursive);
  test::write_file(d / "train/class_3/zz_broken.png", "\x89PNG\r\n\x1a\n this is not really a png");
  test::TempDir out("corrupt-out");
  auto r = test::run(kBin + " train --data-dir " + d.path.string() + kSmallArgs + " --epochs 1 --output " +
                     out.path.string() + " --experiment c");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("zz_broken.png") && Catch::Contains("skipped 1 unreadable image"));
  CHECK(fs::exists(out / "c/last.safetensors"));
}

TEST_CASE("user errors give one clear line and exit code 2", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir d("errors");
  expect_user_error(test::run(kBin + " train --model resnet18"), "--data-dir");
  expect_user_error(test::run(kBin + " train --data-dir " + d.path.string() + "/nowhere"), "nowhere");
  fs::create_directories(d / "empty/train/a");
  fs::create_directories(d / "empty/val/a");
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + (d / "empty")), "no images");
  expect_user_error(test::run(kBin + " train --model resnet51 --data-dir " + data), "closest: resnet50");
  test::write_file(d / "bad.yaml", "model: resnet18\nbatchsize: 3\n");
  expect_user_error(test::run(kBin + " train -c " + (d / "bad.yaml")), "unknown key 'batchsize'");
  expect_user_error(test::run(kBin + " train -b -3"), "--batch-size");
  expect_user_error(test::run(kBin + " train --lr abc"), "--lr 'abc'");
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + data + " --resume " + (d / "missing.st")),
                    "--resume");
  test::write_file(d / "garbage.safetensors", "garbage!garbage!");
  expect_user_error(test::run(kBin + " validate --device cpu --data-dir " + data + " --checkpoint " +
                              (d / "garbage.safetensors")),
                    "not a valid safetensors file");
  expect_user_error(test::run(kBin + " models nosuchmodel"), "no model matches");
  // a --results-file that cannot be written: refused before the evaluation or benchmark, and no file left
  for (const std::string& cmd : {"validate --model resnet18 --data-dir " + data + " --pretrained-path " +
                                    (d / "garbage.safetensors"),
                                std::string("benchmark --model resnet18 --bench inference")}) {
    expect_user_error(test::run(kBin + " " + cmd + " --device cpu --results-file " + (d / "nowhere/r.json")),
                      "--results-file '" + (d / "nowhere/r.json") + "': cannot write the file");
    expect_user_error(test::run(kBin + " " + cmd + " --device cpu --results-file " + d.path.string()),
                      "a folder; give a file name");
  }
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + data + " --resume auto"), "--experiment");
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + data + " --nproc-per-node 2 --nnodes 2"),
                    "--master-port");
  expect_user_error(test::run(kBin + " pack --data-dir " + data + " --out " + (d / "s") + " --shard-size 3XB"),
                    "--shard-size");
  expect_user_error(test::run(kBin + " pack --data-dir " + (d / "nowhere") + " --out " + (d / "s")), "nowhere");
  // an --experiment that climbs out of --output: one line, before the model is built
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + data + " --experiment ../escape --output " +
                              (d / "o")),
                    "--experiment '../escape': a folder name under --output");
  // shards are not written among the images they are made from
  expect_user_error(test::run(kBin + " pack --data-dir " + data + " --out " + data), "the same folder as --data-dir");
  expect_user_error(test::run(kBin + " pack --data-dir " + data + " --out " + data + "/train/../shards"),
                    "is inside --data-dir");
  // every command's unknown flag: the project's one line with a suggestion, not the parser's text
  for (const char* cmd : {"export", "pack", "evaluate-coco", "coco-info"})
    expect_user_error(test::run(kBin + " " + cmd + " --bogus"), "unknown flag '--bogus'");
  // A stray positional argument is refused, not silently dropped (the shard size here).
  expect_user_error(test::run(kBin + " pack --data-dir " + data + " --out " + (d / "s") + " --shard-size 1GB 500MB"),
                    "unexpected argument '500MB'");
  expect_user_error(test::run(kBin + " export --checkpoint a.safetensors --out b.safetensors extra"),
                    "unexpected argument 'extra'");
  expect_user_error(test::run(kBin + " train --device cpu --data-dir " + data + " --eval-metric top3"),
                    "--eval-metric 'top3': expected one of loss, top1, top5");
  // Help lists long aliases (timm's --accumulation-steps spelling).
  auto help = test::run(kBin + " train --help");
  INFO(help.output);
  CHECK(help.code == 0);
  CHECK_THAT(help.output, Catch::Contains("alias: --accumulation-steps") && Catch::Contains("alias: -vb") &&
                              Catch::Contains("O2 = half weights"));
  auto r = test::run(kBin + " frobnicate");
  CHECK(r.code == 2);
}

TEST_CASE("benchmark prints timm's fields and writes the results file", "[integration]") {
  test::TempDir d("bench");
  auto r = test::run(kBin + " benchmark --model resnet18 --bench both -b 2 --img-size 64 --num-warm-iter 1 " +
                     "--num-bench-iter 2 --device cpu --results-file " + (d / "r.json") + " --results-format json");
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(test::read_file(d / "r.json"));
  for (auto k : {"infer_samples_per_sec", "infer_step_time", "infer_batch_size", "infer_img_size",
                 "train_samples_per_sec", "train_step_time", "train_batch_size", "train_img_size", "param_count"})
    CHECK(j.contains(k));
  CHECK(j["train_batch_size"] == 2);
  CHECK(j["infer_img_size"] == 64);
  CHECK(j["param_count"] == 11.69);
  CHECK(j["train_samples_per_sec"].get<double>() > 0);
  auto t = test::run(kBin + " benchmark --model resnet18 --bench inference -b 1 --num-warm-iter 0 " +
                     "--num-bench-iter 1 --device cpu");
  INFO(t.output);
  CHECK_THAT(t.output, Catch::Contains("\"infer_img_size\": 288") && !Catch::Contains("train_"));  // timm's test size
  expect_user_error(test::run(kBin + " benchmark --bench fast"), "inference, train, both");
  // --profile: the phases of a step and the ops with the most self time (the fused SGD kernel among them)
  auto p = test::run(kBin + " benchmark --model resnet18 --bench train -b 2 --img-size 64 --num-warm-iter 1 " +
                     "--num-bench-iter 2 --device cpu --profile");
  INFO(p.output);
  REQUIRE(p.code == 0);
  CHECK_THAT(p.output, Catch::Contains("Profile of 2 train steps") && Catch::Contains("forward") &&
                           Catch::Contains("optimizer") && Catch::Contains("aten::convolution_backward") &&
                           Catch::Contains("aten::_fused_sgd_") && Catch::Contains("\"train_optimizer_ms\""));
  auto pl = test::run(kBin + " benchmark --model resnet18 --bench train -b 2 --img-size 64 --num-warm-iter 1 " +
                      "--num-bench-iter 2 --device cpu --profile --opt-impl loop");
  INFO(pl.output);
  CHECK_THAT(pl.output, Catch::Contains("aten::convolution_backward") && !Catch::Contains("aten::_fused_sgd_"));
  // imgtrain's own kernels are rows of the op list (not phases): RMSpropTF's single-pass step
  auto pr = test::run(kBin + " benchmark --model resnet18 --bench train -b 2 --img-size 64 --num-warm-iter 1 " +
                      "--num-bench-iter 2 --device cpu --profile --opt rmsproptf");
  INFO(pr.output);
  CHECK_THAT(pr.output, Catch::Contains("imgtrain::rmsprop_tf_step"));
  expect_user_error(test::run(kBin + " benchmark --bench data --profile --data-dir /nonexistent"), "--profile has no effect");
  // --bench data / data-eval: the input pipeline alone; a run over few batches is told how far off
  // its rate can be (the loader's threads finish their batches together)
  const auto folder = test::fmnist_folder(200, 100);
  for (const char* which : {"data", "data-eval"}) {
    auto few = test::run(kBin + " benchmark --bench " + which + " --data-dir " + folder +
                         " -b 8 --img-size 32 -j 2 --num-warm-iter 1 --num-bench-iter 4");
    INFO(few.output);
    REQUIRE(few.code == 0);
    CHECK_THAT(few.output, Catch::Contains("--num-bench-iter 4: 2 threads") && Catch::Contains("\"images\": 200") &&
                               Catch::Contains("\"data_samples_per_sec\""));
    auto enough = test::run(kBin + " benchmark --bench " + which + " --data-dir " + folder +
                            " -b 8 --img-size 32 -j 2 --num-warm-iter 1 --num-bench-iter 20");
    INFO(enough.output);
    REQUIRE(enough.code == 0);
    CHECK_THAT(enough.output, !Catch::Contains("--num-bench-iter") && Catch::Contains("\"data_samples_per_sec\"") &&
                                  Catch::Contains("\"skipped_reads\": 0") && Catch::Contains("\"passes\": "));
  }

  // --cuda-graph: refused where it cannot hold, in one line
  expect_user_error(test::run(kBin + " benchmark --model resnet18 --cuda-graph --device cpu"),
                    "--cuda-graph needs a CUDA device");
  expect_user_error(test::run(kBin + " benchmark --model fasterrcnn_mobilenet_v3_large_320_fpn --cuda-graph"),
                    "cannot be captured");
  // a detector: the same fields, its own parameter count
  auto det = test::run(kBin + " benchmark --model fasterrcnn_mobilenet_v3_large_320_fpn -b 1 --img-size 96 " +
                       "--num-warm-iter 0 --num-bench-iter 1 --device cpu --results-file " + (d / "det.json") +
                       " --results-format json");
  INFO(det.output);
  REQUIRE(det.code == 0);
  auto dj = nlohmann::json::parse(test::read_file(d / "det.json"));
  CHECK(dj["param_count"] == 19.41);
  CHECK(dj["train_img_size"] == 96);
  CHECK(dj["infer_samples_per_sec"].get<double>() > 0);
  CHECK(dj["train_samples_per_sec"].get<double>() > 0);
  // a detector trains on the CPU in float32 in channels-last with the fused kernels by default (as
  // train does); its inference keeps NCHW with the BatchNorm folded
  CHECK(dj["train_channels_last"] == true);
  CHECK(dj["train_fuse_bn"] == true);
  CHECK(dj["infer_channels_last"] == false);
  CHECK(dj["infer_fuse_bn"] == true);
}

TEST_CASE("a ViT trains at a custom image size, and a size off the patch grid is refused", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("vit");
  const std::string args = " --model vit_tiny_patch16_224 --in-chans 1 -b 50 --opt adamw --lr 1e-3 --warmup-epochs 0 "
                           "--drop-path 0.1 -j 2 --device cpu --epochs 1 --output " + out.path.string();
  auto r = test::run(kBin + " train --data-dir " + data + args + " --img-size 32 --experiment v");
  INFO(r.output);
  CHECK(r.code == 0);
  auto st = io::load_safetensors(out / "v/last.safetensors");
  REQUIRE(st.find("model.pos_embed") != nullptr);
  CHECK(st.find("model.pos_embed")->sizes() == std::vector<int64_t>{1, 5, 192});  // 2x2 patches + class token
  // validate with flags that build another model: the error says which flag, and what resamples
  const std::string ck = out / "v/last.safetensors";
  const std::string val = kBin + " validate --device cpu --data-dir " + data + " --checkpoint " + ck;
  expect_user_error(test::run(val + " --gp avg"),
                    "(the checkpoint was trained with the model's default pooling; --gp avg builds other layers)");
  expect_user_error(test::run(val + " --img-size 64"),
                    "(the checkpoint was trained at --img-size 32; --checkpoint loads weights as they are: --model "
                    "vit_tiny_patch16_224 --pretrained-path " + ck + " resamples a ViT's position embeddings)");
  // weights that do not fit for another reason: no hint about flags that did not cause it
  auto other = test::run(val + " --gp token --in-chans 3");
  expect_user_error(other, "wrong shape patch_embed.proj.weight");
  CHECK_THAT(other.output, !Catch::Contains("--gp token builds") && !Catch::Contains("resamples"));
  auto rs = test::run(kBin + " validate --device cpu --data-dir " + data + " --model vit_tiny_patch16_224 --in-chans 1 "
                      "--num-classes 10 --img-size 64 --pretrained-path " + ck);
  INFO(rs.output);
  CHECK(rs.code == 0);
  CHECK_THAT(rs.output, Catch::Contains("resampled pos_embed from 5 to 17 tokens"));
  expect_user_error(test::run(kBin + " train --data-dir " + data + args + " --img-size 28"), "multiple of its patch size 16");
  // ConvNeXt's unpadded stem and downsamplings need 32 px
  expect_user_error(test::run(kBin + " train --data-dir " + data + " --model convnext_tiny --in-chans 1 --img-size 31 " +
                              "--device cpu --epochs 1 --output " + out.path.string()),
                    "convnext_tiny needs at least 32 px");
}

TEST_CASE("a batch of one reaching 1x1 maps under BatchNorm is the user's choice, said in one line", "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("b1");
  auto r = test::run(kBin + " train --data-dir " + data + " --model resnet18 --in-chans 1 --img-size 32 -b 1 -j 1 "
                     "--device cpu --epochs 1 --output " + out.path.string());
  INFO(r.output);
  CHECK(r.code == 2);  // after the start-up log, the error is the one line that ends the output
  CHECK_THAT(r.output, Catch::EndsWith("imgtrain: error: a BatchNorm layer got one value per channel in training (a "
                                       "batch of 1 reaching 1x1 feature maps): use -b/--batch-size of at least 2 per "
                                       "process, or a larger --img-size\n"));
  CHECK_THAT(r.output, !Catch::Contains("internal error"));
}

TEST_CASE("a checkpoint naming a model imgtrain does not know is refused by its metadata, not by --model", "[integration][fault]") {
  test::TempDir d("archbad");
  io::save_safetensors(d / "ck.safetensors", {{"w", torch::ones({2})}}, {{"arch", "notamodel"}});
  auto e = test::run(kBin + " export --checkpoint " + (d / "ck.safetensors") + " --out " +
                     (d / "o.safetensors"));
  expect_user_error(e, "metadata 'arch' is 'notamodel'");
  CHECK_THAT(e.output, !Catch::Contains("--model"));
  auto data = test::fmnist_folder(20, 10);
  auto v = test::run(kBin + " validate --data-dir " + data + " --device cpu --checkpoint " + (d / "ck.safetensors"));
  expect_user_error(v, "metadata 'arch' is 'notamodel'");
}

TEST_CASE("a damaged generator state or a recovery point past the epoch's end is refused by name on --resume",
          "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("badstate");
  const std::string args = " --data-dir " + data + kSmallArgs + " --output " + out.path.string() + " --experiment e";
  auto r = test::run(kBin + " train" + args + " --epochs 1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto ck = io::load_safetensors(out / "e/last.safetensors");
  auto damaged = [&](const std::string& name, const std::function<void(io::SafeTensors&)>& edit) {
    auto c = ck;
    edit(c);
    const std::string path = out / name;
    io::save_safetensors(path, c.tensors, c.metadata);
    return test::run(kBin + " train" + args + " --epochs 2 --resume " + path);
  };
  // after the start-up log, the error is the one line that ends the output
  auto last_line_error = [](const test::RunResult& res, const std::string& needle) {
    INFO(res.output);
    CHECK(res.code == 2);
    const auto start = res.output.rfind("imgtrain: error: ");
    REQUIRE(start != std::string::npos);
    CHECK(res.output.find('\n', start) == res.output.size() - 1);
    CHECK_THAT(res.output.substr(start), Catch::Contains(needle));
    CHECK_THAT(res.output, !Catch::Contains("internal error"));
  };
  last_line_error(damaged("rng.safetensors",
                          [](io::SafeTensors& c) {
                            for (auto& [k, v] : c.tensors)
                              if (k == "rng.cpu") v = torch::zeros({100}, torch::kUInt8);
                          }),
                  "tensor 'rng.cpu' is not a CPU generator state");
  last_line_error(damaged("rec.safetensors", [](io::SafeTensors& c) { c.metadata["recovery_update"] = "999999"; }),
                  "metadata 'recovery_update' is 999999, but an epoch here has");
  // the optimizer's state: another shape, or NaN (not "training diverged (lower --lr?)" later)
  last_line_error(damaged("shape.safetensors",
                          [](io::SafeTensors& c) {
                            for (auto& [k, v] : c.tensors)
                              if (k == "optim.fc.weight.momentum_buffer") v = v.narrow(0, 0, 1).clone();
                          }),
                  "optimizer state 'fc.weight.momentum_buffer' has shape 1x");
  last_line_error(damaged("nan.safetensors",
                          [](io::SafeTensors& c) {
                            for (auto& [k, v] : c.tensors)
                              if (k == "optim.fc.weight.momentum_buffer") (v = v.clone()).view(-1)[0] = NAN;
                          }),
                  "optimizer state 'fc.weight.momentum_buffer' holds NaN or infinite values");
  // a refused --resume leaves the run folder as it was
  CHECK_FALSE(fs::exists(out / "e/earlier-run-1"));
  CHECK(test::read_csv(out / "e/summary.csv").size() == 2);
}

TEST_CASE("a timm args.yaml trains, with the command line overriding it", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("timmargs");
  auto r = test::run(kBin + " train -c " + IMGTRAIN_SOURCE_DIR + "/tests/data/timm_args_resnet50.yaml --data-dir " +
                     data + kSmallArgs + " --epochs 1 --output " + out.path.string() + " --experiment t");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(fs::exists(out / "t/last.safetensors"));
}

TEST_CASE("models lists the registry with parameter counts", "[integration]") {
  auto r = test::run(kBin + " models 'resnet*'");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("resnet18") && Catch::Contains("11689512") && Catch::Contains("25557032"));
  auto all = test::run(kBin + " models");
  INFO(all.output);
  for (const char* name : {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "resnet50d",
                           "resnet26d", "mobilenetv3_large_100", "mobilenetv3_small_100", "mobilenetv3_large_075",
                           "mobilenetv2_100", "efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3",
                           "efficientnet_b4", "tf_efficientnet_b0", "tf_efficientnet_b1", "tf_efficientnet_b2",
                           "tf_efficientnet_b3", "tf_efficientnet_b4", "vit_tiny_patch16_224", "vit_small_patch16_224",
                           "vit_base_patch16_224", "vit_base_patch32_224", "convnext_tiny", "convnext_small"})
    CHECK_THAT("\n" + all.output, Catch::Contains(std::string("\n") + name + " "));
  auto v = test::run(kBin + " --version");
  CHECK_THAT(v.output, Catch::Contains("imgtrain 0.1.0"));
}

TEST_CASE("MKL asks the executable for the CPU vendor, and AMD CPUs get its Intel code paths", "[integration]") {
  // The answer only reaches MKL when the executable exports mkl_serv_intel_cpu_true: a link change
  // that drops the export leaves MKL asking its own copy, and this test sees "not asked".
  std::string vendor;
  {
    std::ifstream cpuinfo("/proc/cpuinfo");
    for (std::string line; std::getline(cpuinfo, line);)
      if (const auto colon = line.find(": "); line.rfind("vendor_id", 0) == 0 && colon != std::string::npos) {
        vendor = line.substr(colon + 2);
        break;
      }
  }
  auto on = test::run(kBin + " --version");
  auto off = test::run("IMGTRAIN_MKL_INTEL_PATHS=0 " + kBin + " --version");
  INFO(on.output << off.output << "vendor " << vendor);
  REQUIRE(on.code == 0);
  REQUIRE(off.code == 0);
#if defined(__x86_64__)
  // the PyPI torch wheel for x86-64 carries MKL
  if (vendor == "AuthenticAMD") {
    CHECK_THAT(on.output, Catch::Contains("MKL: Intel's code paths on this AuthenticAMD CPU"));
    CHECK_THAT(off.output, Catch::Contains("MKL: generic code paths (AuthenticAMD CPU"));
  } else if (vendor == "GenuineIntel") {
    CHECK_THAT(on.output, Catch::Contains("MKL: Intel's code paths (GenuineIntel CPU)"));
    CHECK_THAT(off.output, Catch::Contains("MKL: Intel's code paths (GenuineIntel CPU)"));
  } else {
    CHECK_THAT(on.output, Catch::Contains("MKL: generic code paths"));
  }
#endif
}

TEST_CASE("each family trains, exports, and timm reproduces the outputs from the exported file", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  REQUIRE(fs::exists(kPython));
  for (std::string name : {"mobilenetv3_small_100", "mobilenetv2_100", "efficientnet_b0", "tf_efficientnet_b0",
                           "convnext_tiny"}) {
    INFO(name);
    test::TempDir out("family");
    auto r = test::run(kBin + " train --data-dir " + data + " --model " + name +
                       " --img-size 32 --in-chans 1 -b 50 --opt adamw --lr 1e-3 --warmup-epochs 0 -j 2 --device cpu"
                       " --epochs 1 --experiment f --output " + out.path.string());
    INFO(r.output);
    REQUIRE(r.code == 0);
    auto ex = test::run(kBin + " export --checkpoint " + (out / "f/last.safetensors") + " --out " +
                        (out / "model.safetensors"));
    INFO(ex.output);
    REQUIRE(ex.code == 0);
    ModelArgs a;
    a.num_classes = 10;
    a.in_chans = 1;
    auto model = model_zoo::create_model(name, a);
    io::load_state_dict(*model, io::load_safetensors(out / "model.safetensors"), "", "export");
    model->eval();
    torch::manual_seed(6);
    auto x = torch::randn({2, 1, 35, 35});  // odd size: TF 'same' padding is asymmetric here
    torch::NoGradGuard ng;
    auto y = model->forward(x);
    io::save_safetensors(out / "x.safetensors", {{"x", x}});
    auto py = test::run(kPython + " " + IMGTRAIN_SOURCE_DIR + "/tests/parity/timm_forward.py export " +
                        (out / "model.safetensors") + " " + name + " 10 1 " + (out / "x.safetensors") + " " +
                        (out / "y.safetensors"));
    INFO(py.output);
    REQUIRE(py.code == 0);
    CHECK((*io::load_safetensors(out / "y.safetensors").find("y") - y).abs().max().item<double>() < 1e-4);
  }
}

namespace {
// Every tensor of the two checkpoints' model/EMA/optimizer state is bitwise equal.
// Runs `cmd` while a watcher keeps a hard link `keep` to `file` as soon as it appears: recovery
// files are renamed into place whole and removed by the next one (or the epoch's checkpoint), so
// this is the file a kill at that point would have left.
test::RunResult run_keeping(const std::string& cmd, const std::string& file, const std::string& keep) {
  return test::run("(" + cmd + " & pid=$!; for t in $(seq 60000); do ln " + file + " " + keep +
                   " 2>/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 0.01; done; wait $pid)");
}

void expect_same_state(const fs::path& a, const fs::path& b) {
  auto sa = io::load_safetensors(a), sb = io::load_safetensors(b);
  size_t n = 0;
  for (auto& [k, v] : sa.tensors) {
    if (k.rfind("model.", 0) && k.rfind("ema.", 0) && k.rfind("optim.", 0)) continue;
    INFO(k);
    auto* w = sb.find(k);
    REQUIRE(w != nullptr);
    CHECK(torch::equal(v, *w));
    ++n;
  }
  CHECK(n > 100);
}
}  // namespace

TEST_CASE("resume is exact: 2 epochs straight equal 1 + resume + 1, and a mid-epoch recovery point", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("exact");
  const std::string args = " train --data-dir " + data + kSmallArgs + " -b 20 --model-ema --model-ema-decay 0.9 " +
                           "--drop-path 0.1 --mixup 0.2 --opt adamw --lr 1e-3 --sched-on-updates --warmup-epochs 1 " +
                           "--output " + out.path.string();
  // 10 updates per epoch, recovery after updates 2, 5 and 8 of each epoch; epoch 1's last one kept
  const std::string straight = out / "straight";
  auto a = run_keeping(kBin + args + " --epochs 2 --recovery-interval 3 --experiment straight",
                       straight + "/recovery-1-8.safetensors", out / "kept.safetensors");
  INFO(a.output);
  REQUIRE(a.code == 0);
  CHECK_FALSE(fs::exists(straight + "/recovery-1-8.safetensors"));  // superseded by last.safetensors
  auto b = test::run(kBin + args + " --epochs 1 --experiment split");
  INFO(b.output);
  REQUIRE(b.code == 0);
  auto c = test::run(kBin + args + " --epochs 2 --experiment split --resume " + (out / "split/last.safetensors"));
  INFO(c.output);
  REQUIRE(c.code == 0);
  expect_same_state(out / "straight/last.safetensors", out / "split/last.safetensors");
  REQUIRE(fs::exists(out / "kept.safetensors"));
  CHECK(engine::Checkpoint::read_meta(out / "kept.safetensors").recovery_update == 8);
  CHECK(engine::Checkpoint::read_meta(out / "kept.safetensors").epoch_updates == 10);
  // another batch size: update 8 of 5 per epoch is no place in this epoch, refused before anything moves
  {  // (after the set-up lines: the epoch's length is known once the data and batch size are)
    auto o = test::run(kBin + args + " -b 40 --epochs 2 --experiment other --resume " + (out / "kept.safetensors"));
    INFO(o.output);
    CHECK(o.code == 2);
    CHECK_THAT(o.output, Catch::Contains("imgtrain: error: --resume '" + (out / "kept.safetensors") +
                                         "': a mid-epoch recovery point of a run with 10 updates per epoch, but an "
                                         "epoch here has 5"));
    CHECK_THAT(o.output, !Catch::Contains("Train: "));
  }
  auto r = test::run(kBin + args + " --epochs 2 --experiment rec --resume " + (out / "kept.safetensors"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Train: 1 [   9/10"));
  CHECK_THAT(r.output, !Catch::Contains("Train: 1 [   0/10"));
  CHECK_THAT(r.output, Catch::Contains("/kept.safetensors' (epoch 1, after its update 8)"));
  expect_same_state(out / "straight/last.safetensors", out / "rec/last.safetensors");
  // epoch 1's summary row, train_loss included (the average over all 10 updates, not the last 1)
  const auto sa = test::read_csv(out / "straight/summary.csv"), sr = test::read_csv(out / "rec/summary.csv");
  REQUIRE(sa.size() == 3);
  REQUIRE(sr.size() == 2);
  CHECK(sr[1] == sa[2]);
}

TEST_CASE("log lines carry an ETA, a terminal also gets a live progress line, files and pipes never", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("eta");
  const std::string cmd = kBin + " train --data-dir " + data + kSmallArgs + " -b 20 --epochs 2 --log-interval 4 " +
                          "--output " + out.path.string();
  // a pipe: plain timm lines, each with the epoch's and the run's time left; TensorBoard events
  // (read back by TensorBoard's own reader, equal to summary.csv) and curves.png in the run folder
  auto p = test::run(cmd + " --experiment pipe --log-tensorboard --clip-grad 5");
  INFO(p.output);
  REQUIRE(p.code == 0);
  auto tb = test::run(kPython + " " + IMGTRAIN_SOURCE_DIR + "/tests/integration/tensorboard_check.py " +
                      (out / "pipe") + " " + (out / "pipe/summary.csv") +
                      " train/loss train/lr train/samples_per_sec train/data_time train/grad_norm");
  INFO(tb.output);
  CHECK(tb.code == 0);
  CHECK_THAT(tb.output, Catch::Contains("TENSORBOARD_OK"));
  CHECK(fs::file_size(out / "pipe/curves.png") > 1000);
  // --log-tensorboard DIR: the events go there; `imgtrain plot` overlays two runs
  auto d = test::run(cmd + " --epochs 1 --experiment dir --log-tensorboard " + (out / "tb"));
  INFO(d.output);
  REQUIRE(d.code == 0);
  bool events_in_dir = false;
  for (auto& e : fs::directory_iterator(out / "tb"))
    events_in_dir = events_in_dir || e.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  CHECK(events_in_dir);
  auto pl = test::run(kBin + " plot " + (out / "pipe") + " " + (out / "dir") + " -o " + (out / "both.png"));
  INFO(pl.output);
  CHECK(pl.code == 0);
  CHECK(fs::file_size(out / "both.png") > 1000);
  expect_user_error(test::run(kBin + " plot " + (out / "nothing-here")), "no run with a readable summary.csv");
  expect_user_error(test::run(kBin + " plot " + (out / "pipe") + " -o x.jpg"), "ending in .png");
  expect_user_error(test::run(kBin + " plot " + (out / "pipe") + " -o " + (out / "nowhere/x.png")), "no such folder");
  CHECK(std::regex_search(p.output, std::regex(R"(Train: 0 \[   4/10 .*  ETA epoch 0:\d\d:\d\d, run 0:\d\d:\d\d\n)")));
  CHECK(p.output.find('\033') == std::string::npos);
  // a terminal (script(1) gives the process a pty): the live line between log lines, cleared
  // before each of them; log.txt holds the plain lines only
  auto t = test::run("script -qec '" + cmd + " --experiment tty' /dev/null");
  INFO(t.output);
  REQUIRE(t.code == 0);
  CHECK_THAT(t.output, Catch::Contains("\r\033[KTrain: 0 [   1/10 ( 20%)]  Loss: ") &&
                           Catch::Contains("\r\033[KTrain: 0 [   4/10 ( 50%)]  Loss:"));
  const std::string log_txt = test::read_file(out / "tty/log.txt");
  CHECK_THAT(log_txt, Catch::Contains("Train: 0 [   4/10 ( 50%)]"));
  CHECK(log_txt.find('\033') == std::string::npos);
  CHECK(log_txt.find("[   1/10") == std::string::npos);
  // IMGTRAIN_PROGRESS=0 turns the live line off on a terminal
  auto q = test::run("IMGTRAIN_PROGRESS=0 script -qec '" + cmd + " --experiment quiet' /dev/null");
  INFO(q.output);
  REQUIRE(q.code == 0);
  CHECK(q.output.find("\033[K") == std::string::npos);
}

TEST_CASE("the CI benchmark job: a suite's records, and a staged slowdown fails the comparison naming the entry",
          "[integration]") {
  test::TempDir out("cibench");
  const std::string tool = kPython + " " + IMGTRAIN_SOURCE_DIR + "/bench/ci_bench.py";
  const std::string suite = std::string(IMGTRAIN_SOURCE_DIR) + "/tests/data/bench_suite_tiny.yaml";
  const std::string run = tool + " run --suite " + suite + " --repeats 1 --imgtrain " + kBin + " --out ";
  auto base = test::run(run + (out / "base.json"));
  INFO(base.output);
  REQUIRE(base.code == 0);
  const auto records = nlohmann::json::parse(test::read_file(out / "base.json"));
  REQUIRE(records.size() == 1);
  const auto& r = records[0];
  CHECK(r["name"] == "resnet18-tiny");
  CHECK(r["mode"] == "train");
  CHECK(r["samples_per_sec"].get<double>() > 0);
  CHECK(r["reference_samples_per_sec"].get<double>() > 0);
  for (auto k : {"ratio", "spread", "imgtrain_version", "git_commit", "torch_version", "device", "threads",
                 "batch_size", "img_size", "mkl"})
    CHECK(r.contains(k));
  CHECK_THAT(r.value("imgtrain_version", std::string()), Catch::StartsWith("imgtrain ") && !Catch::Contains("\n"));
  // resnet18's CPU training is channels-last with the fused BatchNorm by default: recorded as run,
  // and timm was given the same layout
  CHECK(r.value("channels_last", false));
  CHECK(r.value("fuse_bn", false));
  CHECK(r.value("reference_channels_last", false));
  {  // a baseline whose timm side ran another layout is not compared
    auto other = records;
    other[0]["reference_channels_last"] = false;
    test::write_file(out / "other.json", other.dump());
    auto cmp = test::run(tool + " compare " + (out / "other.json") + " " + (out / "base.json"));
    INFO(cmp.output);
    CHECK(cmp.code == 1);
    CHECK_THAT(cmp.output, Catch::Contains("not comparable") && Catch::Contains("reference_channels_last False -> True"));
  }
  // the same numbers pass; staged 3x slower (IMGTRAIN_BENCH_SLOWDOWN=2) they fail, naming the entry
  auto same = test::run(tool + " compare " + (out / "base.json") + " " + (out / "base.json"));
  INFO(same.output);
  CHECK(same.code == 0);
  auto slow = test::run("IMGTRAIN_BENCH_SLOWDOWN=2 " + run + (out / "slow.json"));
  INFO(slow.output);
  REQUIRE(slow.code == 0);
  auto cmp = test::run(tool + " compare " + (out / "base.json") + " " + (out / "slow.json"));
  INFO(cmp.output);
  CHECK(cmp.code == 1);
  CHECK_THAT(cmp.output, Catch::Contains("FAILED") && Catch::Contains("resnet18-tiny train"));
  // the GPU check's way of running a suite: every side a command of its own; with --keep-going a
  // failing side (here --cuda-graph on the CPU, and a model that does not exist) is a recorded
  // error and a "failed" cell of the table while the rest is measured; without it, exit 1 naming it
  test::write_file(out / "suite.yaml",
                   "device: cpu\nentries:\n"
                   "  - name: tiny\n    args: --model resnet18 --bench inference -b 2 --img-size 32 "
                   "--num-warm-iter 0 --num-bench-iter 2\n    reference: timm\n    cuda_graph: true\n"
                   "  - name: missing\n    args: --model no_such_net --bench inference -b 2 --img-size 32\n"
                   "  - name: skipped\n    args: --model resnet18 --bench inference -b 2 --img-size 32\n");
  const std::string run2 = tool + " run --suite " + (out / "suite.yaml") + " --repeats 1 --imgtrain " + kBin +
                           " --only tiny,missing --extra-args '--num-bench-iter 3'";
  auto kept = test::run(run2 + " --keep-going --out " + (out / "kept.json"));
  INFO(kept.output);
  REQUIRE(kept.code == 0);
  const auto k = nlohmann::json::parse(test::read_file(out / "kept.json"));
  REQUIRE(k.size() == 2);  // tiny and missing, inference only; "skipped" is not in --only
  CHECK(k[0]["name"] == "tiny");
  CHECK(k[0]["mode"] == "infer");
  CHECK(k[0]["samples_per_sec"].get<double>() > 0);
  CHECK(k[0]["ratio"].get<double>() > 0);
  CHECK_THAT(k[0]["errors"]["graph"].get<std::string>(), Catch::Contains("--cuda-graph needs a CUDA device"));
  CHECK(k[1]["name"] == "missing");
  CHECK_FALSE(k[1].contains("samples_per_sec"));
  CHECK(k[1]["errors"].contains("imgtrain"));
  auto table = test::run(tool + " table " + (out / "kept.json"));
  INFO(table.output);
  CHECK(table.code == 0);
  CHECK(std::regex_search(table.output, std::regex(R"(\| tiny \| infer \| [0-9.]+ \| failed \| [0-9.]+ \| - \|)")));
  CHECK(std::regex_search(table.output, std::regex(R"(\| missing \| infer \| failed \|)")));
  auto stop = test::run(run2 + " --out " + (out / "stop.json"));
  INFO(stop.output);
  CHECK(stop.code == 1);
  CHECK_THAT(stop.output, Catch::Contains("ci_bench: tiny graph: imgtrain exited 2"));
  expect_user_error(test::run("IMGTRAIN_BENCH_SLOWDOWN=abc " + kBin +
                              " benchmark --device cpu --model resnet18 --bench train -b 2 --img-size 32 "
                              "--num-warm-iter 0 --num-bench-iter 1"),
                    "IMGTRAIN_BENCH_SLOWDOWN 'abc'");
}

TEST_CASE("ci_bench.py: a bad suite, flag or results file is one line and exit 2, nothing measured is exit 1",
          "[integration]") {
  test::TempDir out("cibenchbad");
  const std::string tool = kPython + " " + IMGTRAIN_SOURCE_DIR + "/bench/ci_bench.py";
  const std::string run = tool + " run --imgtrain " + kBin + " --repeats 1 --suite ";
  auto one_line = [](const test::RunResult& r, int code, const std::string& needle) {
    INFO(r.output);
    CHECK(r.code == code);
    CHECK_THAT(r.output, Catch::Contains("ci_bench: ") && Catch::Contains(needle));
    CHECK_THAT(r.output, !Catch::Contains("Traceback"));
  };
  const std::string entry = "  - name: a\n    args: --model resnet18 --bench inference -b 2 --img-size 32 "
                            "--num-warm-iter 0 --num-bench-iter 1\n";
  struct Bad {
    const char* yaml;
    const char* says;
  };
  const Bad bad[] = {
      {"entries: [\n", "not valid YAML"},
      {"entries:\n  name: a\n", "`entries` must be a non-empty list"},
      {"entries:\n  - name: a\n    args: [--model, resnet18]\n", "`args` must be a string"},
      {"entries:\n  - args: --model resnet18\n", "`name` is missing"},
      {"entries:\n  - name: a\n    args: --model resnet18\n    cuda-graph: true\n", "unknown key `cuda-graph`"},
      {"entries:\n  - name: a\n    args: --model resnet18\n    compiled: \"false\"\n",
       "`compiled` must be true or false"},
      {"entries:\n  - name: a\n    args: --model resnet18 --bench data\n", "ci_bench measures models"},
      {"entries:\n  - name: a\n    args: --model resnet18 --num-warm-iter 0\n    compiled: true\n",
       "needs warm-up steps"},
      {"device: ''\nentries:\n  - name: a\n    args: --model resnet18\n", "`device` must be"},
  };
  int i = 0;
  for (const auto& b : bad) {
    std::string name = "s";  // appended, not "s" + ...: GCC 12 warns falsely on that (-Wstringop-overflow)
    name += std::to_string(i++);
    const std::string f = out / (name + ".yaml");
    test::write_file(f, b.yaml);
    one_line(test::run(run + f), 2, b.says);
  }
  test::write_file(out / "dup.yaml", "entries:\n" + entry + entry);
  one_line(test::run(run + (out / "dup.yaml")), 2, "entry a: the name is used twice");
  one_line(test::run(run + (out / "nope.yaml")), 2, "No such file");
  test::write_file(out / "ok.yaml", "entries:\n" + entry);
  one_line(test::run(run + (out / "ok.yaml") + " --repeats 0"), 2, "--repeats 0: at least 1");
  one_line(test::run(run + (out / "ok.yaml") + " --deadline 0"), 2, "--deadline 0");
  one_line(test::run(run + (out / "ok.yaml") + " --only zzz"), 2, "no entry or model zzz");
  one_line(test::run(tool + " run --imgtrain /nonexistent --suite " + (out / "ok.yaml")), 2, "no imgtrain binary");
  one_line(test::run(run + (out / "ok.yaml") + " --out " + (out / "ok.yaml")), 2, "that is the suite file");
  one_line(test::run(run + (out / "ok.yaml") + " --deadline nan"), 2, "--deadline nan");
  // boolean flags are recorded as the commands read them: the last occurrence wins
  auto flags = test::run(run + (out / "ok.yaml") + " --extra-args='--channels-last --channels-last=false' --out " +
                         (out / "flags.json"));
  INFO(flags.output);
  REQUIRE(flags.code == 0);
  CHECK(nlohmann::json::parse(test::read_file(out / "flags.json"))[0]["channels_last"] == false);
  // a run where every command fails is exit 1 even with --keep-going, and leaves no stale results:
  // the older file at --out is replaced by this run's failed records
  test::write_file(out / "fail.yaml", "entries:\n  - name: f\n    args: --model no_such_net --bench inference\n");
  test::write_file(out / "res.json", "[{\"name\": \"f\", \"mode\": \"infer\", \"samples_per_sec\": 99}]");
  auto failed = test::run(run + (out / "fail.yaml") + " --keep-going --out " + (out / "res.json"));
  one_line(failed, 1, "nothing was measured");
  const auto rec = nlohmann::json::parse(test::read_file(out / "res.json"));
  REQUIRE(rec.size() == 1);
  CHECK_FALSE(rec[0].contains("samples_per_sec"));
  CHECK(rec[0]["errors"].contains("imgtrain"));
  // compare: a failed entry is named as failed; an unmeasured baseline or a file that is not
  // results is a one-line error
  test::write_file(out / "base.json", "[{\"name\": \"f\", \"mode\": \"infer\", \"samples_per_sec\": 99}]");
  auto cmp = test::run(tool + " compare " + (out / "base.json") + " " + (out / "res.json"));
  INFO(cmp.output);
  CHECK(cmp.code == 1);
  CHECK_THAT(cmp.output, Catch::Contains("FAILED: failed: f infer") && !Catch::Contains("Traceback"));
  one_line(test::run(tool + " compare " + (out / "res.json") + " " + (out / "base.json")), 2,
           "the baseline has no measured record");
  test::write_file(out / "map.json", "{\"a\": 1}");
  one_line(test::run(tool + " compare " + (out / "map.json") + " " + (out / "base.json")), 2,
           "not a ci_bench results file");
  one_line(test::run(tool + " table " + (out / "nope.json")), 2, "No such file");
}

TEST_CASE("max-iter ends the run after that many updates, mid-epoch, with torch's milestones", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("maxiter");
  // 10 updates per epoch: epoch 1 stops after its third update; the lr halves from update 12 on
  auto r = test::run(kBin + " train --data-dir " + data + kSmallArgs +
                     " -b 20 --max-iter 13 --lr-steps 12 --lr-gamma 0.5 --log-interval 1 --output " +
                     out.path.string() + " --experiment m");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Scheduled epochs: 2 (13 updates of 10 per epoch). LR stepped per update."));
  CHECK(std::regex_search(r.output, std::regex(R"(Train: 1 \[   1/10 .*LR: 1\.000e-01)")));
  CHECK(std::regex_search(r.output, std::regex(R"(Train: 1 \[   2/10 .*LR: 5\.000e-02)")));
  CHECK_THAT(r.output, !Catch::Contains("Train: 1 [   3/10"));
  const auto meta = engine::Checkpoint::read_meta(out / "m/last.safetensors");
  CHECK(meta.epoch == 1);
  CHECK(meta.num_updates == 13);
  CHECK(test::read_csv(out / "m/summary.csv").size() == 3);  // header + 2 epochs
}

TEST_CASE("kill -9 mid-epoch, then resume from the recovery checkpoint and finish", "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("kill");
  const std::string args = " train --data-dir " + data + kSmallArgs + " -b 25 --epochs 3 --recovery-interval 2 " +
                           "--output " + out.path.string() + " --experiment k";
  // Start training, wait for the first recovery file, kill -9, resume from the newest file.
  const std::string dir = out / "k";
  auto killed = test::run("(" + kBin + args + " > " + out.path.string() + "/first.log 2>&1 & echo $! > " +
                          out.path.string() + "/pid); for i in $(seq 600); do ls " + dir +
                          "/recovery-*.safetensors >/dev/null 2>&1 && break; sleep 0.1; done; kill -9 $(cat " +
                          out.path.string() + "/pid); sleep 0.5; ls " + dir);
  INFO(killed.output);
  std::string newest;
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("recovery-", 0) == 0 && e.path().extension() == ".safetensors")
      newest = e.path().string();
  REQUIRE_FALSE(newest.empty());
  auto r = test::run(kBin + args + " --resume " + newest);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Resumed from checkpoint") && Catch::Contains("*** Best metric"));
  auto st = io::load_safetensors(out / "k/last.safetensors");
  CHECK(st.metadata.at("epoch") == "2");
}

TEST_CASE("kill -9 at 20 points, each followed by --resume auto: bitwise the uninterrupted run, files bounded",
          "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("killmatrix");
  const std::string args = " train --data-dir " + data + kSmallArgs +
                           " -b 25 --epochs 6 --model-ema --model-ema-decay 0.9 --drop-path 0.1 --recovery-interval 1 "
                           "--checkpoint-hist 2 --log-interval 1 --output " + out.path.string();
  auto ref = test::run(kBin + args + " --experiment ref");
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  const std::string dir = out / "k";
  auto finished = [&] {
    if (!fs::exists(dir + "/last.safetensors")) return false;
    const auto m = engine::Checkpoint::read_meta(dir + "/last.safetensors");
    return m.epoch == 5 && !m.recovery_update;
  };
  // Kill points spread over start-up (reading the checkpoint back), updates, recovery writes, the
  // evaluation and the epoch checkpoint: every third run is killed at a random time after its
  // start, the others a random time after their 1st-3rd update's log line (so each run advances a
  // few updates and the 20 kills cover the whole run). A fixed generator: a failure reproduces.
  std::mt19937 gen(18);
  std::uniform_real_distribution<double> startup(0.1, 1.2), after(0.0, 0.3);
  std::uniform_int_distribution<int> updates(1, 3);
  int kills = 0;
  std::string log;
  const std::string run_log = out / "run.log";
  for (int i = 0; i < 20 && !finished(); ++i) {
    const bool early = i % 3 == 0;
    const int n = updates(gen);
    const double d = early ? startup(gen) : after(gen);
    const std::string wait_for =
        early ? "" : fmt::format("for t in $(seq 1500); do [ $(grep -c 'Train:' {} 2>/dev/null || echo 0) -ge {} ] && break; "
                                 "sleep 0.02; done; ", run_log, n);
    auto k = test::run("(" + kBin + args + " --experiment k --resume auto > " + run_log + " 2>&1 & pid=$!; " +
                       wait_for + "sleep " + fmt::format("{:.2f}", d) +
                       "; kill -9 $pid 2>/dev/null && echo KILLED; wait $pid; exit 0)");
    const bool killed = k.output.find("KILLED") != std::string::npos;
    kills += killed;
    log += early ? fmt::format("run {}: {:.2f} s after start: {}\n", i, d, killed)
                 : fmt::format("run {}: {:.2f} s after update line {}: {}\n", i, d, n, killed);
    // at any point: at most --checkpoint-hist checkpoints, one recovery file, no stale temporaries
    // beyond the one a kill may have cut (the next start removes it)
    if (!fs::exists(dir)) continue;  // killed before the run folder was made
    int checkpoints = 0, recoveries = 0, temporaries = 0;
    std::string listing;
    for (auto& e : fs::directory_iterator(dir)) {
      const auto name = e.path().filename().string();
      listing += name + " ";
      checkpoints += name.rfind("checkpoint-", 0) == 0 && name.find(".tmp.") == std::string::npos;
      recoveries += name.rfind("recovery-", 0) == 0 && name.find(".tmp.") == std::string::npos;
      temporaries += name.find(".tmp.") != std::string::npos;
    }
    INFO("after kill " << i << ": " << listing << "\n" << test::read_file(out / "run.log"));
    CHECK(checkpoints <= 2);
    // a new recovery file is renamed into place before the previous one is removed (so one whole
    // file always exists): a kill between the two leaves two, until the next start removes one
    CHECK(recoveries <= 2);
    CHECK(temporaries <= 1);
  }
  INFO(log);
  CHECK(kills == 20);
  // the kills reached well past the first epochs' checkpoints (8 updates per epoch)
  const auto reached = engine::find_checkpoints(dir);
  REQUIRE_FALSE(reached.empty());
  const auto at = engine::Checkpoint::read_meta(reached.front());
  INFO("the killed runs reached " << reached.front() << ", update " << at.num_updates.value_or(0));
  CHECK(at.num_updates.value_or(0) >= 12);
  auto last = test::run(kBin + args + " --experiment k --resume auto");
  INFO(last.output);
  REQUIRE(last.code == 0);
  expect_same_state(out / "ref/last.safetensors", dir + "/last.safetensors");
  // one summary row per epoch, with the same evaluation as the uninterrupted run
  const auto a = test::read_csv(out / "ref/summary.csv"), b = test::read_csv(dir + "/summary.csv");
  REQUIRE(b.size() == a.size());
  for (size_t r = 0; r < a.size(); ++r) {
    CHECK(b[r].at(0) == a[r].at(0));
    // train_loss too: a recovery checkpoint carries the epoch's running loss average
    for (size_t c = 1; c < a[r].size(); ++c) CHECK(b[r].at(c) == a[r].at(c));
  }
  int checkpoints = 0, recoveries = 0, temporaries = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    const auto name = e.path().filename().string();
    checkpoints += name.rfind("checkpoint-", 0) == 0;
    recoveries += name.rfind("recovery-", 0) == 0;
    temporaries += name.find(".tmp") != std::string::npos;
  }
  CHECK(checkpoints == 2);
  CHECK(recoveries == 0);  // the final epoch's checkpoint supersedes them
  CHECK(temporaries == 0);
}

TEST_CASE("resume auto passes over a damaged newest checkpoint to the one before it", "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("fallback");
  const std::string args = " train --data-dir " + data + kSmallArgs + " -b 50 --checkpoint-hist 3 --output " +
                           out.path.string() + " --experiment f";
  auto first = test::run(kBin + args + " --epochs 2");
  INFO(first.output);
  REQUIRE(first.code == 0);
  // last, checkpoint-1 and model_best are one file (hard links): cutting it damages all three
  const std::string last = out / "f/last.safetensors";
  fs::resize_file(last, fs::file_size(last) / 2);
  auto r = test::run(kBin + args + " --epochs 3 --resume auto");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("--resume auto: skipping '" + last + "'"));
  CHECK_THAT(r.output, Catch::Contains("Resumed from checkpoint '" + (out / "f/checkpoint-0.safetensors") + "' (epoch 0)"));
  // the damaged newer file (and its links) went aside, kept for a look
  CHECK_THAT(r.output, Catch::Contains("moved to '" + (out / "f/earlier-run-1") + "'"));
  CHECK(fs::file_size(out / "f/earlier-run-1/last.safetensors") < fs::file_size(last));
  CHECK(engine::Checkpoint::read_meta(last).epoch == 2);
  CHECK(test::read_csv(out / "f/summary.csv").size() == 4);  // header + epochs 0, 1 (redone), 2
  // A new run (no --resume) into the folder moves this run's files aside, with one warning, so
  // that --resume auto afterwards continues the new run, not the newer checkpoints of the old one.
  auto fresh = test::run(kBin + args + " --epochs 1");
  INFO(fresh.output);
  CHECK(fresh.code == 0);
  CHECK_THAT(fresh.output, Catch::Contains("WARNING: '" + (out / "f") + "' held an earlier run ("));
  CHECK_THAT(fresh.output, Catch::Contains(" checkpoint file(s) and summary.csv); this run does not resume it, so that "
                                           "run's files are moved to '" + (out / "f/earlier-run-2") + "'"));
  CHECK(engine::Checkpoint::read_meta(out / "f/earlier-run-2/last.safetensors").epoch == 2);
  CHECK(test::read_csv(out / "f/summary.csv").size() == 2);  // the new run's header and epoch 0
  CHECK(test::read_csv(out / "f/earlier-run-2/summary.csv").size() == 4);
  auto again = test::run(kBin + args + " --epochs 2 --resume auto");
  INFO(again.output);
  CHECK(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("Resumed from checkpoint '" + (out / "f/") ));
  CHECK_THAT(again.output, Catch::Contains("(epoch 0)"));
  CHECK_THAT(again.output, !Catch::Contains("earlier run"));
  CHECK(test::read_csv(out / "f/summary.csv").size() == 3);
  // Going back to an earlier checkpoint of the folder's own run: the later epochs' checkpoints go
  // aside, so --resume auto continues the rewound run and summary.csv holds its rows only.
  auto rewind = test::run(kBin + args + " --epochs 2 --resume " + (out / "f/checkpoint-0.safetensors"));
  INFO(rewind.output);
  CHECK(rewind.code == 0);
  CHECK_THAT(rewind.output, Catch::Contains("later checkpoint file(s) of this folder, from the epochs now redone, "
                                            "moved to '" + (out / "f/earlier-run-3") + "'"));
  CHECK(engine::Checkpoint::read_meta(out / "f/earlier-run-3/checkpoint-1.safetensors").epoch == 1);
  CHECK(engine::Checkpoint::read_meta(out / "f/checkpoint-1.safetensors").epoch == 1);  // epoch 1 again
  CHECK(test::read_csv(out / "f/summary.csv").size() == 3);
  // another folder's checkpoint: this folder gets its own model_best (the best starts afresh)
  auto other = test::run(kBin + " train --data-dir " + data + kSmallArgs + " -b 50 --output " + out.path.string() +
                         " --experiment g --epochs 4 --resume " + (out / "f/earlier-run-2/last.safetensors"));
  INFO(other.output);
  CHECK(other.code == 0);
  CHECK(engine::Checkpoint::read_meta(out / "g/model_best.safetensors").epoch == 3);
}

TEST_CASE("a checkpoint write that runs out of space fails in one line and keeps the earlier checkpoint",
          "[integration][fault]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("full");
  const std::string args = " train --data-dir " + data + kSmallArgs + " -b 50 --output " + out.path.string() +
                           " --experiment f";
  auto first = test::run(kBin + args + " --epochs 1");
  INFO(first.output);
  REQUIRE(first.code == 0);
  const auto size = fs::file_size(out / "f/last.safetensors");  // model + momentum
  // The second run adds an EMA (a third copy of the weights) under a file size limit between the
  // two checkpoint sizes: writing its first checkpoint fails as a full disk would (EFBIG, not ENOSPC).
  const auto limit_kb = (size + size / 4) / 1024;
  auto second = test::run("(trap '' XFSZ; ulimit -f " + std::to_string(limit_kb) + "; " + kBin + args +
                          " --epochs 2 --model-ema --resume " + (out / "f/last.safetensors") + ")");
  INFO(second.output);
  CHECK(second.code == 2);
  CHECK(std::regex_search(second.output, std::regex(R"(imgtrain: error: failed writing '.*last\.safetensors\.tmp\.\d+' \(disk full\?\))")));
  const auto meta = engine::Checkpoint::read_meta(out / "f/last.safetensors");  // intact, the first run's
  CHECK(meta.epoch == 0);
  CHECK_NOTHROW(engine::Checkpoint::read(out / "f/last.safetensors"));
  for (auto& e : fs::directory_iterator(out / "f")) CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
}

TEST_CASE("a checkpoint's bad metadata is blamed on the checkpoint, not on a flag", "[integration][fault]") {
  auto data = test::fmnist_folder(20, 20);
  test::TempDir d("badmeta");
  ModelArgs a;
  a.num_classes = 10;
  a.in_chans = 1;
  auto model = model_zoo::create_module("resnet18", a);
  engine::CheckpointMeta k;
  k.arch = "resnet18";
  k.num_classes = 10;
  k.in_chans = 1;
  k.img_size = 28;
  k.global_pool = "bogus";
  engine::TrainStateRefs refs;
  refs.model = model.get();
  engine::write_checkpoint(d / "gp.safetensors", k, refs);
  const std::string validate = kBin + " validate --data-dir " + data + " --device cpu -b 10 --checkpoint ";
  auto r = test::run(validate + (d / "gp.safetensors"));
  expect_user_error(r, "'" + (d / "gp.safetensors") + "': metadata 'global_pool' 'bogus': resnet18 supports avg");
  CHECK_THAT(r.output, !Catch::Contains("--gp"));
  auto e = test::run(kBin + " export --checkpoint " + (d / "gp.safetensors") + " --out " + (d / "x.safetensors"));
  expect_user_error(e, "metadata 'global_pool' 'bogus'");
  // a plain state dict with a NaN is not exported (no architecture to check it against)
  auto sd = io::state_dict(*model);
  sd[3].second = sd[3].second.clone();
  sd[3].second.view(-1)[0] = NAN;
  io::save_safetensors(d / "nan.safetensors", sd);
  auto n = test::run(kBin + " export --checkpoint " + (d / "nan.safetensors") + " --out " + (d / "y.safetensors"));
  expect_user_error(n, "tensor '" + sd[3].first + "' holds NaN or infinite values");
  CHECK_FALSE(fs::exists(d / "y.safetensors"));
  // an 'arch' without the class count (timm's checkpoints hold 'arch' and 'args', or only 'arch'):
  // the classifier's rows give it, so a 10-class resnet18 is checked as one and exported
  ModelArgs a3;
  a3.num_classes = 10;
  auto rgb = model_zoo::create_module("resnet18", a3);
  io::save_safetensors(d / "arch_only.safetensors", io::state_dict(*rgb), {{"arch", "resnet18"}});
  auto ao = test::run(kBin + " export --checkpoint " + (d / "arch_only.safetensors") + " --out " + (d / "z.safetensors"));
  INFO(ao.output);
  CHECK(ao.code == 0);
  CHECK(io::load_safetensors(d / "z.safetensors").find("fc.weight")->size(0) == 10);
  // ... and a tensor that does not fit the architecture is still refused
  auto bad = io::state_dict(*rgb);
  bad[0].second = torch::zeros({3, 3});
  io::save_safetensors(d / "arch_bad.safetensors", bad, {{"arch", "resnet18"}});
  expect_user_error(test::run(kBin + " export --checkpoint " + (d / "arch_bad.safetensors") + " --out " +
                              (d / "w.safetensors")),
                    "wrong shape " + bad[0].first);
}

TEST_CASE("every recipe in configs/ parses and trains (shrunk to a few steps on small images)", "[integration]") {
  auto data = test::fmnist_folder(200, 100);
  test::TempDir out("recipes");
  for (std::string name : {"mobilenetv3_large_100", "resnet50_a1", "efficientnet_b0", "vit_small_patch16_224"}) {
    INFO(name);
    // the recipes are ImageNet runs; --pretrained is switched off (no weights in the test's cache)
    std::string yaml = test::read_file(std::string(IMGTRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml");
    // and so is mixed precision: half-precision kernels on this CPU are far slower than float32
    // (O1/O2 are covered by the mixed-precision tests)
    for (auto [from, to] : {std::pair{"pretrained: true", "pretrained: false"}, {"amp: true", "amp: false"},
                            {"amp_opt_level: O2", "amp_opt_level: O0"}}) {
      auto pos = yaml.find(from);
      if (pos != std::string::npos) yaml.replace(pos, std::string(from).size(), to);
    }
    const std::string cfg = out / (name + ".yaml");
    test::write_file(cfg, yaml);
    auto r = test::run(kBin + " train -c " + cfg + " --data-dir " + data + " --img-size 32 -b 8 -vb 50 " +
                       "--epochs 1 --warmup-epochs 0 --device cpu -j 2 --log-interval 100 --output " +
                       out.path.string() + " --experiment " + name);
    INFO(r.output);
    CHECK(r.code == 0);
    auto args = test::read_file(out / (name + "/args.yaml"));
    CHECK_THAT(args, Catch::Contains("model: \"" + name.substr(0, name.find("_a1")) + "\""));
  }
}

TEST_CASE("pack: training from tar shards matches the folder, and Python-made shards validate the same", "[integration]") {
  auto data = test::fmnist_folder();
  test::TempDir out("shards");
  auto p = test::run(kBin + " pack --data-dir " + data + " --out " + (out / "shards") + " --shard-size 300KB");
  INFO(p.output);
  REQUIRE(p.code == 0);
  CHECK_THAT(p.output, Catch::Contains("Packed 2500 samples"));
  CHECK(fs::exists(out / "shards/train/shard-000003.tar"));
  double top1[2];
  int k = 0;
  for (std::string dir : {data, out / "shards"}) {
    auto r = test::run(kBin + " train --data-dir " + dir + kSmallArgs + " --epochs 2 --output " + out.path.string() +
                       " --experiment run" + std::to_string(k));
    INFO(r.output);
    REQUIRE(r.code == 0);
    auto rows = test::read_csv(out / ("run" + std::to_string(k) + "/summary.csv"));
    top1[k++] = std::stod(rows.back()[3]);
  }
  // Shards are read in a different (shard-wise) order: the same accuracy within the noise of two
  // epochs on 2,000 images (the two orders differed by 6.4 points on one machine, by less on
  // another); a shard reader that lost or mislabelled samples would stay near 10%.
  CHECK(top1[1] > 60.0);
  CHECK(std::abs(top1[0] - top1[1]) < 10.0);
  // Validation on the shards and on the folder: the same images in the same order.
  std::string v[3];
  k = 0;
  // Shards written by Python's tarfile (pax format, one member with a long pax path).
  const std::string py =
      "import tarfile,io,os,sys\n"
      "src,dst=sys.argv[1],sys.argv[2]; os.makedirs(dst,exist_ok=True)\n"
      "classes=sorted(os.listdir(src))\n"
      "with tarfile.open(os.path.join(dst,'a.tar'),'w',format=tarfile.PAX_FORMAT) as t:\n"
      "  i=0\n"
      "  for c,name in enumerate(classes):\n"
      "    for f in sorted(os.listdir(os.path.join(src,name))):\n"
      "      key=('deep/'*30 if i==0 else '')+'%06d'%i; i+=1\n"
      "      t.add(os.path.join(src,name,f),arcname=key+'.png')\n"
      "      b=str(c).encode(); ti=tarfile.TarInfo(key+'.cls'); ti.size=len(b); t.addfile(ti,io.BytesIO(b))\n";
  test::write_file(out / "mk.py", py);
  auto mk = test::run(kPython + " " + (out / "mk.py") + " " + data + "/val " + (out / "pyshards/validation"));
  INFO(mk.output);
  REQUIRE(mk.code == 0);
  for (std::string dir : {data, out / "shards", out / "pyshards"}) {
    auto r = test::run(kBin + " validate --checkpoint " + (out / "run1/last.safetensors") + " --data-dir " + dir +
                       " --device cpu -b 100");
    INFO(r.output);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex("\"top1\": ([0-9.]+)")));
    v[k++] = m[1];
  }
  CHECK(v[0] == v[1]);
  CHECK(v[0] == v[2]);
}

TEST_CASE("evaluate-coco prints pycocotools' summary lines and refuses bad files in one line", "[coco]") {
  const std::string dir = std::string(IMGTRAIN_PARITY_DIR) + "/coco_eval";
  const std::string bin = IMGTRAIN_BIN;
  for (std::string type : {"bbox", "segm"}) {
    INFO(type);
    test::TempDir out("evalcoco");
    auto r = test::run(bin + " evaluate-coco --gt " + dir + "/gt.json --results " + dir + "/dt_" + type +
                       ".json --iou-type " + type + " --results-file " + (out / "res.json"));
    INFO(r.output);
    REQUIRE(r.code == 0);
    // pycocotools' own printed summary of the same files (make_coco_eval_refs.py)
    CHECK_THAT(r.output, Catch::Contains(test::read_file(dir + "/" + type + "_summary.txt")));
    CHECK_THAT(test::read_file(out / "res.json"), Catch::Contains("\"" + type + "\"") && Catch::Contains("\"AP50\""));
  }
  test::TempDir bad("evalcoco-bad");
  test::write_file(bad / "broken.json", "{\"images\": [");
  auto broken = test::run(bin + " evaluate-coco --gt " + (bad / "broken.json") + " --results " + dir + "/dt_bbox.json");
  INFO(broken.output);
  CHECK(broken.code == 2);
  CHECK_THAT(broken.output, Catch::StartsWith("imgtrain: error: ") && Catch::Contains("broken.json"));
  auto missing = test::run(bin + " evaluate-coco --gt " + dir + "/gt.json --results " + (bad / "none.json"));
  CHECK(missing.code == 2);
  CHECK_THAT(missing.output, Catch::Contains("none.json"));
  CHECK(test::run(bin + " evaluate-coco --gt a --results b --iou-type keypoints").code == 2);
  // an unwritable --results-file is refused before the evaluation runs
  auto unwritable = test::run(bin + " evaluate-coco --gt " + dir + "/gt.json --results " + dir +
                              "/dt_bbox.json --results-file " + (bad / "no/such/dir/res.json"));
  CHECK(unwritable.code == 2);
  CHECK_THAT(unwritable.output, Catch::Contains("cannot write it") && !Catch::Contains("Evaluate annotation type"));
  // a folder where a json file belongs is named as such
  auto folder = test::run(bin + " evaluate-coco --gt " + bad.path.string() + " --results " + dir + "/dt_bbox.json");
  CHECK(folder.code == 2);
  CHECK_THAT(folder.output, Catch::Contains("a folder, not a json file"));
}

TEST_CASE("coco-info counts a dataset, its training view and missing images", "[coco]") {
  const std::string gt = std::string(IMGTRAIN_PARITY_DIR) + "/coco_eval/gt.json";
  const std::string bin = IMGTRAIN_BIN;
  auto r = test::run(bin + " coco-info --ann " + gt);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("Loaded 48 images") && Catch::Contains("Training view: "));
  test::TempDir imgs("cocoinfo");
  test::write_file(imgs / "x.txt", "");
  auto m = test::run(bin + " coco-info --ann " + gt + " --images " + imgs.path.string());
  CHECK(m.code == 1);
  CHECK_THAT(m.output, Catch::Contains("48 of 48 images are missing from"));
  test::write_file(imgs / "broken.json", "[1, 2");
  auto b = test::run(bin + " coco-info --ann " + (imgs / "broken.json"));
  CHECK(b.code == 2);
  CHECK_THAT(b.output, Catch::StartsWith("imgtrain: error: ") && Catch::Contains("broken.json"));
  CHECK(test::run(bin + " coco-info").code == 2);
  auto file = test::run(bin + " coco-info --ann " + gt + " --images " + gt);
  CHECK(file.code == 2);
  CHECK_THAT(file.output, Catch::Contains("a file, not the image folder"));
}

TEST_CASE("a second run into a folder in use is refused in one line naming the holder", "[integration][fault]") {
  auto data = test::fmnist_folder();
  test::TempDir out("lock");
  const std::string cmd = kBin + " train --data-dir " + data + kSmallArgs + " --epochs 50 --output " +
                          out.path.string() + " --experiment same";
  const std::string log1 = out / "first.log";
  // the first run holds the folder; the second asks for it while the first trains
  auto r = test::run(cmd + " > " + log1 + " 2>&1 & P=$!; for i in $(seq 600); do grep -q 'Train: 0' " + log1 +
                     " && break; sleep 0.1; done; " + cmd + "; echo rc=$?; kill -TERM $P; wait $P; echo first=$?");
  INFO(r.output << test::read_file(log1));
  CHECK_THAT(r.output, Catch::Contains("is in use by another run (pid ") && Catch::Contains("rc=2"));
  CHECK_THAT(r.output, Catch::Contains("choose another --experiment"));
  // the refused run touched nothing: the first run's args.yaml is intact and it stopped cleanly
  CHECK_THAT(test::read_file(out / "same/args.yaml"), Catch::Contains("epochs: 50"));
  // after it ended, the folder is free again (--resume auto continues there)
  auto again = test::run(kBin + " train --data-dir " + data + kSmallArgs + " --epochs 1 --output " + out.path.string() +
                         " --experiment same");
  INFO(again.output);
  CHECK(again.code == 0);
}

namespace {
// Mask R-CNN on the small generated COCO set (parity_make_fashion_coco), sized to run in seconds
// (narrower than torchvision's, RoIs mapped to levels for small objects: validate must take the
// widths and the level mapper from the checkpoint).
const std::string kDetArgs =
    " --model maskrcnn_resnet18_fpn --dataset coco -b 2 --min-size 96 --max-size 160 --lr 0.01 --warmup-epochs 0"
    " --fpn-channels 64 --box-head-dim 256 --mask-head-dim 64 --mask-head-convs 2"
    " --sched multistep --decay-milestones 10 --weight-decay 1e-4 -j 2 --device cpu --log-interval 4"
    " --box-batch-size-per-image 64 --rpn-post-nms-top-n-train 300 --rpn-pre-nms-top-n-test 300"
    " --rpn-post-nms-top-n-test 300 --roi-canonical-size 112 --mask-rois-per-image 8 ";
}  // namespace

TEST_CASE("Mask R-CNN trains on COCO data, logs its losses, resumes exactly and validates as pycocotools scores",
          "[integration][detection]") {
  const std::string data = std::string(IMGTRAIN_PARITY_DIR) + "/fcoco";
  test::TempDir out("det");
  auto r = test::run(kBin + " train --data-dir " + data + kDetArgs + " --epochs 2 --output " + out.path.string() +
                     " --experiment straight");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("loss_classifier: ") && Catch::Contains("loss_mask: ") &&
                           Catch::Contains("loss_rpn_box_reg: ") && Catch::Contains("Final bbox_AP: "));
  // the CPU float32 default of a detector: channels-last, BatchNorm fused (the flags not given)
  CHECK_THAT(r.output, Catch::Contains("Training layout channels-last (NHWC), BatchNorm fused with the residual add "
                                       "and activation, frozen BatchNorm folded: maskrcnn_resnet18_fpn default"));
  const std::string run = out / "straight";
  auto rows = test::read_csv(run + "/summary.csv");
  REQUIRE(rows.size() == 3);
  const std::vector<std::string> parts = {"train_loss_classifier", "train_loss_box_reg", "train_loss_mask",
                                          "train_loss_objectness", "train_loss_rpn_box_reg"};
  REQUIRE(rows[0].size() == 2 + parts.size() + 12 + 1);
  CHECK(rows[0][1] == "train_loss");
  for (size_t i = 0; i < parts.size(); ++i) CHECK(rows[0][2 + i] == parts[i]);
  CHECK(rows[0][7] == "eval_bbox_AP");
  CHECK(rows[0][13] == "eval_segm_AP");
  for (size_t e = 1; e <= 2; ++e) {  // the parts add up to the loss (each an average over the same samples)
    double sum = 0;
    for (size_t i = 0; i < parts.size(); ++i) sum += std::stod(rows[e][2 + i]);
    CHECK(sum == Approx(std::stod(rows[e][1])).epsilon(1e-6));
  }
  CHECK(std::stod(rows[2][1]) < std::stod(rows[1][1]));  // it learns

  // 1 epoch, then --resume for the second: the same weights, bit for bit.
  auto r1 = test::run(kBin + " train --data-dir " + data + kDetArgs + " --epochs 1 --output " + out.path.string() +
                      " --experiment split");
  INFO(r1.output);
  REQUIRE(r1.code == 0);
  auto r2 = test::run(kBin + " train --data-dir " + data + kDetArgs + " --epochs 2 --output " + out.path.string() +
                      " --experiment split --resume " + (out / "split/last.safetensors"));
  INFO(r2.output);
  REQUIRE(r2.code == 0);
  auto a = io::load_safetensors(run + "/last.safetensors"), b = io::load_safetensors(out / "split/last.safetensors");
  int compared = 0;
  for (auto& [k, v] : a.tensors) {
    if (k.rfind("model.", 0) != 0) continue;
    const at::Tensor* w = b.find(k);
    REQUIRE(w);
    INFO(k);
    CHECK(torch::equal(v, *w));
    ++compared;
  }
  CHECK(compared > 100);

  // export checks the weights against the widths the checkpoint records (not the builder's defaults)
  auto ex = test::run(kBin + " export --checkpoint " + run + "/last.safetensors --out " + (out / "det.safetensors"));
  INFO(ex.output);
  REQUIRE(ex.code == 0);
  const auto exported = io::load_safetensors(out / "det.safetensors");
  CHECK(int(exported.tensors.size()) == compared);
  REQUIRE(exported.find("backbone.fpn.inner_blocks.0.0.weight"));
  CHECK(exported.find("backbone.fpn.inner_blocks.0.0.weight")->size(0) == 64);
  CHECK(torch::equal(*exported.find("roi_heads.mask_head.1.0.weight"), *a.find("model.roi_heads.mask_head.1.0.weight")));

  // validate reproduces the last epoch's numbers, and pycocotools scores the written detections the same
  // (the resize, --min-size 96 --max-size 160, taken from the checkpoint as the widths are)
  auto v = test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --dataset coco --data-dir " + data +
                     " --rpn-pre-nms-top-n-test 300 --rpn-post-nms-top-n-test 300"
                     " -b 2 --device cpu --results-file " + (out / "val.json") + " --results-format json");
  INFO(v.output);
  REQUIRE(v.code == 0);
  // the same model on the same images: as many detections as the run's last evaluation (a level
  // mapper or width not taken from the checkpoint changes them even where the AP is 0)
  auto last_detections = [](const std::string& log) {
    const std::regex re("Detections: ([0-9]+)");
    std::string last;
    for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it) last = (*it)[1];
    return last;
  };
  REQUIRE_FALSE(last_detections(r.output).empty());
  CHECK(last_detections(v.output) == last_detections(r.output));
  const auto res = nlohmann::json::parse(test::read_file(out / "val.json"));
  CHECK(res["bbox_AP"].get<double>() == Approx(std::stod(rows[2][7])).margin(1e-9));
  CHECK(res["segm_AP"].get<double>() == Approx(std::stod(rows[2][13])).margin(1e-9));
  const std::string dets = out / "val.json.detections.json";
  REQUIRE(fs::exists(dets));
  for (std::string type : {"bbox", "segm"}) {
    auto py = test::run(kPython + " -c \"import sys, contextlib, io; from pycocotools.coco import COCO; "
                        "from pycocotools.cocoeval import COCOeval; "
                        "f = io.StringIO(); ctx = contextlib.redirect_stdout(f); ctx.__enter__(); "
                        "gt = COCO(sys.argv[1]); dt = gt.loadRes(sys.argv[2]); e = COCOeval(gt, dt, sys.argv[3]); "
                        "e.evaluate(); e.accumulate(); e.summarize(); ctx.__exit__(None, None, None); "
                        "print(float(e.stats[0] * 100))\" " +
                        data + "/annotations/instances_val2017.json " + dets + " " + type);
    INFO(py.output);
    REQUIRE(py.code == 0);
    CHECK(std::stod(py.output) == Approx(res[type + "_AP"].get<double>()).margin(1e-9));
  }
  // without -b a detector validates one image per process (validate.py's 256 ran out of memory),
  // and --fuse-bn (folded BatchNorms, Winograd convolutions) scores it as well
  auto one = test::run(kBin + " validate --checkpoint " + run + "/last.safetensors --dataset coco --data-dir " + data +
                       " --min-size 96 --max-size 160 --rpn-pre-nms-top-n-test 300 --rpn-post-nms-top-n-test 300"
                       " --device cpu --fuse-bn --results-file " + (out / "val1.json") + " --results-format json");
  INFO(one.output);
  REQUIRE(one.code == 0);
  const std::regex step(R"(Test: \[ *([0-9]+)/([0-9]+)\].*Images: ([0-9]+))");
  std::smatch last_step;
  for (std::sregex_iterator it(one.output.begin(), one.output.end(), step), end; it != end; ++it) last_step = *it;
  REQUIRE(last_step.size() == 4);
  CHECK(std::stoi(last_step[1]) + 1 == std::stoi(last_step[2]));  // the last batch of the split
  CHECK(last_step[2] == last_step[3]);                            // as many batches as images
  const auto res1 = nlohmann::json::parse(test::read_file(out / "val1.json"));
  CHECK(res1["bbox_AP"].get<double>() >= 0.0);
  CHECK(res1["segm_AP"].get<double>() >= 0.0);
}

TEST_CASE("Mask R-CNN with apex O2 and a static loss scale of 64 trains and resumes bit for bit",
          "[integration][detection]") {
  // float16 convolutions are slow on a CPU (~10 s per update here, 15 s per evaluated image):
  // 4 updates, a recovery point after the second, a run resumed from it, and 2 validation images
  const std::string src = std::string(IMGTRAIN_PARITY_DIR) + "/fcoco";
  test::TempDir out("deto2");
  const std::string data = out / "data";
  fs::create_directories(data + "/annotations");
  fs::create_directory_symlink(src + "/train2017", data + "/train2017");
  fs::create_directory_symlink(src + "/val2017", data + "/val2017");
  fs::copy_file(src + "/annotations/instances_train2017.json", data + "/annotations/instances_train2017.json");
  auto val = nlohmann::json::parse(test::read_file(src + "/annotations/instances_val2017.json"));
  val["images"] = nlohmann::json::array({val["images"][0], val["images"][1]});
  nlohmann::json anns = nlohmann::json::array();
  for (auto& a : val["annotations"])
    if (a["image_id"] == val["images"][0]["id"] || a["image_id"] == val["images"][1]["id"]) anns.push_back(a);
  val["annotations"] = anns;
  test::write_file(data + "/annotations/instances_val2017.json", val.dump());
  const std::string args = " train --data-dir " + data + kDetArgs +
                           " --amp-opt-level O2 --loss-scale 64 --max-iter 4 --box-detections-per-img 20 --output " +
                           out.path.string();
  auto a = run_keeping(kBin + args + " --recovery-interval 2 --experiment straight",
                       out / "straight/recovery-0-1.safetensors", out / "kept.safetensors");
  INFO(a.output);
  REQUIRE(a.code == 0);
  CHECK_THAT(a.output, Catch::Contains("static 64 loss scaling") && Catch::Contains("loss_mask: "));
  REQUIRE(fs::exists(out / "kept.safetensors"));
  auto c = test::run(kBin + args + " --experiment rec --resume " + (out / "kept.safetensors"));
  INFO(c.output);
  REQUIRE(c.code == 0);
  CHECK_THAT(c.output, Catch::Contains("Train: 0 [   3/12") && !Catch::Contains("Train: 0 [   0/12"));
  // the half weights, the float32 masters, the optimizer state and the (static) scaler: all equal
  auto x = io::load_safetensors(out / "straight/last.safetensors"), y = io::load_safetensors(out / "rec/last.safetensors");
  int64_t half = 0, compared = 0;
  for (auto& [k, v] : x.tensors) {
    const at::Tensor* w = y.find(k);
    REQUIRE(w);
    INFO(k);
    CHECK(torch::equal(v, *w));
    half += k.rfind("model.", 0) == 0 && v.scalar_type() == at::kHalf;
    ++compared;
  }
  CHECK(half > 50);  // O2: the model's weights are float16 (BatchNorm's stay float32)
  CHECK(compared > 200);
}

TEST_CASE("a Detectron2 config trains Mask R-CNN by iterations, with its solver and RoIAlignV2", "[integration][detection]") {
  const std::string data = std::string(IMGTRAIN_PARITY_DIR) + "/fcoco";
  test::TempDir out("d2");
  test::write_file(out / "d2.yaml", R"(MODEL:
  META_ARCHITECTURE: "GeneralizedRCNN"
  MASK_ON: True
  RESNETS:
    DEPTH: 18
  RPN:
    POST_NMS_TOPK_TRAIN: 300
    PRE_NMS_TOPK_TEST: 300
    POST_NMS_TOPK_TEST: 300
  ROI_HEADS:
    BATCH_SIZE_PER_IMAGE: 64
SOLVER:
  IMS_PER_BATCH: 2
  BASE_LR: 0.01
  STEPS: (10,)
  MAX_ITER: 15
  WARMUP_ITERS: 5
  CHECKPOINT_PERIOD: 1000
INPUT:
  MIN_SIZE_TRAIN: (80, 96)
  MIN_SIZE_TEST: 96
  MAX_SIZE_TRAIN: 160
  MAX_SIZE_TEST: 160
DATALOADER:
  NUM_WORKERS: 2
TEST:
  DETECTIONS_PER_IMAGE: 50
)");
  auto r = test::run(kBin + " train -c " + (out / "d2.yaml") + " --data-dir " + data +
                     " --device cpu --log-interval 4 --output " + out.path.string() + " --experiment d2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  // 24 images in batches of 2 grouped landscape / other: 12 updates per epoch, the second stops at 15
  CHECK_THAT(r.output, Catch::Contains("Scheduled epochs: 2 (15 updates of 12 per epoch)"));
  CHECK_THAT(r.output, Catch::Contains("SOLVER.CHECKPOINT_PERIOD") && Catch::Contains("changes nothing"));
  CHECK_THAT(r.output, Catch::Contains("Final bbox_AP: "));
  const auto meta = engine::Checkpoint::read_meta(out / "d2/last.safetensors");
  CHECK(meta.num_updates == 15);
  // the pooling is in the checkpoint, for validate --checkpoint to rebuild the same model
  CHECK(meta.roi_align_v2 == 1);
  CHECK(meta.box_sampling_ratio == 0);
  CHECK(meta.mask_convention == "detectron2");  // and so is the masks' mapping onto their boxes
  const std::string args = test::read_file(out / "d2/args.yaml");
  CHECK_THAT(args, Catch::Contains("model: \"maskrcnn_resnet18_fpn\"") && Catch::Contains("roi_align_v2: true") &&
                       Catch::Contains("box_sampling_ratio: 0") && Catch::Contains("box_loss: \"l1\"") &&
                       Catch::Contains("two_bucket_grouping: true") && Catch::Contains("ims_per_batch: 2"));
}

namespace {

// The last JSON line a timm_validate.py run printed, and the average loss of imgtrain's last
// "Test:" line ("Loss: <val> (<avg>)").
nlohmann::json last_json_line(const std::string& out) {
  const auto p = out.rfind("\n{");
  return nlohmann::json::parse(out.substr(p == std::string::npos ? 0 : p + 1));
}
std::string avg_loss(const std::string& out) {
  static const std::regex re(R"(Loss: +[-0-9.]+ \(([-0-9.]+)\))");
  std::string last;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) last = (*it)[1];
  return last;
}

}  // namespace

TEST_CASE("validate reports what timm validate.py reports on JPEG and PNG photos of varied sizes", "[integration][timm]") {
  test::TempDir d("timmval");
  const std::string tv = kPython + " " + IMGTRAIN_SOURCE_DIR + "/tests/parity/timm_validate.py ";
  auto mk = test::run(tv + "make-folder " + d.path.string() + " 20");
  INFO(mk.output);
  REQUIRE(mk.code == 0);
  // timm's eval defaults of each: resnet50 and convnext_tiny at their test size 288 (crop 1.0),
  // efficientnet_b0 bicubic 0.875, vit_small_patch16_224 bicubic 0.9.
  for (const std::string m : {"resnet50", "efficientnet_b0", "vit_small_patch16_224", "convnext_tiny"}) {
    INFO(m);
    const std::string st = d / (m + ".safetensors"), pth = d / (m + ".pth");
    REQUIRE(test::run(tv + "make-weights " + m + " 10 " + st + " " + pth).code == 0);
    auto py = test::run(tv + m + " " + st + " " + d.path.string() + " val 10 8");
    INFO(py.output);
    REQUIRE(py.code == 0);
    const auto want = last_json_line(py.output);
    for (const std::string& w : {st, pth}) {
      INFO(w);
      auto r = test::run(kBin + " validate --device cpu -j 2 -b 8 --model " + m + " --num-classes 10 --data-dir " +
                         d.path.string() + " --split val --pretrained-path " + w + " --results-file " + (d / "r.json") + " --results-format json");
      INFO(r.output);
      REQUIRE(r.code == 0);
      const auto got = nlohmann::json::parse(test::read_file(d / "r.json"));
      for (const char* k : {"top1", "top1_err", "top5", "top5_err", "param_count", "img_size", "crop_pct"})
        CHECK(got[k].dump() == want[k].dump());
      CHECK(got["interpolation"] == want["interpolation"]);
      CHECK(avg_loss(r.output) == fmt::format("{:.4f}", want["loss"].get<double>()));
    }
  }

  {  // --img-size without --crop-pct: timm keeps the model's test crop (resnet50's 1.0), whatever the size
    const std::string st = d / "resnet50.safetensors";
    auto py = test::run(tv + "resnet50 " + st + " " + d.path.string() + " val 10 8 --img-size 160");
    INFO(py.output);
    REQUIRE(py.code == 0);
    const auto want = last_json_line(py.output);
    CHECK(want["crop_pct"].get<double>() == 1.0);
    auto r = test::run(kBin + " validate --device cpu -j 2 -b 8 --model resnet50 --num-classes 10 --img-size 160 --data-dir " +
                       d.path.string() + " --split val --pretrained-path " + st + " --results-file " + (d / "r.json") +
                       " --results-format json");
    INFO(r.output);
    REQUIRE(r.code == 0);
    const auto got = nlohmann::json::parse(test::read_file(d / "r.json"));
    for (const char* k : {"top1", "top5", "img_size", "crop_pct"}) CHECK(got[k].dump() == want[k].dump());
    CHECK(avg_loss(r.output) == fmt::format("{:.4f}", want["loss"].get<double>()));
  }

  // A model trained by imgtrain and exported: timm's validation of the export gives the same numbers.
  auto t = test::run(kBin + " train --device cpu -j 2 --model resnet18 --num-classes 10 --img-size 64 -b 10 --epochs 1 "
                     "--lr 0.05 --warmup-epochs 0 --data-dir " + d.path.string() + " --train-split val --val-split val"
                     " --output " + d.path.string() + " --experiment run");
  INFO(t.output);
  REQUIRE(t.code == 0);
  REQUIRE(test::run(kBin + " export --checkpoint " + (d / "run/last.safetensors") + " --out " + (d / "x.safetensors"))
              .code == 0);
  auto py = test::run(tv + "resnet18 " + (d / "x.safetensors") + " " + d.path.string() +
                      " val 10 8 --img-size 64 --crop-pct 0.95 --interpolation bicubic");
  INFO(py.output);
  REQUIRE(py.code == 0);
  const auto want = last_json_line(py.output);
  auto r = test::run(kBin + " validate --device cpu -j 2 -b 8 --model resnet18 --data-dir " + d.path.string() +
                     " --split val --checkpoint " + (d / "run/last.safetensors") + " --results-file " + (d / "r.json") + " --results-format json");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const auto got = nlohmann::json::parse(test::read_file(d / "r.json"));
  for (const char* k : {"top1", "top5", "img_size", "crop_pct"}) CHECK(got[k].dump() == want[k].dump());
  CHECK(avg_loss(r.output) == fmt::format("{:.4f}", want["loss"].get<double>()));
}
