#include <random>
#include "cli/adapters.h"
#include "cli/config.h"
#include "core/error.h"
#include "core/registry.h"
#include "dist/env.h"
#include "optim/optim.h"
#include "tasks/tasks.h"
#include "test_util.h"

#include <catch2/catch.hpp>

#include <map>

using imgtrain::UserError;
using imgtrain::cli::Command;
using imgtrain::cli::parse;

namespace {
imgtrain::cli::Config train(std::vector<std::string> args) { return *parse(Command::Train, args); }

std::string error_of(std::vector<std::string> args, Command cmd = Command::Train) {
  try {
    parse(cmd, args);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("defaults follow timm train.py", "[cli]") {
  auto c = train({});
  CHECK(c.model == "resnet50");
  CHECK(c.batch_size == 128);
  CHECK(c.epochs == 300);
  CHECK(c.opt == "sgd");
  CHECK(c.weight_decay == Approx(2e-5));
  CHECK(c.warmup_epochs == 5);
  CHECK(c.smoothing == Approx(0.1));
  CHECK(c.scale == std::vector<double>{0.08, 1.0});
  CHECK_FALSE(c.lr.has_value());
  CHECK(c.val_split == "validation");
}

TEST_CASE("flags parse with timm's names, aliases and multi-value forms", "[cli]") {
  auto c = train({"--model", "resnet18", "-b", "32", "-vb", "64", "--lr", "0.5", "--scale", "0.5", "1.0", "-j", "3",
                  "--pin-mem", "--dr", "0.5", "--device=cpu"});
  CHECK(c.model == "resnet18");
  CHECK(c.batch_size == 32);
  CHECK(c.validation_batch_size == 64);
  CHECK(*c.lr == Approx(0.5));
  CHECK(c.scale == std::vector<double>{0.5, 1.0});
  CHECK(c.workers == 3);
  CHECK(c.pin_mem);
  CHECK(c.decay_rate == Approx(0.5));
  CHECK(c.device == "cpu");
}

TEST_CASE("list flags, aliases and the engine's flags", "[cli]") {
  auto c = train({"--decay-milestones", "30", "60", "90", "--sched", "multistep", "--accumulation-steps", "4",
                  "--opt-betas", "0.95", "0.9", "--clip-grad", "1", "--clip-mode", "agc", "--model-ema",
                  "--model-ema-decay", "0.99"});
  CHECK(c.decay_milestones == std::vector<double>{30, 60, 90});
  CHECK(c.grad_accum_steps == 4);
  CHECK(c.opt_betas == std::vector<double>{0.95, 0.9});  // not a range: any order
  CHECK(*c.clip_grad == Approx(1.0));
  CHECK(c.model_ema);
  CHECK(c.model_ema_decay == Approx(0.99));
  CHECK(train({"--grad-accum-steps", "2"}).grad_accum_steps == 2);
  CHECK(train({}).opt_betas.empty());
  CHECK_THAT(error_of({"--decay-milestones"}), Catch::Contains("one or more numbers"));
  CHECK_THAT(error_of({"--grad-accum-steps", "0"}), Catch::Contains("positive integer"));
  CHECK_THAT(error_of({"--clip-mode", "l1"}), Catch::Contains("norm, value, agc"));
  // an optional value (argparse's nargs='?'): alone, with a value, with '=', or before another flag
  CHECK(train({}).log_tensorboard.empty());
  CHECK(train({"--log-tensorboard"}).log_tensorboard == "true");
  CHECK(train({"--log-tensorboard", "/tmp/tb", "--epochs", "2"}).log_tensorboard == "/tmp/tb");
  CHECK(train({"--log-tensorboard=/tmp/tb"}).log_tensorboard == "/tmp/tb");
  auto tb = train({"--log-tensorboard", "--epochs", "2"});
  CHECK(tb.log_tensorboard == "true");
  CHECK(tb.epochs == 2);
  // the README's main job writes TensorBoard events into its run folder
  CHECK(train({"-c", std::string(IMGTRAIN_SOURCE_DIR) + "/configs/fashion_mnist.yaml"}).log_tensorboard == "true");
}

TEST_CASE("config file sets defaults and the command line overrides them", "[cli]") {
  test::TempDir d("cli");
  test::write_file(d / "c.yaml", "batch_size: 64\nlr: 0.25\nmodel: resnet18\nscale: [0.3, 0.9]\npin_mem: true\n");
  auto c = train({"-c", d / "c.yaml", "--lr", "0.125"});
  CHECK(c.batch_size == 64);
  CHECK(*c.lr == Approx(0.125));
  CHECK(c.model == "resnet18");
  CHECK(c.scale == std::vector<double>{0.3, 0.9});
  CHECK(c.pin_mem);
  // Dashed keys are accepted as well as timm's underscored ones.
  test::write_file(d / "dash.yaml", "batch-size: 16\n");
  CHECK(train({"-c", d / "dash.yaml"}).batch_size == 16);
  // a key given twice, in either spelling, is refused (PyYAML would keep the last without a word)
  test::write_file(d / "twice.yaml", "model: resnet18\nepochs: 1\nepochs: 2\n");
  CHECK_THAT(error_of({"-c", d / "twice.yaml"}), Catch::Contains("key 'epochs' appears more than once"));
  test::write_file(d / "twice2.yaml", "batch_size: 8\nbatch-size: 16\n");
  CHECK_THAT(error_of({"-c", d / "twice2.yaml"}), Catch::Contains("key 'batch_size' appears more than once"));
}

TEST_CASE("args.yaml written by a run is accepted back by -c", "[cli]") {
  auto c = train({"--model", "resnet18", "-b", "48", "--lr", "0.3", "--scale", "0.2", "0.8", "--experiment",
                  "x: y", "--num-classes", "7", "--no-aug"});
  test::TempDir d("cli");
  test::write_file(d / "args.yaml", imgtrain::cli::to_yaml(Command::Train, c));
  auto back = train({"-c", d / "args.yaml"});
  CHECK(back.model == "resnet18");
  CHECK(back.batch_size == 48);
  CHECK(*back.lr == Approx(0.3));
  CHECK(back.scale == std::vector<double>{0.2, 0.8});
  CHECK(back.experiment == "x: y");
  CHECK(back.num_classes == 7);
  CHECK_FALSE(back.img_size.has_value());
  CHECK(back.no_aug);
  CHECK(imgtrain::cli::to_yaml(Command::Train, back) == imgtrain::cli::to_yaml(Command::Train, c));
}

TEST_CASE("bad values name the flag, the value and what is accepted", "[cli]") {
  auto e = error_of({"-b", "abc"});
  CHECK_THAT(e, Catch::Contains("--batch-size") && Catch::Contains("'abc'") && Catch::Contains("an integer in [1, 65536]"));
  CHECK_THAT(error_of({"-b", "0"}), Catch::Contains("an integer in [1, 65536]"));
  CHECK_THAT(error_of({"--opt", "sgdd"}), Catch::Contains("--opt") && Catch::Contains("sgd, nesterov, momentum, adam, adamw, rmsproptf, lamb"));
  CHECK(error_of({"--opt", "fusedadamw", "--opt-impl", "loop"}) == "");  // timm's apex names, ATen's kernels here
  CHECK_THAT(error_of({"--opt-impl", "fast"}), Catch::Contains("--opt-impl") && Catch::Contains("auto, loop, foreach, fused"));
  CHECK_THAT(error_of({"--sched", "cos"}), Catch::Contains("cosine, tanh, step, multistep, plateau, poly"));
  CHECK_THAT(error_of({"--hflip", "1.5"}), Catch::Contains("--hflip") && Catch::Contains("[0, 1]"));
  CHECK_THAT(error_of({"--lr", "fast"}), Catch::Contains("--lr") && Catch::Contains("'fast'"));
  CHECK_THAT(error_of({"--scale", "0.5"}), Catch::Contains("--scale") && Catch::Contains("2 numbers"));
  CHECK_THAT(error_of({"--scale", "0.9", "0.1"}), Catch::Contains("low <= high"));
  CHECK_THAT(error_of({"--device", "tpu"}), Catch::Contains("--device 'tpu'") && Catch::Contains("cuda:N"));
  CHECK_THAT(error_of({"--device", "cuda:x"}), Catch::Contains("cuda:N"));
  CHECK_THAT(error_of({"--pin-mem=maybe"}), Catch::Contains("true or false"));
  CHECK_THAT(error_of({"--epoch", "3"}), Catch::Contains("unknown flag '--epoch'") && Catch::Contains("--epochs"));
  // a suggestion only where it is near; a timm option imgtrain lacks is said to be one
  CHECK_THAT(error_of({"--no-prefetcher"}), Catch::Contains("a timm option imgtrain does not implement") &&
                                                !Catch::Contains("did you mean"));
  CHECK_THAT(error_of({"--frobnicate-widgets"}), Catch::Contains("see imgtrain train --help") &&
                                                     !Catch::Contains("did you mean"));
  CHECK_THAT(error_of({"--warmup-epoch", "3"}), Catch::Contains("did you mean --warmup-epochs?"));
  CHECK_THAT(error_of({"--input-size", "3", "32", "32"}),
             Catch::Contains("a timm option imgtrain does not implement; the nearest of its own: --img-size"));
  CHECK_THAT(error_of({"stray"}), Catch::Contains("'stray'"));
  CHECK_THAT(error_of({"--crop-mode", "fit"}, Command::Validate), Catch::Contains("center, squash, border"));
  CHECK_THAT(error_of({"--interpolation", "cubic"}, Command::Validate),
             Catch::Contains("nearest, bilinear, bicubic, box, hamming, lanczos"));
  CHECK(error_of({"--interpolation", "hamming", "--crop-mode", "squash", "--fast-decode"}, Command::Validate) == "");
  // validate has its own flag set
  CHECK_THAT(error_of({"--opt", "sgd"}, Command::Validate), Catch::Contains("unknown flag '--opt'"));
}

TEST_CASE("config file errors name the key and the file", "[cli][fault]") {
  test::TempDir d("cli");
  test::write_file(d / "bad.yaml", "batch_size: 64\nlearning_rate: 0.1\n");
  CHECK_THAT(error_of({"-c", d / "bad.yaml"}), Catch::Contains("unknown key 'learning_rate'") &&
                                                   Catch::Contains("bad.yaml"));
  test::write_file(d / "val.yaml", "batch_size: many\n");
  CHECK_THAT(error_of({"-c", d / "val.yaml"}), Catch::Contains("key 'batch_size'") && Catch::Contains("'many'"));
  test::write_file(d / "broken.yaml", "batch_size: [1,\n");
  CHECK_THAT(error_of({"-c", d / "broken.yaml"}), Catch::Contains("not valid YAML"));
  CHECK_THAT(error_of({"-c", d / "missing.yaml"}), Catch::Contains("cannot read"));
  // valid YAML that is no config: one line each, never yaml-cpp's conversion error
  CHECK_THAT(error_of({"-c", d.path.string()}), Catch::Contains("a folder, not a file"));
  test::write_file(d / "two.yaml", "model: resnet18\n---\nepochs: 5\n");
  CHECK_THAT(error_of({"-c", d / "two.yaml"}), Catch::Contains("holds 2 YAML documents"));
  test::write_file(d / "three.yaml", "model: resnet18\n---\nepochs: 5\n---\n---\n");
  CHECK_THAT(error_of({"-c", d / "three.yaml"}), Catch::Contains("holds at least 3 YAML documents"));
  // yaml-cpp loops forever on a document that starts with a stray ',' (found by fuzz_config): one line
  for (const char* text : {",}davdavas:", ",", ",]a:", "\n  ,\n"}) {
    test::write_file(d / "comma.yaml", text);
    CHECK_THAT(error_of({"-c", d / "comma.yaml"}), Catch::Contains("not valid YAML") && Catch::Contains("unexpected ','"));
  }
  test::write_file(d / "empty.yaml", "");
  CHECK(error_of({"-c", d / "empty.yaml"}) == "");
  test::write_file(d / "huge.yaml", "# " + std::string((size_t(16) << 20) + 10, 'x') + "\nepochs: 2\n");
  CHECK_THAT(error_of({"-c", d / "huge.yaml"}), Catch::Contains("larger than 16 MiB"));
  test::write_file(d / "seqkey.yaml", "[a, b]: 1\n");
  CHECK_THAT(error_of({"-c", d / "seqkey.yaml"}), Catch::Contains("line 1: a key must be a name"));
  test::write_file(d / "mapkey.yaml", "epochs: 2\n{a: 1}: 2\n");
  CHECK_THAT(error_of({"-c", d / "mapkey.yaml"}), Catch::Contains("line 2: a key must be a name"));
  test::write_file(d / "nested.yaml", "scale: [[0.1, 0.2], 1]\n");
  CHECK_THAT(error_of({"-c", d / "nested.yaml"}), Catch::Contains("key 'scale'") && Catch::Contains("not of lists"));
  test::write_file(d / "deep.yaml", "scale: " + std::string(100, '[') + std::string(100, ']') + "\n");
  CHECK_THAT(error_of({"-c", d / "deep.yaml"}), Catch::Contains("nested more than 64 levels"));
  // "billion laughs": 10 levels of 9 aliases each, 390 bytes, 9^10 values once expanded
  std::string laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n";
  for (char c = 'b'; c <= 'j'; ++c) {
    laughs += fmt::format("{}: &{} [", c, c);
    for (int k = 0; k < 9; ++k) laughs += fmt::format("{}*{}", k ? ", " : "", char(c - 1));
    laughs += "]\n";
  }
  test::write_file(d / "laughs.yaml", laughs);
  CHECK_THAT(error_of({"-c", d / "laughs.yaml"}), Catch::Contains("more than 100000 values"));
}

TEST_CASE("sizes, counts and lengths are refused outside a sane range, with the range named", "[cli][fault]") {
  CHECK_THAT(error_of({"--img-size", "100000"}), Catch::Contains("expected an integer in [1, 8192]"));
  CHECK_THAT(error_of({"--num-classes", "100000000000"}), Catch::Contains("expected an integer in [1, 1000000]"));
  CHECK_THAT(error_of({"--num-classes", "1e11"}), Catch::Contains("expected an integer in [1, 1000000]"));
  CHECK_THAT(error_of({"--in-chans", "2"}), Catch::Contains("expected 1 (grayscale) or 3 (RGB)"));
  CHECK_THAT(error_of({"-j", "100000"}), Catch::Contains("expected an integer in [0, 512]"));
  CHECK_THAT(error_of({"--epochs", "9223372036854775807"}), Catch::Contains("expected an integer in [1, 1000000]"));
  CHECK_THAT(error_of({"--epochs", "99999999999999999999"}), Catch::Contains("expected an integer in [1, 1000000]"));
  CHECK_THAT(error_of({"-b", "0"}), Catch::Contains("expected an integer in [1, 65536]"));
  CHECK(error_of({"--img-size", "8192", "--num-classes", "21843", "-j", "64", "--in-chans", "1"}) == "");
  CHECK_THAT(error_of({"--recovery-interval", "99999999999999999999"}),
             Catch::Contains("expected an integer in [0, 1000000000]"));
  // crop_pct above 1 pads the crop, as timm's (docs/data.md); the range stops typos
  CHECK(error_of({"--crop-pct", "1.15"}, Command::Validate) == "");
  CHECK_THAT(error_of({"--crop-pct", "87.5"}, Command::Validate), Catch::Contains("expected a number in [0.05, 2]"));
}

TEST_CASE("a timm args.yaml is accepted, and unimplemented timm options only at their default", "[cli]") {
  // Written by timm's own train.py argument parser (tests/data, see docs/training.md).
  const std::string timm_yaml = std::string(IMGTRAIN_SOURCE_DIR) + "/tests/data/timm_args_resnet50.yaml";
  auto c = train({"-c", timm_yaml});
  CHECK(c.model == "resnet50");
  CHECK(c.epochs == 2);
  CHECK(c.data_dir == "/data");
  CHECK(c.batch_size == 128);
  CHECK(c.device == "cuda");  // timm's default device, kept: the command line can override it
  CHECK(c.decay_milestones == std::vector<double>{90, 180, 270});
  CHECK_FALSE(c.lr.has_value());
  test::TempDir d("timm");
  auto text = test::read_file(timm_yaml);
  auto with = [&](const std::string& from, const std::string& to) {
    auto t = text;
    auto p = t.find(from);
    REQUIRE(p != std::string::npos);
    t.replace(p, from.size(), to);
    test::write_file(d / "a.yaml", t);
    return error_of({"-c", d / "a.yaml"});
  };
  CHECK_THAT(with("\njsd_loss: false", "\njsd_loss: true"),
             Catch::Contains("key 'jsd_loss' is a timm option imgtrain does not implement") &&
                 Catch::Contains("true"));
  CHECK_THAT(with("\naug_splits: 0", "\naug_splits: 3"), Catch::Contains("'aug_splits'"));
  // a list value is quoted on the message's one line
  const auto list = with("\ninput_size: null", "\ninput_size:\n- 3\n- 32\n- 32");
  CHECK_THAT(list, Catch::Contains("key 'input_size' is a timm option") && Catch::EndsWith("not [3, 32, 32]"));
  CHECK(std::count(list.begin(), list.end(), '\n') == 0);
  CHECK(with("\naug_splits: 0", "\naug_splits: 0.0") == "");  // the same default written differently
  CHECK(with("\nsplit_bn: false", "\nsplit_bn: False") == "");
  // --mean / --std (timm's normalisation overrides) from the file, as timm writes a list
  CHECK(with("\nmean: null", "\nmean:\n- 0.5\n- 0.25\n- 0.125") == "");
  CHECK(train({"-c", d / "a.yaml"}).mean == std::vector<double>{0.5, 0.25, 0.125});
  CHECK(train({"-c", timm_yaml}).mean.empty());  // timm's null: the model's
  CHECK(train({"--mean", "0.5", "--std", "0.2", "0.3", "0.4"}).std_dev == std::vector<double>{0.2, 0.3, 0.4});
  CHECK_THAT(error_of({"--std", "0"}), Catch::Contains("--std") && Catch::Contains("positive"));
  // Options imgtrain implements take effect from the file.
  CHECK(with("aa: null\n", "aa: rand-m9-mstd0.5\n") == "");
  CHECK(train({"-c", d / "a.yaml"}).aa == "rand-m9-mstd0.5");
  CHECK(with("\nreprob: 0.0", "\nreprob: 0.25") == "");
  CHECK(train({"-c", d / "a.yaml"}).reprob == 0.25);
  CHECK_THAT(with("\nbatch_size: 128", "\nbatchsize: 128"),
             Catch::Contains("unknown key 'batchsize'") && Catch::Contains("did you mean 'batch_size'"));
  CHECK_THAT(with("\nsmoothing: 0.1", "\nsmothing: 0.1"), Catch::Contains("did you mean 'smoothing'"));
}

TEST_CASE("wildcards and name suggestions", "[cli]") {
  CHECK(imgtrain::wildcard_match("resnet*", "resnet50"));
  CHECK(imgtrain::wildcard_match("*net?0", "resnet50"));
  CHECK_FALSE(imgtrain::wildcard_match("resnet*", "vit_base"));
  CHECK_FALSE(imgtrain::wildcard_match("resnet5", "resnet50"));
  auto close = imgtrain::closest_names("resnet5", {"vit_tiny", "resnet50", "resnet18"}, 2);
  CHECK(close == std::vector<std::string>{"resnet50", "resnet18"});

  // The scoring gives up on a candidate once it cannot win; the ranking must be the full table's.
  auto full = [](const std::string& a, const std::string& b) {
    std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
    for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
    for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
    for (size_t i = 1; i <= a.size(); ++i)
      for (size_t j = 1; j <= b.size(); ++j)
        d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
    return d[a.size()][b.size()];
  };
  std::mt19937 gen(7);
  auto word = [&](size_t len) {
    std::string w;
    for (size_t i = 0; i < len; ++i) w += char('a' + gen() % 4);  // 4 letters: many near ties
    return w;
  };
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::string> names;
    for (int k = 0; k < 12; ++k) names.push_back(word(1 + gen() % 9));
    const std::string query = word(gen() % 12);
    std::vector<std::pair<size_t, std::string>> want;
    for (auto& c : names) want.emplace_back(full(query, c), c);
    std::sort(want.begin(), want.end());
    const auto got = imgtrain::closest_names(query, names, 3);
    REQUIRE(got.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(got[i] == want[i].second);
  }
}


namespace {
imgtrain::dist::DistEnv env_of(std::map<std::string, std::string> vars) {
  return imgtrain::dist::read_env([vars](const char* n) -> const char* {
    auto it = vars.find(n);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("the worker environment is read as torchrun and SLURM define it", "[dist][env]") {
  auto single = env_of({});
  CHECK_FALSE(single.distributed());
  CHECK(single.launcher == "none");
  auto t = env_of({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                   {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29400"},
                   {"TORCHELASTIC_RUN_ID", "job7"}, {"TORCHELASTIC_RESTART_COUNT", "2"},
                   {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  CHECK(t.launcher == "torchrun");
  CHECK(t.rank == 3);
  CHECK(t.world_size == 8);
  CHECK(t.local_rank == 1);
  CHECK(t.local_world_size == 2);
  CHECK(t.group_rank == 1);
  CHECK(t.master_addr == "node0");
  CHECK(t.master_port == 29400);
  CHECK(t.use_agent_store);
  CHECK(imgtrain::dist::store_prefix(t) == "imgtrain/job7/attempt_2/");
  // a restarted attempt reads other keys
  auto t0 = t;
  t0.restart_count = 1;
  CHECK(imgtrain::dist::store_prefix(t0) != imgtrain::dist::store_prefix(t));
  auto s = env_of({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                   {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_NODEID", "1"}, {"SLURM_JOB_ID", "991"},
                   {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "12345"}});
  CHECK(s.launcher == "slurm");
  CHECK(s.rank == 5);
  CHECK(s.world_size == 16);
  CHECK(s.local_rank == 1);
  CHECK(s.run_id == "991");
  // one SLURM task is not a distributed job
  CHECK_FALSE(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).distributed());
  CHECK_THROWS_WITH(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), Catch::Contains("RANK='x'"));
  CHECK_THROWS_WITH(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), Catch::Contains("rank 2 is not below"));
  CHECK_THROWS_WITH(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}),
                    Catch::Contains("MASTER_ADDR is not set"));
  CHECK_THROWS_WITH(env_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "70000"}}),
                    Catch::Contains("MASTER_PORT"));
}

TEST_CASE("SLURM without MASTER_ADDR or MASTER_PORT: the first host of the node list and a port from the job id",
          "[dist][env]") {
  using imgtrain::dist::first_slurm_host;
  CHECK(first_slurm_host("node17") == "node17");
  CHECK(first_slurm_host("gpu[003-005,9],login1") == "gpu003");
  CHECK(first_slurm_host("a,b[1-2]") == "a");
  CHECK(first_slurm_host("rack[2-3]-n[01-04]") == "rack2-n01");
  auto s = env_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
                   {"SLURM_JOB_ID", "1234567"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                   {"SLURM_TASKS_PER_NODE", "2(x2)"}});
  CHECK(s.master_addr == "gpu07");
  CHECK(s.master_port == 15000 + 4567);
  CHECK(s.local_world_size == 2);
  CHECK(env_of({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}, {"SLURM_NODEID", "1"}, {"SLURM_JOB_ID", "5"},
                {"SLURM_JOB_NODELIST", "a,b"}, {"SLURM_TASKS_PER_NODE", "2,1"}})
            .local_world_size == 1);
  // MASTER_ADDR / MASTER_PORT win when set.
  auto m = env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "7"}, {"SLURM_JOB_NODELIST", "x"},
                   {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29555"}});
  CHECK(m.master_addr == "10.0.0.1");
  CHECK(m.master_port == 29555);
  CHECK_THROWS_WITH(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
                    Catch::Contains("MASTER_ADDR is not set (nor SLURM_JOB_NODELIST)"));
}

TEST_CASE("Detectron2's launch names map to the launcher's flags", "[cli]") {
  auto c = parse(Command::Train, {"--num-gpus", "8", "--num-machines", "2", "--machine-rank", "1", "--dist-url",
                                  "tcp://10.1.2.3:29511"});
  REQUIRE(c);
  CHECK(c->nproc_per_node == 8);
  CHECK(c->nnodes == 2);
  CHECK(c->node_rank == 1);
  CHECK(c->master_addr == "10.1.2.3");
  CHECK(c->master_port == 29511);
  auto v6 = parse(Command::Train, {"--num-gpus", "1", "--dist-url", "tcp://[fd00::1]:29511"});
  REQUIRE(v6);
  CHECK(v6->master_addr == "fd00::1");
  CHECK_THAT(error_of({"--num-gpus", "1", "--dist-url", "10.1.2.3:29511"}), Catch::Contains("expected tcp://HOST:PORT"));
  CHECK_THAT(error_of({"--num-gpus", "1", "--dist-url", "tcp://h:99999"}), Catch::Contains("expected tcp://HOST:PORT"));
  CHECK_THAT(error_of({"--num-gpus", "1", "--dist-url", "tcp://h:1", "--master-port", "2"}),
             Catch::Contains("give one of them"));
  CHECK_THAT(error_of({"--dist-url", "tcp://h:1"}), Catch::Contains("--dist-url has no effect without --nproc-per-node"));
  CHECK(error_of({"--rdzv-timeout", "30"}) == "");  // also bounds a torchrun / srun worker's join
  CHECK_THAT(error_of({"--rdzv-timeout", "0"}), Catch::Contains("positive"));
}

TEST_CASE("flags that would have no effect are refused by name, from the command line or a file", "[cli]") {
  using C = Command;
  CHECK_THAT(error_of({"--bench", "data", "--model", "resnet18"}, C::Benchmark),
             Catch::Contains("--model has no effect with --bench data"));
  CHECK_THAT(error_of({"--bench", "data", "--channels-last"}, C::Benchmark), Catch::Contains("--channels-last"));
  CHECK_THAT(error_of({"--bench", "data", "--device", "cpu"}, C::Benchmark), Catch::Contains("--device"));
  CHECK(error_of({"--bench", "data", "--data-dir", "/d", "-j", "2", "--hflip", "0"}, C::Benchmark) == "");
  // the fused kernels are float32: refused under autocast and with O2's half-precision weights
  CHECK_THAT(error_of({"--fuse-bn", "--amp"}, C::Train), Catch::Contains("--fuse-bn has no effect with --amp ("));
  CHECK_THAT(error_of({"--fuse-bn", "--amp-opt-level", "O1"}, C::Train), Catch::Contains("--fuse-bn has no effect with --amp ("));
  CHECK_THAT(error_of({"--fuse-bn", "--amp-opt-level", "O2", "--amp-dtype", "bfloat16"}, C::Train),
             Catch::Contains("--fuse-bn has no effect with --amp-opt-level O2"));
  CHECK(error_of({"--fuse-bn", "--amp", "--amp-opt-level", "O0"}, C::Train) == "");  // O0: float32
  CHECK_THAT(error_of({"--bench", "data", "--crop-pct", "0.9"}, C::Benchmark),
             Catch::Contains("--crop-pct has no effect with --bench data (the training pipeline"));
  CHECK_THAT(error_of({"--bench", "data-eval", "--hflip", "0"}, C::Benchmark), Catch::Contains("--hflip has no effect"));
  CHECK(error_of({"--bench", "data-eval", "--data-dir", "/d", "--crop-pct", "0.9", "--interpolation", "lanczos",
                  "--crop-mode", "border", "--fast-decode"},
                 C::Benchmark) == "");
  CHECK_THAT(error_of({"--model", "resnet18", "--fast-decode"}, C::Benchmark), Catch::Contains("--fast-decode"));
  CHECK_THAT(error_of({"--bench", "train", "--data-dir", "/d"}, C::Benchmark),
             Catch::Contains("--data-dir has no effect with --bench train"));
  CHECK_THAT(error_of({"--model", "resnet18", "-j", "3"}, C::Benchmark), Catch::Contains("--workers"));
  CHECK(error_of({"--model", "resnet18", "--bench", "inference", "--channels-last"}, C::Benchmark) == "");
  CHECK_THAT(error_of({"--nnodes", "2"}), Catch::Contains("--nnodes has no effect without --nproc-per-node"));
  CHECK_THAT(error_of({"--master-port", "29500"}), Catch::Contains("--master-port"));
  CHECK(error_of({"--nproc-per-node", "2", "--nnodes", "2", "--master-port", "29500"}) == "");
  CHECK_THAT(error_of({"--checkpoint", "a.safetensors", "--pretrained"}, C::Validate),
             Catch::Contains("--pretrained has no effect with --checkpoint"));
  CHECK_THAT(error_of({"--checkpoint", "a.safetensors", "--pretrained-path", "b"}, C::Validate),
             Catch::Contains("--pretrained-path"));
  CHECK(error_of({"--pretrained", "--model", "resnet18"}, C::Validate) == "");
  // In a file only a value other than the default counts: imgtrain's own args.yaml names every flag.
  test::TempDir d("given");
  test::write_file(d / "same.yaml", "nnodes: 1\nmaster_addr: 127.0.0.1\nmaster_port: 0\n");
  CHECK(error_of({"-c", d / "same.yaml"}) == "");
  test::write_file(d / "other.yaml", "nnodes: 2\n");
  CHECK_THAT(error_of({"-c", d / "other.yaml"}), Catch::Contains("--nnodes has no effect"));
}

TEST_CASE("flags carry the task they apply to", "[cli]") {
  using imgtrain::cli::check_flags_for_task;
  CHECK_THROWS_WITH(check_flags_for_task(train({"--mixup", "0.2"}), "detection", "maskrcnn_resnet50_fpn"),
                    Catch::Equals("--mixup applies to classification models only; --model maskrcnn_resnet50_fpn is a "
                                  "detection model"));
  CHECK_THROWS_WITH(check_flags_for_task(train({"--aa", "rand-m9-mstd0.5"}), "detection", "m"), Catch::Contains("--aa"));
  CHECK_THROWS_WITH(check_flags_for_task(train({"--smoothing", "0.1"}), "detection", "m"),
                    Catch::Contains("--smoothing"));  // given, even at its default value
  CHECK_NOTHROW(check_flags_for_task(train({"--mixup", "0.2", "--aa", "rand-m9"}), "classification", "resnet50"));
  CHECK_NOTHROW(check_flags_for_task(train({"--lr", "0.02", "--epochs", "26", "--amp"}), "detection", "m"));
  CHECK_NOTHROW(check_flags_for_task(train({}), "detection", "m"));
}

TEST_CASE("torchvision's schedule flags: --lr-steps in epochs from torch's milestone, warmup in updates", "[cli][sched]") {
  auto c = train({"--lr", "0.02", "--lr-steps", "16", "22", "--lr-gamma", "0.1", "--warmup-iters", "1000",
                  "--warmup-factor", "0.001", "--epochs", "26"});
  CHECK(c.sched == "multistep");
  imgtrain::optim::Scheduler s(imgtrain::cli::scheduler_options(c, *c.lr, 500));  // 500 updates per epoch
  CHECK(s.on_updates());
  CHECK(s.num_epochs() == 26);
  CHECK(s.initial_lr() == Approx(0.02 * 0.001));
  CHECK(s.lr_at(500) == Approx(0.02 * (0.001 + 0.999 * 0.5)));  // torchvision's LinearLR from 1/1000
  CHECK(s.lr_at(1000) == Approx(0.02));
  CHECK(s.lr_at(16 * 500 - 1) == Approx(0.02));  // MultiStepLR: epoch 16 is the first at 0.1x
  CHECK(s.lr_at(16 * 500) == Approx(0.002));
  CHECK(s.lr_at(22 * 500) == Approx(0.0002));
  // timm's --decay-milestones keep timm's convention (one epoch earlier)
  auto t = train({"--lr", "0.02", "--sched", "multistep", "--decay-milestones", "16", "--warmup-epochs", "0"});
  imgtrain::optim::Scheduler ts(imgtrain::cli::scheduler_options(t, *t.lr, 1));
  CHECK(ts.lr_at(15) == Approx(0.002));
  CHECK(error_of({"--lr-steps", "3", "--decay-milestones", "4"}) ==
        "--lr-steps and --decay-milestones both set the decay points; give one of them");
  CHECK(error_of({"--lr-steps", "3", "--sched", "cosine"}) == "--lr-steps are multistep milestones, but --sched is cosine");
  CHECK(error_of({"--warmup-iters", "3", "--warmup-epochs", "1"}) ==
        "--warmup-iters and --warmup-epochs both set the warmup length; give one of them");
  CHECK(error_of({"--warmup-iters", "3", "--sched", "plateau"}) ==
        "--sched plateau steps per epoch; --warmup-iters and --max-iter need a schedule stepped per update");
}

TEST_CASE("max-iter: the run and every schedule length count updates", "[cli][sched]") {
  auto c = train({"--lr", "0.1", "--max-iter", "2500", "--lr-steps", "2000", "--warmup-iters", "100"});
  imgtrain::optim::Scheduler s(imgtrain::cli::scheduler_options(c, *c.lr, 1000));
  CHECK(s.num_epochs() == 3);  // ceil(2500 / 1000): the last epoch ends after its 500th update
  CHECK(s.lr_at(100) == Approx(0.1));
  CHECK(s.lr_at(1999) == Approx(0.1));
  CHECK(s.lr_at(2000) == Approx(0.01));
  auto cos = train({"--lr", "0.1", "--max-iter", "2000"});  // cosine over 2000 updates, no warmup
  imgtrain::optim::Scheduler cs(imgtrain::cli::scheduler_options(cos, *cos.lr, 300));
  CHECK(cs.lr_at(0) == Approx(0.1));
  CHECK(cs.lr_at(1000) == Approx(0.05));
  CHECK(cs.num_epochs() == 7);
  CHECK(error_of({"--max-iter", "10", "--epochs", "3"}) ==
        "--max-iter and --epochs both set the training length; give one of them");
  CHECK(error_of({"--max-iter", "10", "--warmup-epochs", "1"}) ==
        "--warmup-epochs counts epochs; with --max-iter every schedule length counts updates (--warmup-iters, --lr-steps)");
  CHECK_THAT(error_of({"--max-iter", "10", "--sched", "step"}), Catch::Contains("--sched step counts epochs"));
  CHECK(error_of({"--ims-per-batch", "16", "-b", "4"}) ==
        "--ims-per-batch and --batch-size both set the batch size; give one of them");
}

namespace {
// Detectron2's Base-RCNN-FPN.yaml and mask_rcnn_R_101_FPN_3x.yaml, key for key.
void write_detectron2_configs(const std::filesystem::path& d) {
  std::filesystem::create_directories(d / "COCO-InstanceSegmentation");
  test::write_file(d / "Base-RCNN-FPN.yaml", R"(MODEL:
  META_ARCHITECTURE: "GeneralizedRCNN"
  BACKBONE:
    NAME: "build_resnet_fpn_backbone"
  RESNETS:
    OUT_FEATURES: ["res2", "res3", "res4", "res5"]
  FPN:
    IN_FEATURES: ["res2", "res3", "res4", "res5"]
  ANCHOR_GENERATOR:
    SIZES: [[32], [64], [128], [256], [512]]  # One size for each in feature map
    ASPECT_RATIOS: [[0.5, 1.0, 2.0]]  # Three aspect ratios (same for all in feature maps)
  RPN:
    IN_FEATURES: ["p2", "p3", "p4", "p5", "p6"]
    PRE_NMS_TOPK_TRAIN: 2000  # Per FPN level
    PRE_NMS_TOPK_TEST: 1000  # Per FPN level
    POST_NMS_TOPK_TRAIN: 1000
    POST_NMS_TOPK_TEST: 1000
  ROI_HEADS:
    NAME: "StandardROIHeads"
    IN_FEATURES: ["p2", "p3", "p4", "p5"]
  ROI_BOX_HEAD:
    NAME: "FastRCNNConvFCHead"
    NUM_FC: 2
    POOLER_RESOLUTION: 7
  ROI_MASK_HEAD:
    NAME: "MaskRCNNConvUpsampleHead"
    NUM_CONV: 4
    POOLER_RESOLUTION: 14
DATASETS:
  TRAIN: ("coco_2017_train",)
  TEST: ("coco_2017_val",)
SOLVER:
  IMS_PER_BATCH: 16
  BASE_LR: 0.02
  STEPS: (60000, 80000)
  MAX_ITER: 90000
INPUT:
  MIN_SIZE_TRAIN: (640, 672, 704, 736, 768, 800)
VERSION: 2
)");
  test::write_file(d / "COCO-InstanceSegmentation/mask_rcnn_R_101_FPN_3x.yaml", R"(_BASE_: "../Base-RCNN-FPN.yaml"
MODEL:
  WEIGHTS: "detectron2://ImageNetPretrained/MSRA/R-101.pkl"
  MASK_ON: True
  RESNETS:
    DEPTH: 101
SOLVER:
  STEPS: (210000, 250000)
  MAX_ITER: 270000
)");
}
}  // namespace

TEST_CASE("a Detectron2 config maps onto the same settings, _BASE_ and Detectron2's defaults included", "[cli][detectron2]") {
  test::TempDir d("d2");
  write_detectron2_configs(d.path);
  const std::string f = (d / "COCO-InstanceSegmentation/mask_rcnn_R_101_FPN_3x.yaml");
  auto c = train({"-c", f, "--pretrained-path", "resnet101.pth", "--data-dir", "/coco"});
  CHECK(c.model == "maskrcnn_resnet101_fpn");
  CHECK(c.dataset == "coco");
  CHECK(c.train_split == "train");
  CHECK(c.val_split == "val");
  CHECK(c.max_iter == 270000);
  CHECK(c.lr_steps == std::vector<double>{210000, 250000});
  CHECK(c.sched == "multistep");
  CHECK(*c.lr == Approx(0.02));
  CHECK(c.ims_per_batch == 16);
  CHECK(c.warmup_iters == 1000);
  CHECK(*c.warmup_factor == Approx(0.001));
  CHECK(c.opt == "momentum");
  CHECK(c.momentum == Approx(0.9));
  CHECK(c.weight_decay == Approx(1e-4));
  CHECK(c.min_size == std::vector<double>{640, 672, 704, 736, 768, 800});
  CHECK(*c.min_size_test == 800);
  CHECK(c.max_size == 1333);
  CHECK(c.roi_align_v2);
  CHECK(c.mask_convention == "detectron2");  // Detectron2's mask targets and paste (no key selects them)
  CHECK(c.box_sampling_ratio == 0);
  CHECK(c.box_loss == "l1");
  CHECK(c.rpn_box_loss == "l1");
  CHECK(c.rpn_post_nms_top_n_train == 1000);  // the base file's, over Detectron2's default 2000
  CHECK(c.rpn_pre_nms_top_n_train == 2000);
  CHECK(c.box_batch_size_per_image == 512);
  CHECK_FALSE(c.trainable_backbone_layers.has_value());  // FREEZE_AT's default 2 is torchvision's own
  CHECK(c.two_bucket_grouping);
  CHECK(c.workers == 4);
  CHECK(c.pretrained_path == "resnet101.pth");
  imgtrain::optim::Scheduler s(imgtrain::cli::scheduler_options(c, *c.lr, 7330));
  CHECK(s.num_epochs() == 37);
  CHECK(s.lr_at(0) == Approx(0.02 * 0.001));
  CHECK(s.lr_at(209999) == Approx(0.02));
  CHECK(s.lr_at(210000) == Approx(0.002));  // WarmupMultiStepLR: bisect_right(steps, iter)
  CHECK(s.lr_at(250000) == Approx(0.0002));
  // The command line wins over the file's counterpart; args.yaml reads back to the same config.
  auto b = train({"-c", f, "--pretrained-path", "r.pth", "-b", "2", "--sched", "cosine"});
  CHECK_FALSE(b.ims_per_batch.has_value());
  CHECK(b.batch_size == 2);
  CHECK(b.lr_steps.empty());
  test::write_file(d / "args.yaml", imgtrain::cli::to_yaml(Command::Train, c));
  auto back = train({"-c", (d / "args.yaml")});
  CHECK(imgtrain::cli::to_yaml(Command::Train, back) == imgtrain::cli::to_yaml(Command::Train, c));
  // validate reads the model and test settings and leaves the solver's
  auto v = *parse(Command::Validate, {"-c", f, "--pretrained-path", "r.pth"});
  CHECK(v.model == "maskrcnn_resnet101_fpn");
  CHECK(*v.min_size_test == 800);
}

TEST_CASE("Detectron2 keys imgtrain cannot honour are refused by name", "[cli][detectron2]") {
  test::TempDir d("d2");
  write_detectron2_configs(d.path);
  const std::string f = (d / "COCO-InstanceSegmentation/mask_rcnn_R_101_FPN_3x.yaml");
  CHECK_THAT(error_of({"-c", f}), Catch::Contains("--pretrained-path 'detectron2://ImageNetPretrained/MSRA/R-101.pkl'") &&
                                      Catch::Contains("torchvision's weights"));
  CHECK(error_of({"-c", f, "--pretrained-path", "r.pth", "--epochs", "12"}) ==
        "--max-iter (from -c's file) and --epochs both set the training length; give one of them");
  CHECK(error_of({"--warmup-iters", "-1"}) == "--warmup-iters '-1': expected an integer >= 0");
  auto one = [&](const std::string& yaml) {
    test::write_file(d / "x.yaml", yaml);
    return error_of({"-c", (d / "x.yaml")});
  };
  CHECK(one("MODEL:\n  FOO: 1\n") ==
        "key 'MODEL.FOO' in " + (d / "x.yaml") +
            ": a Detectron2 key imgtrain does not map (docs/detection.md lists the keys it reads)");
  CHECK_THAT(one("MODEL:\n  RESNETS:\n    STRIDE_IN_1X1: True\n"),
             Catch::Contains("key 'MODEL.RESNETS.STRIDE_IN_1X1'") && Catch::Contains("stride in the 3x3"));
  CHECK_THAT(one("MODEL:\n  RESNETS:\n    DEPTH: 152\n"), Catch::Contains("expected 18, 34, 50 or 101"));
  CHECK_THAT(one("INPUT:\n  MAX_SIZE_TEST: 1000\n"), Catch::Contains("one --max-size"));
  CHECK_THAT(one("SOLVER:\n  BASE_LR: -1\n"), Catch::Contains("key 'SOLVER.BASE_LR'") && Catch::Contains("'-1'"));
  CHECK_THAT(one("SOLVER:\n  STEPS: (1, 2\n"), Catch::Contains("not a closed tuple"));
  CHECK_THAT(one("_BASE_: missing.yaml\n"), Catch::Contains("its _BASE_") && Catch::Contains("cannot read the file"));
  CHECK_THAT(one("_BASE_: x.yaml\n"), Catch::Contains("nest more than 8 deep"));
  CHECK_THAT(one("DATASETS:\n  TRAIN: ('my_set',)\n"), Catch::Contains("one COCO 2017 split"));
  // read, with no effect: a warning, not an error
  CHECK(one("SOLVER:\n  CHECKPOINT_PERIOD: 5000\n").empty());
  CHECK(one("MODEL:\n  BACKBONE:\n    FREEZE_AT: 0\n").empty());
  CHECK(train({"-c", (d / "x.yaml")}).trainable_backbone_layers == 5);
}

TEST_CASE("a detector's widths come from flags or Detectron2's keys, and are checked", "[cli][detectron2]") {
  test::TempDir d("d2w");
  test::write_file(d / "w.yaml",
                   "MODEL:\n  FPN:\n    OUT_CHANNELS: 128\n  ROI_BOX_HEAD:\n    FC_DIM: 512\n"
                   "  ROI_MASK_HEAD:\n    CONV_DIM: 64\n    NUM_CONV: 2\n");
  auto c = train({"-c", d / "w.yaml"});
  CHECK(c.fpn_channels == 128);
  CHECK(c.box_head_dim == 512);
  CHECK(c.mask_head_dim == 64);
  CHECK(c.mask_head_convs == 2);
  auto dflt = train({"--model", "maskrcnn_resnet18_fpn"});
  CHECK(dflt.fpn_channels == 256);
  CHECK(dflt.box_head_dim == 1024);
  CHECK(dflt.mask_head_dim == 256);
  CHECK(dflt.mask_head_convs == 4);
  auto flags = train({"-c", d / "w.yaml", "--fpn-channels", "32", "--mask-head-convs", "0"});
  CHECK(flags.fpn_channels == 32);  // the command line wins
  CHECK(flags.mask_head_convs == 0);
  CHECK_THAT(error_of({"--fpn-channels", "0"}), Catch::StartsWith("--fpn-channels '0': expected a positive"));
  CHECK_THAT(error_of({"--mask-head-convs", "-1"}), Catch::StartsWith("--mask-head-convs '-1': expected"));
  CHECK_THROWS_WITH(imgtrain::cli::check_flags_for_task(train({"--model", "resnet18", "--box-head-dim", "64"}),
                                                       "classification", "resnet18"),
                    Catch::Contains("--box-head-dim applies to detection models only"));
}

TEST_CASE("large-scale jitter: --data-augmentation lsj with its size and scale range, checked", "[cli]") {
  auto c = train({"--model", "maskrcnn_resnet18_fpn", "--data-augmentation", "lsj"});
  CHECK(c.lsj_size == 1024);  // torchvision's
  CHECK(c.lsj_scale == std::vector<double>{0.1, 2.0});
  c = train({"--model", "maskrcnn_resnet18_fpn", "--data-augmentation", "lsj", "--lsj-size", "160", "--lsj-scale",
             "0.5", "1.5"});
  CHECK(c.lsj_size == 160);
  CHECK(c.lsj_scale == std::vector<double>{0.5, 1.5});
  imgtrain::cli::check_flags_for_task(c, "detection", "maskrcnn_resnet18_fpn");
  CHECK_THAT(error_of({"--lsj-scale", "0", "1"}), Catch::StartsWith("--lsj-scale"));
  CHECK_THAT(error_of({"--lsj-scale", "1.5", "0.5"}), Catch::StartsWith("--lsj-scale"));
  CHECK_THAT(error_of({"--lsj-scale", "1", "100"}), Catch::StartsWith("--lsj-scale"));
  CHECK_THAT(error_of({"--lsj-size", "0"}), Catch::StartsWith("--lsj-size"));
  CHECK_THAT(error_of({"--data-augmentation", "mosaic"}), Catch::Contains("lsj"));
  CHECK_THROWS_WITH(imgtrain::cli::check_flags_for_task(train({"--model", "maskrcnn_resnet18_fpn", "--lsj-size", "64"}),
                                                       "detection", "maskrcnn_resnet18_fpn"),
                    Catch::Contains("--lsj-size applies with --data-augmentation lsj only"));
  // a detection run's args.yaml (it names --lsj-size and --lsj-scale at their defaults) repeats the
  // run; a file that sets them to something else without lsj is refused as the command line is
  test::TempDir d("cli");
  const auto run = train({"--model", "maskrcnn_resnet18_fpn", "--min-size", "64", "--max-size", "96"});
  test::write_file(d / "args.yaml", imgtrain::cli::to_yaml(Command::Train, run));
  const auto back = train({"-c", d / "args.yaml"});
  CHECK_NOTHROW(imgtrain::cli::check_flags_for_task(back, "detection", "maskrcnn_resnet18_fpn"));
  CHECK(imgtrain::cli::to_yaml(Command::Train, back) == imgtrain::cli::to_yaml(Command::Train, run));
  test::write_file(d / "lsj.yaml", "model: maskrcnn_resnet18_fpn\nlsj_size: 64\n");
  CHECK_THROWS_WITH(imgtrain::cli::check_flags_for_task(train({"-c", d / "lsj.yaml"}), "detection",
                                                       "maskrcnn_resnet18_fpn"),
                    Catch::Contains("--lsj-size applies with --data-augmentation lsj only"));
}

TEST_CASE("the detection recipes parse: torchvision's, Detectron2's R101 3x, and the same in imgtrain keys with O2",
          "[cli][detectron2]") {
  const std::string dir = std::string(IMGTRAIN_SOURCE_DIR) + "/configs/detection/";
  auto tv = train({"-c", dir + "maskrcnn_resnet50_fpn.yaml"});
  CHECK(tv.lr_steps == std::vector<double>{16, 22});
  CHECK(tv.warmup_iters == 1000);
  auto d2 = train({"-c", dir + "detectron2/mask_rcnn_R_101_FPN_3x.yaml", "--pretrained-path", "r101.pth"});
  auto o2 = train({"-c", dir + "mask_rcnn_R_101_FPN_3x_O2.yaml", "--pretrained-path", "r101.pth"});
  CHECK(o2.amp_opt_level == "O2");
  CHECK(*o2.loss_scale == 64);
  o2.amp_opt_level = d2.amp_opt_level;
  o2.loss_scale = d2.loss_scale;
  o2.config_file = d2.config_file;
  CHECK(imgtrain::cli::to_yaml(Command::Train, o2) == imgtrain::cli::to_yaml(Command::Train, d2));
  auto cpu = train({"-c", dir + "maskrcnn_resnet18_fpn_cpu.yaml"});
  CHECK(cpu.model == "maskrcnn_resnet18_fpn");
  CHECK(cpu.max_iter == 5200);
  CHECK(cpu.mask_rois_per_image == 8);
  CHECK(cpu.channels_last);
}

TEST_CASE("a detector's own defaults apply unless the command line or the -c file sets them", "[cli][detectron2]") {
  test::TempDir d("mdef");
  test::write_file(d / "c.yaml", "rpn_pre_nms_top_n_test: 1000\nmin_size: [800]\n");
  auto c = imgtrain::tasks::with_model_defaults(
      train({"-c", d / "c.yaml", "--model", "fasterrcnn_mobilenet_v3_large_320_fpn", "--rpn-score-thresh", "0"}));
  CHECK(c.min_size == std::vector<double>{800});  // the file's, though it is the generic default
  CHECK(c.rpn_pre_nms_top_n_test == 1000);
  CHECK(c.rpn_score_thresh == 0);                 // the command line's
  CHECK(c.max_size == 640);                       // the builder's
  CHECK(c.rpn_post_nms_top_n_test == 150);
  auto r = imgtrain::tasks::with_model_defaults(train({"--model", "resnet18"}));
  CHECK(r.min_size == std::vector<double>{800});  // not a detector: as given
}

TEST_CASE("batches are pinned on CUDA unless --pin-mem=false says otherwise, never on the CPU", "[cli]") {
  CHECK(train({}).pinned_batches(true));
  CHECK_FALSE(train({}).pinned_batches(false));
  CHECK_FALSE(train({"--pin-mem=false"}).pinned_batches(true));
  CHECK(train({"--pin-mem"}).pinned_batches(true));
  CHECK_FALSE(train({"--pin-mem"}).pinned_batches(false));
}

TEST_CASE("a boolean flag --X is turned off by --no-X, as by --X=false, and --no-aug stays a flag of its own", "[cli]") {
  CHECK_FALSE(train({"--no-channels-last"}).channels_last_on(true));
  CHECK(train({"--no-channels-last"}).was_given("channels-last"));
  CHECK(train({"--channels-last"}).channels_last_on(false));
  CHECK_FALSE(train({"--no-fuse-bn"}).fuse_bn_on(true));
  CHECK_THAT(error_of({"--no-fuse-bn=false"}, Command::Benchmark),
             Catch::Contains("'--no-fuse-bn=false': --no-fuse-bn takes no value (--fuse-bn=true or --fuse-bn=false"));
  CHECK_FALSE(train({"--no-pin-mem"}).pinned_batches(true));
  CHECK(train({"--no-aug"}).no_aug);
  // only booleans have a --no- form; an unknown one is refused by name
  CHECK_THAT(error_of({"--no-model"}, Command::Train), Catch::Contains("unknown flag '--no-model'"));
  CHECK_THAT(error_of({"--no-channels-last=true"}, Command::Train), Catch::Contains("--no-channels-last takes no value"));
  CHECK_THAT(error_of({"--no-model=x"}, Command::Train), Catch::Contains("unknown flag '--no-model'"));
}
