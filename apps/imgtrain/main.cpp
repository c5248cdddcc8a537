// imgtrain: timm's train.py / validate.py as one native binary. Parses the subcommand and
// dispatches; user errors become one line on stderr and exit code 2.
#include "apps/imgtrain/commands.h"
#include "core/error.h"
#include "dist/dist.h"

#include <c10/util/Exception.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#ifndef IMGTRAIN_VERSION
#define IMGTRAIN_VERSION "0.0.0"
#endif

namespace {
const char* kUsage =
    "usage: imgtrain <command> [flags]\n"
    "\n"
    "commands:\n"
    "  train       train a model (timm train.py flags; -c config.yaml)\n"
    "  validate    evaluate a checkpoint (timm validate.py flags)\n"
    "  benchmark   inference/train throughput on synthetic data (timm benchmark.py flags)\n"
    "  models      list models: imgtrain models ['resnet*'] [--verbose]\n"
    "  export      write a checkpoint's weights as a plain timm state dict (safetensors)\n"
    "  pack        convert an ImageFolder into tar shards (WebDataset layout)\n"
    "  plot        draw runs' training curves into one picture: imgtrain plot RUN_DIR... [-o curves.png]\n"
    "  evaluate-coco  score COCO detection results (pycocotools' COCOeval numbers, faster)\n"
    "  coco-info   check a COCO instances json and its images before training on it\n"
    "\n"
    "imgtrain <command> --help shows the command's flags; imgtrain --version the version.\n";

// One line "imgtrain: error: ..." and exit status 2. A worker of imgtrain's own launcher hands the
// line to it (one line for all workers).
int user_error(const std::string& what) {
  const std::string line = "imgtrain: error: " + what + "\n";
  if (const char* fd = std::getenv("IMGTRAIN_ERROR_FD"); fd && line.size() <= 4096) {
    const int n = std::atoi(fd);
    if (n > 2 && write(n, line.data(), line.size()) == ssize_t(line.size())) return 2;
  }
  std::fputs(line.c_str(), stderr);
  return 2;
}
}

// glibc returns freed memory at the top of the heap to the kernel (trim) and serves big blocks
// with fresh mmap()s, so every multi-megabyte activation of every step gets new pages that the
// kernel must fault in and zero-fill. Serving blocks up to 32 MiB from the heap and not trimming
// it turns that into plain reuse (measurements in docs/performance.md); the process just does not
// shrink after its peak. IMGTRAIN_MALLOC_TUNE=0 keeps glibc's defaults.
void tune_malloc() {
  if (const char* v = std::getenv("IMGTRAIN_MALLOC_TUNE"); v && std::strcmp(v, "0") == 0) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: blocks below 32 MiB come from the heap
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int main(int argc, char** argv) {
  tune_malloc();
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (cmd == "--version" || cmd == "version") return imgtrain::app::version(IMGTRAIN_VERSION);
    if (cmd == "train") return imgtrain::app::train(args);
    if (cmd == "validate") return imgtrain::app::validate(args);
    if (cmd == "benchmark") return imgtrain::app::benchmark(args);
    if (cmd == "models") return imgtrain::app::models(args);
    if (cmd == "export") return imgtrain::app::export_weights(args);
    if (cmd == "pack") return imgtrain::app::pack(args);
    if (cmd == "plot") return imgtrain::app::plot(args);
    if (cmd == "evaluate-coco") return imgtrain::app::evaluate_coco(args);
    if (cmd == "coco-info") return imgtrain::app::coco_info(args);
    std::fprintf(stderr,
                 "imgtrain: error: unknown command '%s' (expected train, validate, benchmark, models, export, pack, "
                 "plot, evaluate-coco or coco-info)\n",
                 cmd.c_str());
    return 2;
  } catch (const imgtrain::UserError& e) {
    return user_error(e.what());
  } catch (const imgtrain::dist::PeerLost& e) {
    std::fprintf(stderr, "imgtrain: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    // torch's BatchNorm refuses a single value per channel in training (batch of 1 reaching 1x1
    // maps): the user's choice of -b / --img-size, not a bug
    if (std::string(e.what_without_backtrace()).find("Expected more than 1 value per channel when training") !=
        std::string::npos)
      return user_error(
          "a BatchNorm layer got one value per channel in training (a batch of 1 reaching 1x1 feature maps): use "
          "-b/--batch-size of at least 2 per process, or a larger --img-size");
    std::fprintf(stderr, "imgtrain: internal error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "imgtrain: internal error: %s\n", e.what());
    return 1;
  }
}
