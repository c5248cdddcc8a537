// Data-parallel training through the real binary: 2 processes on localhost with Gloo, launched by
// imgtrain itself and by the venv's torchrun. Label `dist`.
#include "integration/fixtures.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <opencv2/imgcodecs.hpp>
#include <torch/torch.h>

#include <regex>

namespace fs = std::filesystem;
using namespace imgtrain;

namespace {

const std::string kBin = IMGTRAIN_BIN;
const std::string kTorchrun = std::string(IMGTRAIN_SOURCE_DIR) + "/.venv/bin/torchrun";

bool identical(const std::string& a, const std::string& b, const std::string& prefix) {
  auto x = io::load_safetensors(a), y = io::load_safetensors(b);
  for (auto& [k, t] : x.tensors)
    if (k.rfind(prefix, 0) == 0 && (!y.find(k) || !at::equal(t, *y.find(k)))) return false;
  return true;
}

// Every floating tensor under model. and optim. of checkpoint `a` is within tol x (its max |value|,
// at least 1e-3) of the same tensor in `b`; returns how many were compared.
int64_t check_close(const std::string& a, const std::string& b, double tol) {
  auto x = io::load_safetensors(a), y = io::load_safetensors(b);
  int64_t n = 0;
  for (auto& [k, t] : x.tensors) {
    if ((k.rfind("model.", 0) != 0 && k.rfind("optim.", 0) != 0) || !t.is_floating_point()) continue;
    const at::Tensor* u = y.find(k);
    REQUIRE(u != nullptr);
    INFO(k);
    CHECK((t.to(at::kDouble) - u->to(at::kDouble)).abs().max().item<double>() <=
          tol * std::max(u->abs().max().item<double>(), 1e-3));
    ++n;
  }
  return n;
}

// PIDs of the children of a process (under `timeout`: the launcher, then its workers), oldest
// first, from /proc.
const std::string kChildren =
    "children() { for s in /proc/[0-9]*/status; do awk -v p=$1 '/^PPid:/ { if ($2 == p) print FILENAME }' $s "
    "2>/dev/null; done | cut -d/ -f3 | sort -n; }; ";

// Shell text: start `cmd` in the background (output in `log`, pid in $P), wait up to 120 s for
// the shell condition `ready`, then run `then`.
std::string start_wait_then(const std::string& cmd, const std::string& log, const std::string& ready,
                            const std::string& then) {
  return kChildren + cmd + " > " + log + " 2>&1 & P=$!; for i in $(seq 1200); do " + ready +
         " && break; sleep 0.1; done; " + then;
}

// The launcher log shows the third update of epoch 0 (rank 0 logs every update here).
std::string training_started(const std::string& log) { return "grep -q 'Train: 0 \\[   2/' " + log; }

}  // namespace

TEST_CASE("2 processes x batch b equal 1 process x batch 2b after one step (no BN, and BN with --sync-bn)", "[dist]") {
  // 16 training images: one batch of 8 per rank, or one of 16 in a single process.
  auto data = test::fmnist_folder(16, 16);
  for (std::string model : {"vit_tiny_patch16_224", "resnet18"}) {
    DYNAMIC_SECTION(model) {
      test::TempDir out("dist-union");
      const std::string common = " train --data-dir " + data + " --model " + model +
                                 " --img-size 32 --in-chans 1 --num-classes 10 --no-aug --lr 0.05 --warmup-epochs 0 --epochs 1"
                                 " --opt sgd --momentum 0.9 --weight-decay 1e-4 --device cpu -j 1 --output " +
                                 out.path.string();
      const std::string bn = model == "resnet18" ? " --sync-bn" : "";
      auto two = test::run(kBin + common + " -b 8 --nproc-per-node 2 --experiment two" + bn);
      INFO(two.output);
      REQUIRE(two.code == 0);
      CHECK_THAT(two.output, Catch::Contains("Process 0, total 2"));
      if (!bn.empty()) CHECK_THAT(two.output, Catch::Contains("Synchronized BatchNorm"));
      auto one = test::run(kBin + common + " -b 16 --experiment one");
      INFO(one.output);
      REQUIRE(one.code == 0);
      const std::string a = out / "two/last.safetensors", b = out / "one/last.safetensors";
      // The momentum buffers after one SGD step are the averaged gradients (+ weight decay).
      // Without BatchNorm: 1e-5. Through 20 BatchNorms on 16 samples float32 rounding alone moves
      // the result by ~1e-4 of a tensor's scale (the 1-process run with 1 vs 2 threads differs by
      // 1.1e-4); SyncBN's exactness is shown in float64 by the unit test.
      const double tol = bn.empty() ? 1e-5 : 2e-4;
      CHECK(check_close(a, b, tol) > 20);
    }
  }
}

