// The safetensors reader (checkpoints, weights): header JSON, dtypes, shapes, offsets.
#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  imgtrain::fuzz::expect_user_errors_only([&] { imgtrain::io::parse_safetensors(bytes, "fuzz.safetensors"); });
  return 0;
}
