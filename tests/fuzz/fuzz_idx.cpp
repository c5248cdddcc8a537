// The IDX reader (Fashion-MNIST files): gzip framing, magic, element type, dimensions.
#include "fuzz_util.h"

#include <zlib.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Both framings the reader meets: the bytes as they are (gzopen reads plain files too) and
  // gzip-compressed, so the header checks are reached on most inputs.
  const std::string plain = imgtrain::fuzz::as_file(data, size, ".idx");
  imgtrain::fuzz::expect_user_errors_only([&] { imgtrain::data::read_idx(plain); });
  const std::string gz = imgtrain::fuzz::scratch_path(".idx.gz");
  if (gzFile f = gzopen(gz.c_str(), "wb1")) {
    if (size) gzwrite(f, data, unsigned(size));
    gzclose(f);
  }
  imgtrain::fuzz::expect_user_errors_only([&] { imgtrain::data::read_idx(gz); });
  return 0;
}