TEST_CASE("detection: 2 processes x 1 image equal 1 process x 2 images (grouped sampling, FrozenBN)", "[dist]") {
  // Eight copies of one annotated canvas: every image's losses are the same, so the per-process
  // normalisations agree and data parallelism must reproduce the single-process step. The samplers
  // take every candidate (no random subset) and the body starts from weights (FrozenBatchNorm2d).
  test::TempDir d("dist-det");
  const std::string src = std::string(IMGTRAIN_PARITY_DIR) + "/fcoco";
  auto gt = nlohmann::json::parse(test::read_file(src + "/annotations/instances_train2017.json"));
  const auto first = gt["images"][0];
  nlohmann::json out = {{"images", nlohmann::json::array()}, {"annotations", nlohmann::json::array()},
                        {"categories", gt["categories"]}};
  int64_t ann_id = 1;
  for (int64_t i = 1; i <= 8; ++i) {
    auto img = first;
    img["id"] = i;
    img["file_name"] = fmt::format("{:04d}.png", i);
    out["images"].push_back(img);
    for (auto& a : gt["annotations"])
      if (a["image_id"] == first["id"]) {
        auto c = a;
        c["id"] = ann_id++;
        c["image_id"] = i;
        out["annotations"].push_back(c);
      }
  }
  for (std::string split : {"train2017", "val2017"}) {
    fs::create_directories(d.path / split);
    for (int64_t i = 1; i <= 8; ++i)
      fs::copy_file(src + "/train2017/" + first["file_name"].get<std::string>(), d.path / split / fmt::format("{:04d}.png", i));
  }
  fs::create_directories(d.path / "annotations");
  test::write_file(d / "annotations/instances_train2017.json", out.dump());
  test::write_file(d / "annotations/instances_val2017.json", out.dump());
  auto w = test::run(std::string(IMGTRAIN_SOURCE_DIR) + "/.venv/bin/python -c \"import sys, torch, timm; "
                     "from safetensors.torch import save_file; torch.manual_seed(0); "
                     "save_file(timm.create_model('resnet18').state_dict(), sys.argv[1])\" " + (d / "r18.safetensors"));
  INFO(w.output);
  REQUIRE(w.code == 0);
  const std::string common =
      " train --model maskrcnn_resnet18_fpn --dataset coco --data-dir " + d.path.string() +
      " --pretrained-path " + (d / "r18.safetensors") +
      " --min-size 96 --max-size 160 --hflip 0 --rpn-batch-size-per-image 1000000 --box-batch-size-per-image 1000000"
      " --rpn-post-nms-top-n-train 200 --rpn-pre-nms-top-n-test 200 --rpn-post-nms-top-n-test 200 --lr 0.01"
      " --warmup-epochs 0 --opt momentum --weight-decay 1e-4 --max-iter 1 --device cpu -j 1 --output " + d.path.string();
  // one thread per worker whatever the caller's environment says (the launcher, as torchrun, keeps
  // an OMP_NUM_THREADS that is set)
  auto two = test::run("OMP_NUM_THREADS=1 " + kBin + common + " -b 1 --nproc-per-node 2 --experiment two");
  INFO(two.output);
  REQUIRE(two.code == 0);
  CHECK_THAT(two.output, Catch::Contains("Process 0, total 2"));
  // the launcher runs each worker with OMP_NUM_THREADS=1 (as torchrun); so does the single process,
  // since the 1x1 downsample convolutions' weight gradients change by up to 5e-3 of their scale
  // between 1 and 2 threads (float32 reductions with cancellation)
  auto one = test::run("OMP_NUM_THREADS=1 " + kBin + common + " -b 2 --experiment one");
  INFO(one.output);
  REQUIRE(one.code == 0);
  // The data-parallel step is one process accumulating the two images' gradients, bit for bit.
  auto acc = test::run("OMP_NUM_THREADS=1 " + kBin + common + " -b 1 --grad-accum-steps 2 --experiment acc");
  INFO(acc.output);
  REQUIRE(acc.code == 0);
  CHECK(identical(d / "two/last.safetensors", d / "acc/last.safetensors", "model."));
  CHECK(identical(d / "two/last.safetensors", d / "acc/last.safetensors", "optim."));
  // After one update the momentum buffers are the averaged gradients (+ weight decay). A batch of
  // two images against two batches of one changes the float32 reduction order of the weight
  // gradients over the RoIs and positions (the mask head's: 1.8e-4 of the tensor's scale on the
  // generated set's first canvas, against 1.4e-6 between 1 and 2 threads); an error in the
  // normalisation or the averaging is a factor, not a last bit.
  CHECK(check_close(d / "two/last.safetensors", d / "one/last.safetensors", 1e-3) > 50);
}

