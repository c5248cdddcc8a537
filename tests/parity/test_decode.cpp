// Unusual files decoded by imgtrain against PIL's decode of the same files (make_decode_refs.py).
#include "data/dataset.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

using namespace imgtrain;

TEST_CASE("unusual image files decode as PIL decodes them", "[parity][decode]") {
  const std::string dir = std::string(IMGTRAIN_PARITY_DIR) + "/decode";
  auto refs = io::load_safetensors(dir + "/decode_refs.safetensors");
  // Max |ours - PIL| allowed per file: all exact. JPEG: both use libjpeg-turbo's accurate IDCT and
  // the same upsampling; CMYK is converted with PIL's formula; PNG, BMP and lossless WebP are
  // lossless. 16-bit grayscale PNG: the reference is v / 257 rounded (PIL's convert clips at 255
  // instead; imgtrain scales on purpose); 16-bit RGB PNG: PIL's, each sample's high byte.
  const std::map<std::string, double> tol = {
      {"baseline.jpg", 0},  {"progressive.jpg", 0}, {"cmyk.jpg", 0},    {"gray.jpg", 0},
      {"exif_rotated.jpg", 0}, {"alpha2.png", 0},   {"palette.png", 0}, {"gray.png", 0},
      {"plain.bmp", 0},     {"lossless.webp", 0},   {"gray16.png", 0}, {"frames.gif", 0},
      {"rgb16.png", 0}};
  for (auto& [name, max_diff] : tol) {
    INFO(name);
    const at::Tensor* ref = refs.find(name);
    REQUIRE(ref != nullptr);
    cv::Mat img = data::decode_image(test::read_file(dir + "/" + name), name);
    auto ours = torch::from_blob(img.data, {img.rows, img.cols, img.channels()}, torch::kUInt8).clone();
    auto want = ref->dim() == 2 ? ref->unsqueeze(2) : *ref;
    REQUIRE(ours.sizes() == want.sizes());  // EXIF orientation is not applied, as PIL's open()
    CHECK((ours.to(torch::kInt) - want.to(torch::kInt)).abs().max().item<int>() <= max_diff);
  }
}
