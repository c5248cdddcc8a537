#include "apps/imgtrain/commands.h"

#include "cli/config.h"
#include "core/error.h"
#include "data/coco_detection.h"
#include "data/dataset.h"
#include "data/shards.h"
#include "dist/launcher.h"
#include "engine/checkpoint.h"
#include "engine/commands.h"
#include "engine/run_folder.h"
#include "io/weights.h"
#include "model_zoo/registry.h"
#include "tasks/detection/coco_eval.h"
#include "tasks/tasks.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <cxxopts.hpp>
#include <fmt/ranges.h>

namespace imgtrain::app {

namespace {
// --nproc-per-node N: this process becomes the launcher of N workers running the same command
// line; a worker (started by us, torchrun or srun) ignores the flag.
std::optional<int> launch_workers(const cli::Config& cfg, const char* command, const std::vector<std::string>& args) {
  if (cfg.nproc_per_node == 0 || dist::launched_worker()) return std::nullopt;
  dist::LaunchOptions lo;
  lo.nproc_per_node = cfg.nproc_per_node;
  lo.nnodes = cfg.nnodes;
  lo.node_rank = cfg.node_rank;
  lo.master_addr = cfg.master_addr;
  lo.master_port = cfg.master_port;
  lo.rdzv_id = cfg.rdzv_id;
  lo.rdzv_timeout_s = cfg.rdzv_timeout;
  std::vector<std::string> argv{"imgtrain", command};
  argv.insert(argv.end(), args.begin(), args.end());
  return dist::launch(lo, argv);
}

// The flags of a small subcommand (export, pack); nullopt after printing --help.
std::optional<cxxopts::ParseResult> parse_command(cxxopts::Options& opts, const char* name,
                                                  const std::vector<std::string>& args) {
  std::vector<std::string> a = args;
  // An unknown flag: the line train's parser gives, with the closest of this command's flags.
  std::vector<std::string> known;
  std::string short_flags;
  for (const auto& g : opts.groups())
    for (const auto& o : opts.group_help(g).options) {
      for (const auto& l : o.l) known.push_back(l);
      short_flags += o.s;
    }
  cli::refuse_unknown_flags(a, known, short_flags, std::string("imgtrain ") + name);
  std::vector<char*> argv{const_cast<char*>(name)};
  for (auto& s : a) argv.push_back(s.data());
  cxxopts::ParseResult r;
  try {
    r = opts.parse(int(argv.size()), argv.data());
  } catch (const cxxopts::exceptions::exception& e) {
    throw UserError(fmt::format("{}: {}", name, e.what()));
  }
  if (r.count("help")) {
    std::puts(opts.help().c_str());
    return std::nullopt;
  }
  if (!r.unmatched().empty())
    throw UserError(fmt::format("{}: unexpected argument '{}' (flags start with --)", name,
                                r.unmatched()[0]));
  return r;
}
}  // namespace

int train(const std::vector<std::string>& args) {
  auto cfg = cli::parse(cli::Command::Train, args);
  if (!cfg) return 0;
  data::set_max_image_pixels(cfg->max_image_pixels);
  if (auto rc = launch_workers(*cfg, "train", args)) return *rc;
  return engine::train(*cfg);
}

int benchmark(const std::vector<std::string>& args) {
  auto cfg = cli::parse(cli::Command::Benchmark, args);
  if (!cfg) return 0;
  data::set_max_image_pixels(cfg->max_image_pixels);
  if (auto rc = launch_workers(*cfg, "benchmark", args)) return *rc;
  return engine::benchmark(*cfg);
}

int validate(const std::vector<std::string>& args) {
  auto cfg = cli::parse(cli::Command::Validate, args);
  if (!cfg) return 0;
  data::set_max_image_pixels(cfg->max_image_pixels);
  return engine::validate(*cfg);
}

int models(const std::vector<std::string>& args) {
  std::string pattern = "*";
  bool verbose = false;
  for (auto& a : args) {
    if (a == "-h" || a == "--help") {
      std::puts("usage: imgtrain models [WILDCARD] [--verbose]\n"
                "Lists registered models matching WILDCARD (shell-style, e.g. 'resnet*') with their parameter count;\n"
                "--verbose adds the default input size, crop_pct and interpolation.");
      return 0;
    }
    if (a == "--verbose" || a == "-v") verbose = true;
    else if (!a.empty() && a[0] == '-') throw UserError("models: unknown flag '" + a + "' (accepted: --verbose)");
    else pattern = a;
  }
  auto names = model_zoo::list_models(pattern);
  if (names.empty()) throw UserError("models: no model matches '" + pattern + "'");
  for (auto& n : names) {
    const auto& d = model_zoo::model_defaults(n);
    ModelArgs margs;
    margs.num_classes = d.num_classes;  // 1000 for ImageNet classifiers, 91 for COCO detectors
    auto m = model_zoo::create_module(n, margs);
    if (verbose) {
      std::string tags;
      for (auto& t : d.tags) tags += (tags.empty() ? "" : ",") + t;
      std::printf("%-28s %12lld  %lldx%lldx%lld  crop_pct=%.3g  %-8s  %s\n", n.c_str(),
                  (long long)model_zoo::count_params(*m), (long long)d.input_size[0], (long long)d.input_size[1],
                  (long long)d.input_size[2], d.crop_pct, d.interpolation.c_str(), tags.c_str());
    }
    else
      std::printf("%-28s %12lld\n", n.c_str(), (long long)model_zoo::count_params(*m));
  }
  return 0;
}

int export_weights(const std::vector<std::string>& args) {
  cxxopts::Options opts("imgtrain export", "Write a checkpoint's weights as a plain state dict with timm's names");
  opts.add_options()("checkpoint", "Checkpoint written by imgtrain train (or a torch.save .pth of timm / torchvision)",
                     cxxopts::value<std::string>())(
      "use-ema", "Export the EMA weights")("out", "Output file (.safetensors)", cxxopts::value<std::string>())(
      "h,help", "Show this help");
  auto parsed = parse_command(opts, "export", args);
  if (!parsed) return 0;
  auto& r = *parsed;
  if (!r.count("checkpoint") || !r.count("out")) throw UserError("export needs --checkpoint FILE and --out FILE.safetensors");
  const auto ckpt = r["checkpoint"].as<std::string>(), out = r["out"].as<std::string>();
  if (out.size() < 12 || out.substr(out.size() - 12) != ".safetensors")
    throw UserError(fmt::format("--out '{}': expected a file name ending in .safetensors (timm picks the loader by it)", out));
  const auto ck = engine::Checkpoint::read(ckpt);
  const bool ema = r.count("use-ema") > 0;
  const std::string prefix = ck.weights_prefix(ema);
  if (ema && prefix != "ema.") throw UserError(fmt::format("--use-ema: '{}' has no EMA weights", ckpt));
  // Check the weights against the architecture they claim before writing them out.
  if (const auto& m = ck.meta(); !m.arch.empty()) {
    if (!model_zoo::find_model(m.arch))
      throw UserError(fmt::format("'{}': metadata 'arch' is '{}', a model imgtrain does not know (`imgtrain models` "
                                  "lists them)",
                                  ckpt, m.arch));
    auto meta = m;
    if (!meta.num_classes) {  // a timm checkpoint with 'arch' and no 'args': its classifier says
      const auto* fc = ck.tensors().find(prefix + model_zoo::model_defaults(m.arch).classifier + ".weight");
      if (fc && fc->dim() >= 1) meta.num_classes = fc->size(0);
    }
    auto model = tasks::module_from_meta(meta, ckpt);
    ck.load_prefixed(*model, prefix);
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& [k, v] : ck.tensors().tensors)
    if (prefix.empty() || k.rfind(prefix, 0) == 0) {
      if (!io::all_finite(v))
        throw UserError(fmt::format("'{}': tensor '{}' holds NaN or infinite values; not exported", ckpt, k));
      tensors.emplace_back(k.substr(prefix.size()), v);
    }
  io::save_safetensors(out, tensors, {{"format", "pt"}});
  std::printf("Wrote %zu tensors (%s weights) to %s\n", tensors.size(), ema ? "EMA" : "model", out.c_str());
  return 0;
}

namespace {
// "1GB", "500MB", "64KiB", "123456" -> bytes (decimal units as written; KiB/MiB/GiB binary).
uint64_t parse_size(const std::string& s) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = s.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });
  static const std::map<std::string, double> units = {{"", 1},       {"B", 1},         {"KB", 1e3},
                                                      {"MB", 1e6},   {"GB", 1e9},      {"KIB", 1024.0},
                                                      {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  auto it = units.find(unit);
  if (used == 0 || it == units.end() || v <= 0)
    throw UserError(fmt::format("--shard-size '{}': expected a size such as 1GB, 500MB or 64MiB", s));
  return uint64_t(v * it->second);
}
}  // namespace