TEST_CASE("2 processes x b with accumulation equal 1 process x 2b over several updates (no BN)", "[dist]") {
  // 32 images, 2 x 4 per micro-step, accumulation 2: 2 updates, each over the same 16 images in
  // both runs; gradients stay in place between updates (zeroed, not dropped) under DDP.
  auto data = test::fmnist_folder(32, 16);
  test::TempDir out("dist-accum-union");
  const std::string common = " train --data-dir " + data +
                             " --model vit_tiny_patch16_224 --img-size 32 --in-chans 1 --num-classes 10 --no-aug"
                             " --lr 0.05 --warmup-epochs 0 --epochs 2 --opt sgd --momentum 0.9 --weight-decay 1e-4"
                             " --grad-accum-steps 2 --device cpu -j 1 --output " + out.path.string();
  auto two = test::run(kBin + common + " -b 4 --nproc-per-node 2 --experiment two");
  INFO(two.output);
  REQUIRE(two.code == 0);
  auto one = test::run(kBin + common + " -b 8 --experiment one");
  INFO(one.output);
  REQUIRE(one.code == 0);
  CHECK(check_close(out / "two/last.safetensors", out / "one/last.safetensors", 1e-5) > 100);
}

TEST_CASE("self-launch and torchrun --no-python give identical weights", "[dist]") {
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("dist-launch");
  const std::string args = " train --data-dir " + data +
                           " --model resnet18 --img-size 28 --in-chans 1 -b 8 --lr 0.05 --warmup-epochs 0 --epochs 2"
                           " --device cpu -j 1 --log-interval 1 --output " + out.path.string();
  auto self = test::run(kBin + args + " --nproc-per-node 2 --experiment self");
  INFO(self.output);
  REQUIRE(self.code == 0);
  auto tr = test::run(kTorchrun + " --standalone --nproc-per-node 2 --no-python " + kBin + args + " --experiment tr");
  INFO(tr.output);
  REQUIRE(tr.code == 0);
  CHECK_THAT(tr.output, Catch::Contains("Process 0, total 2"));
  CHECK(identical(out / "self/last.safetensors", out / "tr/last.safetensors", "model."));
  CHECK(identical(out / "self/last.safetensors", out / "tr/last.safetensors", "optim."));
  // Only rank 0 writes: one summary row per epoch.
  CHECK(test::read_csv(out / "self/summary.csv").size() == 3);
}

TEST_CASE("gradient accumulation: micro-steps without an update do not all-reduce", "[dist]") {
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("dist-accum");
  // 64 images / 2 ranks / batch 4 = 8 micro-batches per rank and epoch.
  const std::string args = " train --data-dir " + data +
                           " --model vit_tiny_patch16_224 --img-size 32 --in-chans 1 -b 4 --lr 0.01 --epochs 1"
                           " --bucket-cap-mb 1 --device cpu -j 1 --nproc-per-node 2 --output " + out.path.string();
  std::regex line("Distributed: ([0-9]+) gradient all-reduce\\(s\\) for ([0-9]+) update\\(s\\) of ([0-9]+) "
                  "micro-batch\\(es\\); ([0-9]+) bucket\\(s\\)");
  for (int accum : {1, 2, 4}) {
    DYNAMIC_SECTION("accum " << accum) {
      auto r = test::run(kBin + args + " --grad-accum-steps " + std::to_string(accum) + " --experiment a" +
                         std::to_string(accum));
      INFO(r.output);
      REQUIRE(r.code == 0);
      std::smatch m;
      REQUIRE(std::regex_search(r.output, m, line));
      const int64_t reduces = std::stoll(m[1]), updates = std::stoll(m[2]), micro = std::stoll(m[3]),
                    buckets = std::stoll(m[4]);
      CHECK(micro == 8);
      CHECK(updates == 8 / accum);
      CHECK(buckets > 2);  // 5.5 M parameters in 1 MiB buckets
      // The first update's backward uses one bucket (DDP rebuilds them after it); every later
      // update all-reduces each bucket once, and no micro-step in between does.
      CHECK(reduces == 1 + (updates - 1) * buckets);
    }
  }
}

