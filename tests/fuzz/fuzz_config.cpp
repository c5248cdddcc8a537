// The YAML config path (-c FILE): yaml-cpp's parse, keys and values checked against the flag
// schema, timm args.yaml keys, Detectron2 config files, then the command line's own checks.
#include "cli/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = imgtrain::fuzz::as_file(data, size, ".yaml");
  imgtrain::fuzz::expect_user_errors_only([&] {
    imgtrain::cli::parse(imgtrain::cli::Command::Train, {"-c", path});
  });
  return 0;
}