int plot(const std::vector<std::string>& args) {
  // run folders as plain arguments (a folder name may hold a comma, which cxxopts' lists split)
  std::vector<std::string> runs;
  std::string out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::puts("usage: imgtrain plot RUN_DIR [RUN_DIR ...] [-o OUT.png]\n\n"
                "Draws the runs' training curves from their summary.csv (train loss, eval metric, lr over epochs)\n"
                "into one PNG; several runs are overlaid, a colour each. Default output: curves.png in the run's\n"
                "folder for one run, ./curves.png for several.");
      return 0;
    }
    if (a == "-o" || a == "--out") {
      if (i + 1 >= args.size()) throw UserError(fmt::format("plot: {} needs a file name", a));
      out = args[++i];
    } else if (a.rfind("--out=", 0) == 0) {
      out = a.substr(6);
    } else if (!a.empty() && a[0] == '-') {
      throw UserError(fmt::format("plot: unknown flag '{}' (expected -o OUT.png)", a));
    } else {
      runs.push_back(a);
    }
  }
  if (runs.empty()) throw UserError("plot needs at least one run folder (one with a summary.csv)");
  if (out.empty()) out = runs.size() == 1 ? runs[0] + "/curves.png" : "curves.png";
  if (out.size() < 4 || out.substr(out.size() - 4) != ".png")
    throw UserError(fmt::format("plot: -o '{}': expected a file name ending in .png", out));
  engine::plot_runs(runs, out);
  std::printf("Wrote %s (%zu run(s))\n", out.c_str(), runs.size());
  return 0;
}