TEST_CASE("a killed worker stops the job: the other exits non-zero and the launcher names the rank", "[dist]") {
  auto data = test::fmnist_folder();
  test::TempDir out("dist-kill");
  const std::string args = " train --data-dir " + data +
                           " --model resnet18 --img-size 28 --in-chans 1 -b 25 --lr 0.05 --epochs 3 --device cpu -j 1"
                           " --log-interval 1 --nproc-per-node 2 --dist-timeout 60 --experiment k --output " +
                           out.path.string();
  const std::string log = out / "launcher.log";
  auto r = test::run(start_wait_then("timeout 300 " + kBin + args, log, training_started(log),
                                     "kill -9 $(children $(children $P) | tail -1); wait $P; echo launcher-exit=$?"));
  const std::string text = test::read_file(log);
  INFO(r.output << text);
  CHECK_THAT(r.output, Catch::Contains("launcher-exit=1"));
  CHECK_THAT(text, Catch::Contains("worker rank 1 (local rank 1") && Catch::Contains("killed by signal 9"));
  CHECK_THAT(text, Catch::Contains("rank 0: rank 1 stopped"));
  CHECK_THAT(text, !Catch::Contains("*** Best metric"));
}

TEST_CASE("a user error only the workers can see: one line from the launcher, exit code 2", "[dist][fault]") {
  test::TempDir d("dist-usererr");
  // a validation split without images: found when the workers build their datasets
  for (const char* c : {"a", "b"}) {
    fs::create_directories(d / (std::string("val/") + c));
    fs::create_directories(d / (std::string("train/") + c));
    for (int i = 0; i < 2; ++i)
      cv::imwrite(d / fmt::format("train/{}/{}.png", c, i), cv::Mat(8, 8, CV_8UC3, cv::Scalar(i * 50, 0, 0)));
  }
  auto r = test::run(kBin + " train --data-dir " + d.path.string() +
                     " --model resnet18 --img-size 16 -b 1 --epochs 1 --device cpu -j 1 --nproc-per-node 2 --output " +
                     (d / "out"));
  INFO(r.output);
  CHECK(r.code == 2);
  const std::regex err("imgtrain: error: no images .* in class subfolders of '.*val'");
  size_t errors = 0;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), err); it != std::sregex_iterator(); ++it) ++errors;
  CHECK(errors == 1);
  CHECK_THAT(r.output, !Catch::Contains("launcher: worker rank"));
  // the sibling the launcher stops says nothing of its own (no "stopped by a signal" line)
  CHECK_THAT(r.output, !Catch::Contains("stopped by a signal"));
}

TEST_CASE("workers that all stop on unreadable images in training: one line from the launcher", "[dist][fault]") {
  test::TempDir d("dist-allbad");
  // every training image unreadable: each worker stops after its own run of failures, naming its
  // own last file, at about the same time
  for (const char* c : {"a", "b"})
    for (const char* split : {"train", "val"})
      for (int i = 0; i < 60; ++i) test::write_file(d / fmt::format("{}/{}/{}.png", split, c, i), "not a png");
  auto r = test::run(kBin + " train --data-dir " + d.path.string() +
                     " --model resnet18 --img-size 16 -b 2 --epochs 1 --device cpu -j 1 --nproc-per-node 2 --output " +
                     (d / "out"));
  INFO(r.output);
  CHECK(r.code == 2);
  size_t errors = 0;
  for (size_t p = r.output.find("imgtrain: error:"); p != std::string::npos; p = r.output.find("imgtrain: error:", p + 1))
    ++errors;
  CHECK(errors == 1);
  CHECK_THAT(r.output, !Catch::Contains("launcher: worker rank"));
}

