// The restricted torch.save reader (.pth): zip / zip64 / legacy containers and the pickle VM.
#include "fuzz_util.h"
#include "io/torch_pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  imgtrain::fuzz::expect_user_errors_only([&] { imgtrain::io::parse_torch_save(bytes, "fuzz.pth"); });
  return 0;
}