int pack(const std::vector<std::string>& args) {
  cxxopts::Options opts("imgtrain pack", "Convert an ImageFolder into tar shards (WebDataset layout: <key>.jpg + <key>.cls)");
  opts.add_options()("data-dir", "ImageFolder root (its train/validation splits) or one split", cxxopts::value<std::string>())(
      "out", "Output folder (one sub-folder per split)", cxxopts::value<std::string>())(
      "shard-size", "Bytes per shard (e.g. 1GB, 256MB)", cxxopts::value<std::string>()->default_value("1GB"))(
      "max-size", "Re-encode (JPEG q90) images whose long side exceeds this (0: copy as is)",
      cxxopts::value<int>()->default_value("0"))(
      "overwrite", "Remove the .tar files the output folders already hold (else a folder with any is refused)")(
      "input-key", "The file extensions read, ';'-separated (default: timm's .png;.jpg;.jpeg)",
      cxxopts::value<std::string>()->default_value(""))(
      "h,help", "Show this help");
  auto parsed = parse_command(opts, "pack", args);
  if (!parsed) return 0;
  auto& r = *parsed;
  if (!r.count("data-dir") || !r.count("out")) throw UserError("pack needs --data-dir FOLDER and --out FOLDER");
  data::PackOptions po;
  po.data_dir = r["data-dir"].as<std::string>();
  po.out = r["out"].as<std::string>();
  {  // shards written among the images they are made from would be scanned as part of the folder
    std::error_code ec;
    const auto in = std::filesystem::weakly_canonical(po.data_dir, ec);
    const auto out = std::filesystem::weakly_canonical(po.out, ec);
    const auto rel = out.lexically_relative(in);
    if (!ec && !rel.empty() && *rel.begin() != "..")
      throw UserError(fmt::format("--out '{}' is {} --data-dir '{}': give an output folder outside the ImageFolder",
                                  po.out, rel == "." ? "the same folder as" : "inside", po.data_dir));
  }
  po.shard_size = parse_size(r["shard-size"].as<std::string>());
  po.max_size = r["max-size"].as<int>();
  po.overwrite = r.count("overwrite") > 0;
  po.input_key = r["input-key"].as<std::string>();
  data::folder_extensions(po.input_key);  // checked before any folder is touched
  if (po.max_size < 0) throw UserError(fmt::format("--max-size {}: expected 0 or a positive size", po.max_size));
  po.log = [](const std::string& line) { std::printf("%s\n", line.c_str()); };
  auto res = data::pack_image_folder(po);
  std::printf("Packed %lld samples into %lld shard(s) (%lld re-encoded, %lld unreadable skipped)\n",
              (long long)res.samples, (long long)res.shards, (long long)res.reencoded, (long long)res.skipped);
  return 0;
}