TEST_CASE("torchrun --max-restarts 1 with a worker killed once: --resume auto continues and finishes", "[dist]") {
  auto data = test::fmnist_folder();
  test::TempDir out("dist-restart");
  const std::string args = " train --data-dir " + data +
                           " --model resnet18 --img-size 28 --in-chans 1 -b 25 --lr 0.05 --epochs 2 --device cpu -j 1"
                           " --log-interval 5 --recovery-interval 10 --resume auto --experiment job --output " +
                           out.path.string();
  const std::string log = out / "torchrun.log";
  auto r = test::run(start_wait_then(
      "timeout 600 " + kTorchrun + " --standalone --nproc-per-node 2 --max-restarts 1 --no-python " + kBin + args, log,
      "ls " + out.path.string() + "/job/recovery-*.safetensors >/dev/null 2>&1",
      "kill -9 $(children $(children $P) | tail -1); wait $P; echo torchrun-exit=$?"));
  const std::string text = test::read_file(log);
  INFO(r.output << text);
  CHECK_THAT(r.output, Catch::Contains("torchrun-exit=0"));
  CHECK_THAT(text, Catch::Contains("Resumed from checkpoint") && Catch::Contains("*** Best metric"));
  CHECK(test::read_csv(out / "job/summary.csv").size() == 3);
}

TEST_CASE("SIGTERM to one worker: the launcher says a stop was asked for and exits 143", "[dist]") {
  // A scheduler or a user may signal a worker, not the launcher: the workers stop together (rank 0
  // writes the recovery point) and the launcher passes the stop on, as it does for its own signal,
  // instead of calling a worker's clean exit a failure.
  auto data = test::fmnist_folder();
  test::TempDir out("dist-term-worker");
  const std::string args = " train --data-dir " + data +
                           " --model resnet18 --img-size 28 --in-chans 1 -b 25 --lr 0.05 --epochs 3 --device cpu -j 1"
                           " --log-interval 1 --nproc-per-node 2 --experiment t --output " + out.path.string();
  const std::string log = out / "launcher.log";
  auto r = test::run(start_wait_then(kBin + args, log, training_started(log),
                                     "W=$(children $P); kill -TERM $(echo $W | tr ' ' '\\n' | tail -1); wait $P; "
                                     "echo launcher-exit=$?; sleep 0.5; "
                                     "for w in $W; do [ -e /proc/$w ] && echo still-running=$w; done; true"));
  const std::string text = test::read_file(log);
  INFO(r.output << text);
  CHECK_THAT(r.output, Catch::Contains("launcher-exit=143") && !Catch::Contains("still-running"));
  CHECK_THAT(text, Catch::Contains("Stopped by signal 15 after update") &&
                       Catch::Contains("stopped on a stop request (signal 15)") &&
                       !Catch::Contains("exited with code"));
}

TEST_CASE("SIGTERM to the launcher: rank 0 writes a recovery checkpoint, every worker ends", "[dist]") {
  auto data = test::fmnist_folder();
  test::TempDir out("dist-term");
  const std::string args = " train --data-dir " + data +
                           " --model resnet18 --img-size 28 --in-chans 1 -b 25 --lr 0.05 --epochs 3 --device cpu -j 1"
                           " --log-interval 1 --nproc-per-node 2 --experiment t --output " + out.path.string();
  const std::string log = out / "launcher.log";
  auto r = test::run(start_wait_then(kBin + args, log, training_started(log),
                                     "W=$(children $P); kill -TERM $P; wait $P; echo launcher-exit=$?; sleep 0.5; "
                                     "for w in $W; do [ -e /proc/$w ] && echo still-running=$w; done; true"));
  const std::string text = test::read_file(log);
  INFO(r.output << text);
  CHECK_THAT(r.output, Catch::Contains("launcher-exit=143") && !Catch::Contains("still-running"));
  CHECK_THAT(text, Catch::Contains("Stopped by signal 15 after update"));
  bool recovery = false;
  for (auto& e : fs::directory_iterator(out / "t"))
    recovery |= e.path().filename().string().rfind("recovery-0-", 0) == 0;
  CHECK(recovery);
  // ... and the job resumes from it.
  auto again = test::run(kBin + args + " --epochs 1 --resume auto");
  INFO(again.output);
  CHECK(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("Resumed from checkpoint") && Catch::Contains("recovery-0-"));
}
