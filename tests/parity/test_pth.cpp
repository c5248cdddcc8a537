// torch.save files written by the venv's torch (make_pth_refs.py), read by imgtrain's restricted
// unpickler, against the same tensors written as safetensors by the Python library.
#include "core/error.h"
#include "engine/checkpoint.h"
#include "io/safetensors.h"
#include "io/torch_pickle.h"
#include "io/weights.h"
#include "model_zoo/registry.h"
#include "tasks/classification/classification.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>

using namespace imgtrain;

namespace {
std::string ref(const std::string& name) { return std::string(IMGTRAIN_PARITY_DIR) + "/pth/" + name; }

// `got` holds exactly the tensors of `want` (under `prefix`), in the order of want's 'keys'
// metadata (the pickled dict's), with equal dtypes, shapes and values.
void check_same(const io::SafeTensors& got, const io::SafeTensors& want, const std::string& prefix = "") {
  std::vector<std::string> names, want_names;
  for (auto& [k, v] : got.tensors)
    if (k.rfind(prefix, 0) == 0) names.push_back(k.substr(prefix.size()));
  for (auto& k : nlohmann::json::parse(want.metadata.at("keys"))) want_names.push_back(k.get<std::string>());
  REQUIRE(names == want_names);
  for (auto& name : names) {
    INFO(prefix + name);
    const at::Tensor *a = got.find(prefix + name), *b = want.find(name);
    REQUIRE(b);
    CHECK(a->scalar_type() == b->scalar_type());
    REQUIRE(a->sizes() == b->sizes());
    CHECK(a->is_contiguous());
    CHECK(torch::equal(*a, *b));
  }
}
}  // namespace

TEST_CASE("a timm resnet18 state dict .pth reads as its safetensors", "[parity][pth]") {
  auto got = io::load_weights_file(ref("resnet18_sd.pth"));
  check_same(got, io::load_safetensors(ref("resnet18.safetensors")));
  CHECK(got.metadata.empty());
}

TEST_CASE("timm's CheckpointSaver file reads as model and ema prefixes with its metadata", "[parity][pth]") {
  const auto path = ref("last.pth.tar");
  auto got = io::load_weights_file(path);
  check_same(got, io::load_safetensors(ref("resnet18.safetensors")), "model.");
  const auto ema = io::load_safetensors(ref("resnet18_ema.safetensors"));
  check_same(got, ema, "ema.");
  CHECK(got.tensors.size() == 2 * nlohmann::json::parse(ema.metadata.at("keys")).size());  // optimizer state dropped
  for (auto* k : {"arch", "epoch", "metric"}) CHECK(got.metadata.at(k) == ema.metadata.at(k));
  CHECK(got.metadata.at("num_classes") == "1000");
  // --initial-checkpoint, validate --checkpoint and export read it through Checkpoint: EMA preferred.
  auto ck = engine::Checkpoint::read(path);
  CHECK(ck.meta().arch == "resnet18");
  CHECK(ck.meta().epoch == 3);
  CHECK(ck.meta().metric == 71.5);
  CHECK(ck.has_ema());
  auto m = model_zoo::create_model("resnet18", ModelArgs{});
  ck.load_weights(*m, /*prefer_ema=*/true);
  for (auto& [k, v] : io::state_dict(*m)) CHECK(torch::equal(v, *ema.find(k)));
  CHECK_THAT(test::error_text<UserError>([&] { ck.require_training("--resume", "resnet18"); }),
             Catch::Contains("--initial-checkpoint"));
}

TEST_CASE("DataParallel torchvision-references and legacy-format files read as their safetensors", "[parity][pth]") {
  const auto small = io::load_safetensors(ref("small.safetensors"));
  check_same(io::load_weights_file(ref("ddp.pth")), small);  // "module." stripped
  check_same(io::load_weights_file(ref("small_legacy.pth")), small);
  auto tv = io::load_weights_file(ref("tv_ckpt.pth"));
  check_same(tv, small, "model.");
  check_same(tv, io::load_safetensors(ref("small_ema.safetensors")), "ema.");  // n_averaged dropped
  CHECK(tv.metadata == std::map<std::string, std::string>{{"epoch", "7"}});
}

TEST_CASE("every dtype and views sharing one storage read exactly in zip and legacy files", "[parity][pth]") {
  const auto want = io::load_safetensors(ref("tensors.safetensors"));
  for (auto* name : {"tensors.pth", "tensors_p4.pth", "tensors_legacy.pth", "tensors_legacy_p5.pth"}) {
    INFO(name);
    check_same(io::load_weights_file(ref(name)), want);
  }
  auto got = io::load_weights_file(ref("tensors.pth"));
  CHECK(got.find("scalar")->dim() == 0);
  CHECK(got.find("empty")->numel() == 0);
  CHECK(got.find("bf16")->scalar_type() == at::kBFloat16);
}

TEST_CASE("a pickle that would run a shell command is refused and runs nothing", "[parity][pth]") {
  const std::string marker = ref("pwned");
  REQUIRE_FALSE(std::filesystem::exists(marker));
  for (auto* name : {"malicious.pth", "malicious_legacy.pth"}) {
    INFO(name);
    CHECK(io::is_torch_save_file(ref(name)));
    const auto msg = test::error_text<UserError>([&] { io::load_weights_file(ref(name)); });
    CHECK_THAT(msg, Catch::Contains("refuses to load the global 'posix.system'") && Catch::Contains(name));
    // the same through --pretrained-path
    tasks::ClassificationOptions o;
    o.model = "resnet18";
    o.pretrained_path = ref(name);
    auto m = model_zoo::create_model("resnet18", ModelArgs{});
    CHECK_THAT(test::error_text<UserError>([&] { tasks::ClassificationTask(o).load_pretrained(*m); }),
               Catch::Contains("'posix.system'"));
  }
  CHECK_FALSE(std::filesystem::exists(marker));
}

TEST_CASE("torchvision's resnet50 .pth loads through --pretrained-path and gives torchvision's outputs",
          "[parity][pth]") {
  torch::set_num_threads(1);
  tasks::ClassificationOptions o;
  o.model = "resnet50";
  o.pretrained_path = ref("resnet50_tv.pth");
  tasks::ClassificationTask task(o);
  auto m = model_zoo::create_model("resnet50", ModelArgs{});
  task.load_pretrained(*m);  // what train / validate --pretrained-path run
  const auto want = io::load_safetensors(ref("resnet50_io.safetensors"));
  m->eval();
  torch::NoGradGuard ng;
  const auto y = m->forward(*want.find("x"));
  CHECK((y - *want.find("y")).abs().max().item<double>() < 1e-4);
}
