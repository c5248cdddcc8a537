// Image headers and decoding (JPEG, PNG, GIF, BMP, WebP): the size from the header, the
// decompression-bomb limit, full and DCT-scaled JPEG decodes of a region.
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace d = imgtrain::data;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  imgtrain::fuzz::expect_user_errors_only([&] {
    const auto hs = d::header_size(bytes);
    // stay clear of the bomb limit's legitimate large allocations: the harness is about parsing
    if (hs && int64_t(hs->width) * hs->height > (int64_t(1) << 22)) return;
    const cv::Mat m = d::decode_image(bytes, "fuzz");
    if (d::is_jpeg(bytes) && !m.empty()) {
      d::decode_jpeg(bytes, 2, "fuzz");
      d::decode_jpeg_region(bytes, 1, cv::Rect(m.cols / 4, m.rows / 4, std::max(1, m.cols / 2), std::max(1, m.rows / 2)),
                            "fuzz");
    }
  });
  return 0;
}