// MKL, linked into LibTorch's CPU library, asks mkl_serv_intel_cpu_true() whether the CPU is
// Intel's before it picks its GEMM kernels; on other vendors' CPUs the answer is no and sgemm runs
// generic AVX2 code even where the CPU has AVX-512 (an AMD EPYC Zen 4: 190-207 against 207-228
// GFLOPS on ViT-S's linears, docs/performance.md). The library calls the function through its
// dynamic symbol table, so this definition in the executable (exported: see CMakeLists.txt)
// answers instead: yes on AMD CPUs, where MKL then picks its kernels by the CPU's instruction sets
// as on Intel's; the vendor's answer elsewhere. IMGTRAIN_MKL_INTEL_PATHS=0 gives the vendor's answer
// on AMD too. oneDNN (convolutions, the prepacked linears) does not ask.
namespace {
std::atomic<int> g_mkl_vendor_asks{0};

std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return "unknown";
  char v[13] = {};
  std::memcpy(v, &ebx, 4);
  std::memcpy(v + 4, &edx, 4);
  std::memcpy(v + 8, &ecx, 4);
  return v;
#else
  return "non-x86";
#endif
}

bool mkl_intel_paths_wanted() {
  if (const char* v = std::getenv("IMGTRAIN_MKL_INTEL_PATHS"); v && std::strcmp(v, "0") == 0) return false;
  return true;
}
}  // namespace

MklDispatch mkl_dispatch() {
  static const std::string vendor = cpu_vendor();
  MklDispatch d;
  d.vendor = vendor;
  d.genuine_intel = vendor == "GenuineIntel";
  d.intel_paths = d.genuine_intel || (vendor == "AuthenticAMD" && mkl_intel_paths_wanted());
  d.asked = g_mkl_vendor_asks.load();
  return d;
}

int version(const char* version) {
  std::printf("imgtrain %s (LibTorch %s, CUDA %s)\n", version, TORCH_VERSION,
#ifdef IMGTRAIN_WITH_CUDA
              "enabled"
#else
              "disabled"
#endif
  );
  // One small product, so that MKL (where LibTorch has it) has chosen its code paths by now.
  const auto a = torch::ones({64, 64});
  (void)torch::mm(a, a);
  const auto m = mkl_dispatch();
  if (m.asked == 0)
    std::printf("MKL: not asked for the CPU vendor (this LibTorch's BLAS is not MKL)\n");
  else if (m.intel_paths && !m.genuine_intel)
    std::printf("MKL: Intel's code paths on this %s CPU (IMGTRAIN_MKL_INTEL_PATHS=0 restores MKL's vendor check)\n",
                m.vendor.c_str());
  else
    std::printf("MKL: %s code paths (%s CPU%s)\n", m.genuine_intel ? "Intel's" : "generic", m.vendor.c_str(),
                m.intel_paths || m.genuine_intel ? "" : ", IMGTRAIN_MKL_INTEL_PATHS=0");
  return 0;
}

}  // namespace imgtrain::app

