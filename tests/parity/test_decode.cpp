// Unusual files decoded by imgtrain against PIL's decode of the same files (make_decode_refs.py).
#include "data/dataset.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <sstream>
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

TEST_CASE("ImageFolder finds timm's images, classes and order", "[parity][decode][folder]") {
  // timm's find_images_and_targets on the same split (make_decode_refs.py): the extensions it reads,
  // its class indices (natural_key of the names) and its sample order (natural_key of the paths).
  const std::string dir = std::string(IMGTRAIN_PARITY_DIR) + "/decode";
  std::istringstream refs(test::read_file(dir + "/folder_refs.txt"));
  std::string classes_line, line;
  REQUIRE(std::getline(refs, classes_line));
  std::vector<std::string> want_classes, want, ours;
  std::istringstream cl(classes_line);
  for (std::string c; std::getline(cl, c, '\t');) want_classes.push_back(c);
  while (std::getline(refs, line)) want.push_back(line);
  REQUIRE(want.size() == 11);
  std::shared_ptr<data::Dataset> ds;
  test::TempDir tmp("folder_parity");
  const auto err = test::stderr_of([&] { ds = data::create_dataset("", dir + "/folder", "train"); }, tmp);
  REQUIRE(ds);
  CHECK(ds->class_names() == want_classes);
  const std::filesystem::path split = dir + "/folder/train";
  for (size_t i = 0; i < ds->size(); ++i)
    ours.push_back(std::filesystem::path(ds->describe(i)).lexically_relative(split).string() + "\t" +
                   std::to_string(ds->label(i)));
  CHECK(ours == want);
  CHECK_THAT(err, Catch::Contains("4 image file(s) with extensions timm's ImageFolder does not read were skipped "
                                  "(.bmp 1, .gif 1, .webp 2)"));
}
