// The COCO annotation reader and, on what it accepted, the results reader and every
// annotation's mask (polygons, RLE, crowd counts) as the evaluator builds it. Input: the gt json,
// optionally followed by a NUL byte and a results json read against it. The reader is plain
// C++ and reports an unusable file as std::runtime_error (coco.h); anything else is a finding.
#include "data/coco.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace coco = imgtrain::coco;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string text = input.substr(0, nul);
  try {
    const auto gt = coco::parse_dataset(text, "fuzz.json");
    for (auto& a : gt.annotations)
      if (const auto* im = gt.image(a.image_id); im && uint64_t(im->height) * im->width < (1u << 20))
        coco::ann_to_rle(a, im->height, im->width);
    if (nul != std::string::npos) {
      const auto res = coco::parse_results(gt, input.substr(nul + 1), "fuzz-results.json");
      for (auto& a : res.annotations)
        if (const auto* im = res.image(a.image_id); im && uint64_t(im->height) * im->width < (1u << 20))
          coco::ann_to_rle(a, im->height, im->width);
    }
  } catch (const std::runtime_error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz finding: not a reader error: %s\n", e.what());
    std::abort();
  }
  return 0;
}