namespace imgtrain::app {

// A drop-in for pycocotools' evaluation script: COCO(gt).loadRes(results), COCOeval evaluate,
// accumulate, summarize; the same numbers, printed the same way.
int evaluate_coco(const std::vector<std::string>& args) {
  cxxopts::Options opts("imgtrain evaluate-coco",
                        "Score COCO detection results against COCO annotations (pycocotools' COCOeval numbers)");
  opts.add_options()("gt", "Ground truth: instances_*.json", cxxopts::value<std::string>())(
      "results", "Detections: a COCO results json (list of image_id, category_id, bbox | segmentation, score)",
      cxxopts::value<std::string>())("iou-type", "bbox, segm or both",
                                     cxxopts::value<std::string>()->default_value("bbox"))(
      "results-file", "Also write the stats and per-category AP here (json)", cxxopts::value<std::string>())(
      "threads", "Threads (0: all cores)", cxxopts::value<int>()->default_value("0"))("h,help", "Show this help");
  auto parsed = parse_command(opts, "evaluate-coco", args);
  if (!parsed) return 0;
  auto& r = *parsed;
  if (!r.count("gt") || !r.count("results")) throw UserError("evaluate-coco needs --gt FILE.json and --results FILE.json");
  const std::string iou = r["iou-type"].as<std::string>();
  if (iou != "bbox" && iou != "segm" && iou != "both")
    throw UserError(fmt::format("--iou-type '{}': expected bbox, segm or both", iou));
  if (r["threads"].as<int>() < 0) throw UserError("--threads: expected 0 or more");
  const std::string gt_path = r["gt"].as<std::string>(), dt_path = r["results"].as<std::string>();
  if (r.count("results-file")) {  // refused before the evaluation, not after it
    const std::string path = r["results-file"].as<std::string>();
    std::error_code ec;
    const bool existed = std::filesystem::exists(path, ec);
    const bool ok = bool(std::ofstream(path, std::ios::app));
    if (!existed) std::filesystem::remove(path, ec);  // the probe leaves nothing behind
    if (!ok) throw UserError(fmt::format("--results-file '{}': cannot write it", path));
  }
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  coco::Dataset gt, dt;
  try {
    auto t0 = Clock::now();
    coco::LoadOptions lo;
    lo.keep_degenerate_boxes = true;  // pycocotools keeps them in the ground truth
    gt = coco::load_dataset(gt_path, lo);
    std::printf("Loaded %zu images, %zu annotations, %zu categories from %s (%.2fs)\n", gt.images.size(),
                gt.annotations.size(), gt.categories.size(), gt_path.c_str(), secs(t0));
    for (auto& w : gt.warnings) std::fprintf(stderr, "imgtrain: warning: %s\n", w.c_str());
    t0 = Clock::now();
    dt = coco::load_results(gt, dt_path);
    std::printf("Loaded %zu detections from %s (%.2fs)\n", dt.annotations.size(), dt_path.c_str(), secs(t0));
    for (auto& w : dt.warnings) std::fprintf(stderr, "imgtrain: warning: %s\n", w.c_str());
  } catch (const std::exception& e) {  // the readers' errors name the file and the problem
    throw UserError(e.what());
  }
  if (iou != "bbox") {
    size_t no_mask = 0;
    for (auto& a : gt.annotations) no_mask += a.seg == coco::SegKind::none;
    if (no_mask)
      std::fprintf(stderr,
                   "imgtrain: warning: %zu ground-truth annotation(s) have no usable segmentation: segm scores them as "
                   "empty masks (pycocotools stops with a KeyError on such a file)\n",
                   no_mask);
  }
  nlohmann::ordered_json out;
  for (const std::string type : {"bbox", "segm"}) {
    if (iou != "both" && iou != type) continue;
    coco::EvalParams p;
    p.iou_type = type == "bbox" ? coco::IouType::bbox : coco::IouType::segm;
    p.threads = size_t(r["threads"].as<int>());
    std::printf("Evaluate annotation type *%s*\n", type.c_str());
    const auto t0 = Clock::now();
    const auto res = coco::evaluate(gt, dt, p);
    const double eval_s = secs(t0);
    std::printf("DONE (t=%.2fs).\n%s", eval_s, coco::format_summary(res).c_str());
    auto& o = out[type];
    o["eval_seconds"] = eval_s;  // evaluate + accumulate + summarize, the json reading excluded
    for (int i = 0; i < 12; ++i) o["stats"][coco::stat_names()[size_t(i)]] = res.stats[size_t(i)];
    for (size_t k = 0; k < res.cat_ids.size(); ++k) {
      const auto* c = gt.category(res.cat_ids[k]);
      const double ap = res.per_category_ap[k];
      o["per_category_ap"][c ? c->name : std::to_string(res.cat_ids[k])] =
          std::isnan(ap) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(ap);
    }
  }
  if (r.count("results-file")) {
    const std::string path = r["results-file"].as<std::string>();
    std::ofstream f(path);
    f << out.dump(2) << "\n";
    if (!f) throw UserError(fmt::format("--results-file '{}': cannot write it", path));
  }
  return 0;
}

// What a COCO annotation file holds and what training would use of it: counts, the reader's
// warnings, the training view (torchvision's filtering) and, with --images, missing files.
int coco_info(const std::vector<std::string>& args) {
  cxxopts::Options opts("imgtrain coco-info", "Check a COCO instances json (and its images) before training on it");
  opts.add_options()("ann", "instances_*.json", cxxopts::value<std::string>())(
      "images", "The image folder: check that every file it names exists", cxxopts::value<std::string>())(
      "h,help", "Show this help");
  auto parsed = parse_command(opts, "coco-info", args);
  if (!parsed) return 0;
  auto& r = *parsed;
  if (!r.count("ann")) throw UserError("coco-info needs --ann FILE.json");
  const std::string ann = r["ann"].as<std::string>(), images = r.count("images") ? r["images"].as<std::string>() : "";
  std::error_code ec;
  if (!images.empty() && !std::filesystem::is_directory(images, ec))
    throw UserError(fmt::format("--images '{}': {}", images,
                                std::filesystem::exists(images, ec) ? "a file, not the image folder" : "no such folder"));
  const auto t0 = std::chrono::steady_clock::now();
  data::CocoDetection ds(images, ann, {.train = true, .contiguous_labels = true, .masks = false});
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& gt = ds.coco();
  size_t crowd = 0;
  for (auto& a : gt.annotations) crowd += a.iscrowd;
  std::printf("Loaded %zu images, %zu annotations (%zu crowd), %zu categories from %s (%.2fs)\n", gt.images.size(),
              gt.annotations.size(), crowd, gt.categories.size(), ann.c_str(), load_s);
  for (auto& w : ds.warnings()) std::fprintf(stderr, "imgtrain: warning: %s\n", w.c_str());
  size_t boxes = 0;
  for (size_t i = 0; i < ds.size(); ++i) boxes += size_t(ds.target(i).boxes.size(0));
  std::printf("Training view: %zu images (%zu left out), %zu boxes, %lld classes with the background\n", ds.size(),
              ds.removed_images(), boxes, (long long)ds.num_classes());
  if (!images.empty()) {
    std::vector<std::string> missing;
    for (auto& im : gt.images)
      if (!std::filesystem::is_regular_file(std::filesystem::path(images) / im.file_name, ec)) missing.push_back(im.file_name);
    if (const size_t n = missing.size()) {
      missing.resize(std::min<size_t>(n, 5));
      std::fprintf(stderr, "imgtrain: error: %zu of %zu images are missing from %s (e.g. %s)\n", n,
                   gt.images.size(), images.c_str(), fmt::format("{}", fmt::join(missing, ", ")).c_str());
      return 1;
    }
    std::printf("All %zu image files are present in %s\n", gt.images.size(), images.c_str());
  }
  return 0;
}

}  // namespace imgtrain::app

// MKL's question, answered by the executable (see imgtrain::app::mkl_dispatch).
extern "C" __attribute__((visibility("default"), used)) int mkl_serv_intel_cpu_true() {
  imgtrain::app::g_mkl_vendor_asks.fetch_add(1);
  return imgtrain::app::mkl_dispatch().intel_paths ? 1 : 0;
}
