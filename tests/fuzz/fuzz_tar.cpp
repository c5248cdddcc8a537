// The tar shard index (ustar / GNU base-256 sizes / long names / pax records) and, for a shard
// it accepts, the dataset built over it (keys, .cls labels) and reading each sample's bytes.
#include "data/shards.h"
#include "fuzz_util.h"

#include <filesystem>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace fs = std::filesystem;
  static const std::string dir = [] {
    const std::string d = imgtrain::fuzz::scratch_path(".shards");
    fs::create_directories(d);
    return d;
  }();
  const std::string path = dir + "/shard-000000.tar";
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  imgtrain::fuzz::expect_user_errors_only([&] {
    std::string error;
    imgtrain::data::list_tar(path, &error);
    const auto ds = imgtrain::data::open_shards(dir, 1);
    for (size_t i = 0; i < ds->size() && i < 8; ++i) {
      std::string bytes;
      ds->encoded(i, bytes);
      ds->label(i);
    }
  });
  return 0;
}
