// One function per subcommand; each returns the exit code.
#pragma once
#include <string>
#include <vector>

namespace imgtrain::app {
int train(const std::vector<std::string>& args);
int validate(const std::vector<std::string>& args);
int benchmark(const std::vector<std::string>& args);
int models(const std::vector<std::string>& args);
int export_weights(const std::vector<std::string>& args);
int pack(const std::vector<std::string>& args);
int plot(const std::vector<std::string>& args);
int evaluate_coco(const std::vector<std::string>& args);
int coco_info(const std::vector<std::string>& args);
int version(const char* version);

// Which GEMM kernels MKL picks in this process: the CPU's vendor, whether MKL's Intel code paths are
// on (always on Intel's CPUs; on AMD's unless IMGTRAIN_MKL_INTEL_PATHS=0) and how many times MKL
// has asked (0: no MKL, or no BLAS call yet).
struct MklDispatch {
  std::string vendor;
  bool genuine_intel = false;
  bool intel_paths = false;
  int asked = 0;
};
MklDispatch mkl_dispatch();
}  // namespace imgtrain::app
