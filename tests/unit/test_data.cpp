#include "core/error.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/mixup.h"
#include "data/normalize.h"
#include "data/shards.h"
#include "data/transforms.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <fstream>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <zlib.h>
#include <opencv2/imgproc.hpp>
#include <torch/torch.h>
#include <zlib.h>

#include <map>

using namespace imgtrain;
using namespace imgtrain::data;

namespace {

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  gzwrite(f, bytes.data(), unsigned(bytes.size()));
  gzclose(f);
}

std::string idx_bytes(std::vector<uint32_t> dims, size_t data_bytes, uint8_t type = 0x08) {
  std::string s = {0, 0, char(type), char(dims.size())};
  for (auto d : dims)
    for (int sh = 24; sh >= 0; sh -= 8) s.push_back(char((d >> sh) & 0xff));
  for (size_t i = 0; i < data_bytes; ++i) s.push_back(char(i % 251));
  return s;
}

std::string user_error(const std::function<void()>& f) { return test::error_text<UserError>(f); }

// A photo-like test image: smooth gradients plus a few shapes.
cv::Mat make_image(int h, int w, int seed) {
  cv::Mat m(h, w, CV_8UC3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      m.at<cv::Vec3b>(y, x) = {uint8_t((x * 255) / w), uint8_t((y * 255) / h), uint8_t((x + y + seed * 37) % 256)};
  cv::circle(m, {w / 2, h / 2}, std::min(h, w) / 4, cv::Scalar(double(uint8_t(seed * 50)), 200, 30), -1);
  return m;
}

std::string encode(const cv::Mat& rgb, const std::string& ext) {
  cv::Mat bgr;
  if (rgb.channels() == 3) cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
  else bgr = rgb;
  std::vector<uchar> buf;
  cv::imencode(ext, bgr, buf, {cv::IMWRITE_JPEG_QUALITY, 95});
  return std::string(buf.begin(), buf.end());
}

}  // namespace

TEST_CASE("IDX reader reads arrays and rejects malformed files", "[data][idx][fault]") {
  test::TempDir d("idx");
  write_gz(d / "ok.gz", idx_bytes({3, 2, 2}, 12));
  auto a = read_idx(d / "ok.gz");
  CHECK(a.dims == std::vector<int64_t>{3, 2, 2});
  REQUIRE(a.data.size() == 12);
  CHECK(a.data[11] == 11);

  write_gz(d / "magic.gz", "\x01\x02\x08\x01" + std::string(8, '\0'));
  CHECK_THAT(user_error([&] { read_idx(d / "magic.gz"); }), Catch::Contains("wrong magic number"));
  write_gz(d / "short.gz", idx_bytes({10, 28, 28}, 100));
  CHECK_THAT(user_error([&] { read_idx(d / "short.gz"); }), Catch::Contains("truncated") && Catch::Contains("short.gz"));
  write_gz(d / "type.gz", idx_bytes({2}, 8, 0x0D));
  CHECK_THAT(user_error([&] { read_idx(d / "type.gz"); }), Catch::Contains("element type 0x0d"));
  // A gzip stream cut in the middle.
  write_gz(d / "full.gz", idx_bytes({1000}, 1000));
  auto bytes = test::read_file(d / "full.gz");
  test::write_file(d / "cut.gz", bytes.substr(0, bytes.size() / 2));
  CHECK_THAT(user_error([&] { read_idx(d / "cut.gz"); }), Catch::Contains("cut.gz"));
  CHECK_THAT(user_error([&] { read_idx(d / "nope.gz"); }), Catch::Contains("cannot open"));
  // hostile headers: a zero dimension, a product that would wrap 64 bits, one past 16 GiB
  write_gz(d / "zero.gz", idx_bytes({0, 28, 28}, 0));
  CHECK_THAT(user_error([&] { read_idx(d / "zero.gz"); }), Catch::Contains("dimension 0 is 0"));
  write_gz(d / "wrap.gz", idx_bytes({0x80000000u, 0x80000000u, 4}, 0));
  CHECK_THAT(user_error([&] { read_idx(d / "wrap.gz"); }), Catch::Contains("declare more than 17179869184 bytes"));
  write_gz(d / "big.gz", idx_bytes({0x10000u, 0x10000u, 5}, 0));
  CHECK_THAT(user_error([&] { read_idx(d / "big.gz"); }), Catch::Contains("declare more than"));
  // a gzip bomb: 4 declared bytes, then 64 MiB of zeros that inflate from a few KB; only the
  // declared bytes are read
  std::string bomb = idx_bytes({2, 2}, 4);
  bomb.append(64u << 20, '\0');
  write_gz(d / "bomb.gz", bomb);
  const auto b = read_idx(d / "bomb.gz");
  CHECK(b.data.size() == 4);
}

TEST_CASE("Fashion-MNIST from Debian's package", "[data][idx]") {
  if (!std::filesystem::exists(std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz")) {
    WARN("dataset-fashion-mnist is not installed");
    return;
  }
  auto ds = create_dataset("fashion-mnist", "", "validation");
  REQUIRE(ds->size() == 10000);
  CHECK(ds->num_classes() == 10);
  auto img = ds->image(0);
  CHECK(img.rows == 28);
  CHECK(img.cols == 28);
  CHECK(img.channels() == 1);
  CHECK(ds->label(0) == 9);  // the first test image is an ankle boot
  CHECK(create_dataset("fashion-mnist", "", "train")->size() == 60000);
  CHECK_THAT(user_error([&] { create_dataset("fashion-mnist", "", "holdout"); }), Catch::Contains("holdout"));
}

TEST_CASE("ImageFolder scans classes, nested files and extensions", "[data][folder]") {
  test::TempDir d("folder");
  auto png = encode(make_image(20, 30, 1), ".png");
  test::write_file(d / "train/zebra/a.png", png);
  test::write_file(d / "train/apple/deep/nested/b.PNG", png);
  test::write_file(d / "train/apple/c.JPG", encode(make_image(20, 30, 2), ".jpg"));
  test::write_file(d / "train/apple/notes.txt", "not an image");
  test::write_file(d / "train/mango/d.bmp", encode(make_image(8, 8, 3), ".bmp"));
  test::write_file(d / "train/zebra/e.webp", encode(make_image(8, 8, 4), ".webp"));
  test::write_file(d / "train/loose.jpg", encode(make_image(8, 8, 5), ".jpg"));
  std::shared_ptr<Dataset> ds;
  const auto err = test::stderr_of([&] { ds = create_dataset("", d.path.string(), "train"); }, d);
  // timm's extensions only (.png, .jpg, .jpeg, any case): mango's .bmp leaves it without images,
  // so it is no class; what is skipped, and where imgtrain's labels are not timm's, is said
  REQUIRE(ds);
  CHECK(ds->class_names() == std::vector<std::string>{"apple", "zebra"});
  REQUIRE(ds->size() == 3);
  std::vector<int64_t> labels;
  for (size_t i = 0; i < ds->size(); ++i) labels.push_back(ds->label(i));
  CHECK(labels == std::vector<int64_t>{0, 0, 1});
  CHECK(ds->describe(0) == (d / "train/apple/c.JPG"));  // natural order of the paths: "c.jpg" < "deep/..."
  CHECK(ds->image(2).channels() == 3);
  CHECK_THAT(err, Catch::Contains("2 image file(s) with extensions timm's ImageFolder does not read were skipped "
                                  "(.bmp 1, .webp 1); --input-key '.png;.jpg;.jpeg;.bmp;.webp' reads them too"));
  CHECK_THAT(err, Catch::Contains("1 subfolder(s) hold no images (.png, .jpg, .jpeg) and are not classes, as in timm "
                                  "(first: mango)"));
  CHECK_THAT(err, Catch::Contains("1 image(s) directly in the split folder belong to no class folder and were "
                                  "skipped (first: loose.jpg)"));
  CHECK_THAT(err, Catch::Contains("1 image(s) lie in sub-folders of their class folder") &&
                      Catch::Contains("deep/nested/b.PNG"));
  CHECK(std::count(err.begin(), err.end(), '\n') == 4);
  // --input-key (timm's): the extensions read, ';'-separated, compared lower-cased
  auto wide = create_dataset("", d.path.string(), "train", {".png;.JPG;.bmp;.webp"});
  CHECK(wide->class_names() == std::vector<std::string>{"apple", "mango", "zebra"});
  CHECK(wide->size() == 5);
  for (auto bad : {"jpg", ".png;", ";.png", "."})
    CHECK_THAT(user_error([&] { create_dataset("", d.path.string(), "train", {bad}); }),
               Catch::Contains("--input-key") && Catch::Contains("each with its dot"));
  CHECK_THAT(user_error([&] { create_dataset("fashion-mnist", "", "train", {".png"}); }),
             Catch::Contains("--input-key") && Catch::Contains("no effect with --dataset fashion-mnist"));
  CHECK_THAT(user_error([&] { create_dataset("", d.path.string(), "train", {".gif"}); }),
             Catch::Contains("no images (.gif) in class subfolders"));
  // a subfolder without images is not a class (timm labels images, not folders), with a warning
  std::filesystem::create_directories(d / "train/aardvark");
  std::filesystem::create_directories(d / "train/kiwi/sub");
  test::write_file(d / "train/kiwi/readme.txt", "no images here");
  std::filesystem::remove(d / "train/loose.jpg");
  std::shared_ptr<Dataset> with_empty;
  const auto err2 = test::stderr_of([&] { with_empty = create_dataset("", d.path.string(), "train", {".png;.jpg"}); }, d);
  REQUIRE(with_empty);
  CHECK(with_empty->class_names() == std::vector<std::string>{"apple", "zebra"});
  std::vector<int64_t> labels2;
  for (size_t i = 0; i < with_empty->size(); ++i) labels2.push_back(with_empty->label(i));
  CHECK(labels2 == labels);
  CHECK_THAT(err2, Catch::Contains("3 subfolder(s) hold no images (.png, .jpg) and are not classes, as in timm "
                                   "(first: aardvark)"));
  // an image added to an empty folder makes it a class again
  test::write_file(d / "train/aardvark/e.png", png);
  CHECK(create_dataset("", d.path.string(), "train")->class_names() ==
        std::vector<std::string>{"aardvark", "apple", "zebra"});
}

TEST_CASE("a class map file (--class-map, timm's .txt) gives the indices, other folders are skipped", "[data][folder]") {
  test::TempDir d("classmap");
  auto png = encode(make_image(8, 8, 1), ".png");
  for (auto f : {"cat/1.png", "cat/2.png", "dog/3.png", "emu/4.png", "fox/5.png"})
    test::write_file(d / (std::string("val/") + f), png);
  // timm's load_class_map: a line's number is its index (blank lines count), names stripped
  test::write_file(d / "map.txt", "\xEF\xBB\xBF fox \r\n\ndog\ncat\nyak\n");
  std::shared_ptr<Dataset> ds;
  const auto err = test::stderr_of(
      [&] { ds = create_dataset("", d.path.string(), "validation", {"", d / "map.txt"}); }, d);
  REQUIRE(ds);
  CHECK(ds->class_names() == std::vector<std::string>{"fox", "", "dog", "cat", "yak"});
  CHECK(ds->num_classes() == 5);
  std::vector<std::string> got;
  for (size_t i = 0; i < ds->size(); ++i)
    got.push_back(std::filesystem::path(ds->describe(i)).filename().string() + " " + std::to_string(ds->label(i)));
  CHECK(got == std::vector<std::string>{"1.png 3", "2.png 3", "3.png 2", "5.png 0"});
  CHECK_THAT(err, Catch::Contains("1 image(s) in 1 class folder(s) that --class-map") && Catch::Contains("(first: emu)"));
  // found in the split folder too, as timm looks for it under the dataset root
  test::write_file(d / "val/names.txt", "emu\n");
  CHECK(create_dataset("", d.path.string(), "validation", {"", "names.txt"})->size() == 1);
  auto msg = [&](const std::string& map) {
    return user_error([&] { create_dataset("", d.path.string(), "validation", {"", map}); });
  };
  CHECK_THAT(msg("nope.txt"), Catch::Contains("--class-map 'nope.txt': no such file"));
  test::write_file(d / "map.pkl", "\x80\x04}q\x00.");
  CHECK_THAT(msg(d / "map.pkl"), Catch::Contains("not pickles"));
  test::write_file(d / "map.csv", "cat,0\n");
  CHECK_THAT(msg(d / "map.csv"), Catch::Contains("expected a .txt file"));
  test::write_file(d / "twice.txt", "cat\ndog\ncat\n");
  CHECK_THAT(msg(d / "twice.txt"), Catch::Contains("class 'cat' is on lines 1 and 3"));
  test::write_file(d / "other.txt", "yak\nzebu\n");
  CHECK_THAT(msg(d / "other.txt"), Catch::Contains("names none of the 4 class folder(s)"));
  CHECK_THAT(user_error([&] { create_dataset("fashion-mnist", "", "train", {"", "map.txt"}); }),
             Catch::Contains("--class-map") && Catch::Contains("no effect with --dataset fashion-mnist"));
}

TEST_CASE("ImageFolder orders classes and files as timm's natural_key does", "[data][folder]") {
  // timm sorts class names and image paths by natural_key: lower-cased, digit runs as numbers
  CHECK(natural_less("class2", "class10"));
  CHECK(!natural_less("class10", "class2"));
  CHECK(natural_less("apple", "Banana"));  // case folded: byte order would put 'B' first
  CHECK(natural_less("a1", "a01b"));       // ['a', 1, ''] < ['a', 1, 'b']
  CHECK(natural_less("ab", "ab1"));        // ['ab'] is the shorter list
  CHECK(natural_less("a1", "a/x"));        // ['a', 1, ''] < ['a/x']: the text 'a' is a prefix of 'a/x'
  CHECK(natural_less("img9.jpg", "img10.jpg"));
  CHECK(natural_less("n01440764", "n01443537"));
  CHECK(natural_less("x0099999999999999999999", "x100000000000000000000000"));  // longer than 64 bits
  // ties in the key (case, leading zeros) fall back to byte order, so the order never varies
  CHECK(natural_less("Cat", "cat"));
  CHECK(natural_less("a007", "a7"));
  CHECK(!natural_less("a7", "a7"));
  test::TempDir d("natural");
  auto png = encode(make_image(8, 8, 1), ".png");
  for (auto f : {"class10/img10.png", "class10/img9.png", "class2/b.png", "Class1/a.png"})
    test::write_file(d / (std::string("train/") + f), png);
  auto ds = create_dataset("", d.path.string(), "train");
  CHECK(ds->class_names() == std::vector<std::string>{"Class1", "class2", "class10"});
  std::vector<std::string> names;
  for (size_t i = 0; i < ds->size(); ++i)
    names.push_back(std::filesystem::path(ds->describe(i)).lexically_relative(d / "train").string() + " " +
                    std::to_string(ds->label(i)));
  CHECK(names == std::vector<std::string>{"Class1/a.png 0", "class2/b.png 1", "class10/img9.png 2",
                                          "class10/img10.png 2"});
}

TEST_CASE("ImageFolder follows folder links once: loops and links into other classes are skipped", "[data][folder][fault]") {
  test::TempDir d("links");
  auto png = encode(make_image(8, 8, 1), ".png");
  for (auto f : {"a/1.png", "a/2.png", "a/sub/3.png", "b/4.png", "b/5.png"}) test::write_file(d / (std::string("train/") + f), png);
  test::write_file(d / "elsewhere/6.png", png);
  namespace fs = std::filesystem;
  fs::create_directory_symlink(".", d / "train/a/loop");        // a loop onto itself
  fs::create_directory_symlink("../..", d / "train/a/sub/up");  // back up to the split
  fs::create_directory_symlink("../a", d / "train/b/peer");     // into another class
  fs::create_directory_symlink(d / "elsewhere", d / "train/b/more");  // a real extra folder
  fs::create_symlink(d / "gone.png", d / "train/b/dangling.png");    // a link to nothing: counted
  std::shared_ptr<Dataset> ds;
  const auto err = test::stderr_of([&] { ds = create_dataset("", d.path.string(), "train"); }, d);
  CHECK_THAT(err, Catch::Contains("1 link(s) lead to no file and were skipped (first: ") &&
                      Catch::Contains("train/b/dangling.png)"));
  CHECK_THAT(err, Catch::Contains("3 linked folder(s) lead back into the split or into another class"));
  REQUIRE(ds->size() == 6);  // 16 images became 7,216 samples before
  std::map<std::string, int64_t> label_of;
  for (size_t i = 0; i < ds->size(); ++i) label_of[fs::path(ds->describe(i)).filename().string()] = ds->label(i);
  CHECK(label_of == std::map<std::string, int64_t>{{"1.png", 0}, {"2.png", 0}, {"3.png", 0}, {"4.png", 1},
                                                   {"5.png", 1}, {"6.png", 1}});
}

TEST_CASE("decompression bombs are refused from the header, and resizes that would explode are skipped", "[data][decode][fault]") {
  // a GIF whose logical screen is 65535 x 65535 (37 bytes; 13 GB per loader thread before)
  std::string gif = std::string("GIF89a") + "\xff\xff\xff\xff" + std::string("\x00\x00\x00", 3) +
                    std::string("\x2c\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02\x44\x01\x00\x3b", 16);
  gif.resize(37, '\0');
  auto msg = [](const std::function<void()>& f) { return test::error_text<DecodeError>(f); };
  CHECK_THAT(msg([&] { decode_image(gif, "bomb.gif"); }),
             Catch::Contains("bomb.gif") && Catch::Contains("65535x65535") && Catch::Contains("above the limit"));
  // a PNG header claiming 20000 x 20000 is refused before libpng allocates anything
  auto png = encode(make_image(4, 4, 1), ".png");
  std::string big = png;
  const uint32_t side = 20000;
  for (int k = 0; k < 2; ++k)
    for (int b = 0; b < 4; ++b) big[size_t(16 + 4 * k + b)] = char((side >> (24 - 8 * b)) & 0xff);
  CHECK(header_size(big) == cv::Size(20000, 20000));
  CHECK_THAT(msg([&] { decode_image(big, "big.png"); }), Catch::Contains("above the limit"));
  // bytes of no format imgtrain reads never reach OpenCV's other decoders (GDCM's DICOM reader
  // aborted the process on this one, found by fuzz_image)
  const std::string dicom = std::string(128, 'y') + "DICM" + std::string("\x37\x01\x00\x2a\x00", 5) + std::string(40, 'y');
  CHECK_THAT(msg([&] { decode_image(dicom, "scan.dcm"); }), Catch::Contains("not an image"));
  // --max-image-pixels moves the limit (0: none), process-wide as PIL's Image.MAX_IMAGE_PIXELS
  set_max_image_pixels(16);
  CHECK(decode_image(png, "small.png").cols == 4);
  set_max_image_pixels(15);
  CHECK_THAT(msg([&] { decode_image(png, "small.png"); }),
             Catch::Contains("small.png") && Catch::Contains("above the limit of 15 (--max-image-pixels"));
  set_max_image_pixels(0);
  CHECK_NOTHROW(header_size(big));
  set_max_image_pixels(kDefaultMaxImagePixels);
  // the headers' sizes, without decoding
  const auto im = make_image(13, 21, 2);
  for (auto ext : {".png", ".jpg", ".bmp", ".webp"}) {
    INFO(ext);
    CHECK(header_size(encode(im, ext)) == cv::Size(21, 13));
  }
  CHECK(header_size(encode(im, ".tiff")) == cv::Size(21, 13));
  // a TIFF whose first image claims 30000 x 30000 (ImageWidth / ImageLength, LONG) is refused from
  // its header, in either byte order (OpenCV decoded a 1.3 MB one into 4 GB)
  for (bool little : {true, false}) {
    auto put16 = [&](std::string& b, int v) {
      little ? (b += char(v & 0xff), b += char(v >> 8)) : (b += char(v >> 8), b += char(v & 0xff));
    };
    auto put32 = [&](std::string& b, uint32_t v) {
      for (int k = 0; k < 4; ++k) b += char((little ? v >> (8 * k) : v >> (24 - 8 * k)) & 0xff);
    };
    std::string tiff = little ? std::string("II*\0", 4) : std::string("MM\0*", 4);
    put32(tiff, 8);
    put16(tiff, 2);
    for (int tag : {256, 257}) put16(tiff, tag), put16(tiff, 4), put32(tiff, 1), put32(tiff, 30000);
    put32(tiff, 0);
    CHECK(header_size(tiff) == cv::Size(30000, 30000));
    CHECK_THAT(msg([&] { decode_image(tiff, "bomb.tif"); }), Catch::Contains("bomb.tif") && Catch::Contains("above the limit"));
  }
  // a JPEG whose frame header claims 65500 x 65500 is refused on the training path too (which reads
  // the size to pick a DCT scale before decoding)
  {
    std::string jpg = encode(im, ".jpg");
    const auto sof = jpg.find("\xff\xc0");
    REQUIRE(sof != std::string::npos);
    for (size_t at : {sof + 5, sof + 7}) jpg[at] = char(0xff), jpg[at + 1] = char(0xdc);
    CHECK(header_size(jpg) == cv::Size(65500, 65500));
    for (bool train : {true, false}) {
      TransformConfig tc;
      tc.train = train;
      std::mt19937_64 rng(1);
      CHECK_THAT(msg([&] { apply_transform_encoded(jpg, tc, rng, "bomb.jpg"); }),
                 Catch::Contains("bomb.jpg") && Catch::Contains("65500x65500") && Catch::Contains("above the limit"));
    }
  }
  // a file larger than any image within the limit could be is not read into memory
  {
    test::TempDir d("bigfile");
    test::write_file(d / "huge.png", std::string(1100000, 'x'));
    std::string bytes;
    set_max_image_pixels(1000);  // 8 bytes a pixel + 1 MiB: 1,056,576 bytes
    CHECK_THAT(msg([&] { read_file_bytes(d / "huge.png", bytes); }),
               Catch::Contains("huge.png") && Catch::Contains("1100000 bytes") && Catch::Contains("--max-image-pixels"));
    CHECK(bytes.empty());
    set_max_image_pixels(0);
    CHECK_NOTHROW(read_file_bytes(d / "huge.png", bytes));
    CHECK(bytes.size() == 1100000);
    set_max_image_pixels(kDefaultMaxImagePixels);
  }
  // 1 x 20000 decodes, but its eval resize (shorter side 256) would be 256 x 5,120,000
  const auto line = encode(cv::Mat(1, 20000, CV_8UC3, cv::Scalar(1, 2, 3)), ".png");
  CHECK(decode_image(line, "line.png").cols == 20000);
  TransformConfig tc;
  std::mt19937_64 rng(1);
  CHECK_THAT(msg([&] { apply_transform_encoded(line, tc, rng, "line.png"); }),
             Catch::Contains("'line.png': an image of 20000x1 resized to") && Catch::Contains("above the limit"));
}

TEST_CASE("split folder synonyms and empty splits", "[data][folder]") {
  test::TempDir d("split");
  test::write_file(d / "val/a/x.png", encode(make_image(8, 8, 1), ".png"));
  test::write_file(d / "training/a/x.png", encode(make_image(8, 8, 1), ".png"));
  CHECK(find_split_folder(d.path.string(), "validation") == d / "val");
  CHECK(find_split_folder(d.path.string(), "train") == d / "training");
  CHECK(find_split_folder(d.path.string(), "other") == d.path.string());
  std::filesystem::create_directories(d / "empty/eval/cls");
  CHECK_THAT(user_error([&] { create_dataset("", d / "empty", "validation"); }),
             Catch::Contains("no images") && Catch::Contains("empty/eval"));
  CHECK_THAT(user_error([&] { create_dataset("", d / "missing", "train"); }), Catch::Contains("missing"));
  // a split that is not there, beside ones that are: the folder itself is read (as timm), with a warning
  std::shared_ptr<Dataset> whole, quiet;
  const auto err = test::stderr_of(
      [&] {
        whole = create_dataset("", d.path.string(), "nosuch");
        quiet = create_dataset("", d / "val", "nosuch");  // a plain class folder: no warning
      },
      d);
  REQUIRE(whole);
  CHECK_THAT(err, Catch::Contains("has no 'nosuch' split folder") && Catch::Contains("(training, val)"));
  // and the image-less 'empty' folder is no class
  CHECK_THAT(err, Catch::Contains("1 subfolder(s) hold no images") && Catch::Contains("(first: empty)"));
  // and the images one folder down are labelled by 'training' / 'val' (timm's reader: by 'a')
  CHECK_THAT(err, Catch::Contains("2 image(s) lie in sub-folders of their class folder"));
  CHECK(std::count(err.begin(), err.end(), '\n') == 3);
  CHECK(whole->size() == 2);  // val/a/x.png and training/a/x.png as two classes
  CHECK(whole->class_names() == std::vector<std::string>{"training", "val"});
  CHECK_THAT(user_error([&] { create_dataset("", "", "train"); }), Catch::Contains("--data-dir"));
}

TEST_CASE("decoding JPEG, PNG variants and corrupt files", "[data][decode]") {
  auto rgb = make_image(40, 60, 4);
  // TurboJPEG against OpenCV's libjpeg decode of the same bytes: same library family, same IDCT.
  auto jpg = encode(rgb, ".jpg");
  auto ours = decode_image(jpg, "x.jpg");
  cv::Mat ref;
  cv::cvtColor(cv::imdecode(cv::Mat(1, int(jpg.size()), CV_8UC1, jpg.data()), cv::IMREAD_COLOR), ref,
               cv::COLOR_BGR2RGB);
  REQUIRE(ours.size() == ref.size());
  CHECK(cv::norm(ours, ref, cv::NORM_INF) <= 1);
  // Lossless PNG decodes exactly; alpha is dropped; 16-bit is scaled to 8-bit.
  CHECK(cv::norm(decode_image(encode(rgb, ".png"), "x.png"), rgb, cv::NORM_INF) == 0);
  cv::Mat bgra;
  cv::cvtColor(rgb, bgra, cv::COLOR_RGB2BGRA);
  std::vector<uchar> buf;
  cv::imencode(".png", bgra, buf);
  auto dec = decode_image(std::string(buf.begin(), buf.end()), "a.png");
  CHECK(dec.channels() == 3);
  CHECK(cv::norm(dec, rgb, cv::NORM_INF) == 0);
  cv::Mat g16(4, 4, CV_16UC1, cv::Scalar(257 * 200));
  cv::imencode(".png", g16, buf);
  auto d16 = decode_image(std::string(buf.begin(), buf.end()), "g16.png");
  CHECK(d16.depth() == CV_8U);
  CHECK(d16.at<uint8_t>(0, 0) == 200);
  // Grayscale JPEG stays one channel.
  cv::Mat gray;
  cv::cvtColor(rgb, gray, cv::COLOR_RGB2GRAY);
  CHECK(decode_image(encode(gray, ".jpg"), "g.jpg").channels() == 1);
  // Truncated JPEG and garbage are DecodeErrors naming the file.
  CHECK_THROWS_WITH(decode_image(jpg.substr(0, jpg.size() / 2), "cut.jpg"), Catch::Contains("cut.jpg"));
  CHECK_THROWS_AS(decode_image("definitely not an image", "junk.png"), DecodeError);
}

namespace {
// A PNG chunk with its CRC.
std::string png_chunk(const std::string& type, const std::string& data) {
  auto be32 = [](uint32_t v) {
    return std::string{char(v >> 24), char((v >> 16) & 255), char((v >> 8) & 255), char(v & 255)};
  };
  const std::string body = type + data;
  const auto crc = uint32_t(crc32(0, reinterpret_cast<const Bytef*>(body.data()), uInt(body.size())));
  return be32(uint32_t(data.size())) + body + be32(crc);
}
}  // namespace

TEST_CASE("decode errors say what is wrong in words, and libpng's chatter stays out of the log", "[data][decode]") {
  CHECK_THROWS_WITH(decode_image("", "zero.png"), Catch::Equals("cannot decode 'zero.png': empty file"));
  CHECK_THROWS_WITH(decode_image("definitely not an image", "junk.png"), Catch::Contains("'junk.png': not an image"));
  cv::Mat bgr(5, 7, CV_8UC3, cv::Scalar(10, 20, 30));
  std::vector<uchar> buf;
  cv::imencode(".png", bgr, buf);
  const std::string png(buf.begin(), buf.end());
  CHECK_THROWS_WITH(decode_image(png.substr(0, 40), "cut.png"), Catch::Contains("'cut.png': truncated PNG"));
  CHECK_THROWS_WITH(decode_image(png.substr(0, png.size() - 1), "cut.png"), Catch::Contains("truncated PNG"));
#ifdef IMGTRAIN_WITH_IMGCODECS
  // fuzz_image's 4 GB allocation: a RIFF/WEBP header over a "VP9 " chunk, "DICM" at byte 128
  // (OpenCV's WebP decoder turns it down and its DICOM reader takes it). Refused, nothing allocated.
  std::ifstream f(std::string(IMGTRAIN_SOURCE_DIR) + "/tests/fuzz/corpus/image/regress-webp-dicm-oom", std::ios::binary);
  const std::string oom((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  REQUIRE(oom.size() == 169);
  CHECK_THROWS_WITH(decode_image(oom, "x.webp"), Catch::Contains("'x.webp': not an image"));
  std::string dicm = png + std::string(200, '\0');  // a PNG-headed file with DICM at 128
  dicm.replace(128, 4, "DICM");
  CHECK_THROWS_WITH(decode_image(dicm, "d.png"), Catch::Contains("'d.png': a PNG whose bytes 128-131 read 'DICM'"));
#endif
  // An iCCP chunk holding a broken profile (libpng warns about such on stderr): decoded as if absent,
  // and nothing is printed.
  uLongf zlen = 64;
  std::vector<Bytef> z(zlen);
  const std::string profile(40, 'x');
  REQUIRE(compress(z.data(), &zlen, reinterpret_cast<const Bytef*>(profile.data()), uLong(profile.size())) == Z_OK);
  const std::string iccp = png_chunk("iCCP", std::string("sRGB\0\0", 6) + std::string(z.begin(), z.begin() + long(zlen)));
  const size_t after_ihdr = 8 + 25;  // signature, then IHDR (13 bytes of data + 12)
  const std::string with_iccp = png.substr(0, after_ihdr) + iccp + png.substr(after_ihdr);
  test::TempDir d("stderr");
  cv::Mat out;
  const auto err = test::stderr_of(
      [&] {
        out = decode_image(with_iccp, "icc.png");
        for (size_t cut : {size_t(40), png.size() / 2, png.size() - 13}) {  // libpng: "input buffer is incomplete"
          try {
            decode_image(png.substr(0, cut), "cut.png");
          } catch (const DecodeError&) {
          }
        }
      },
      d);
  CHECK(err == "");
  REQUIRE(out.rows == 5);
  CHECK(out.at<cv::Vec3b>(2, 3) == cv::Vec3b(30, 20, 10));  // RGB
}

TEST_CASE("RandomResizedCrop boxes follow timm's rules", "[data][transforms]") {
  std::mt19937_64 rng(7);
  int fallback = 0;
  for (int i = 0; i < 2000; ++i) {
    auto b = random_resized_crop_box(300, 400, {0.08, 1.0}, {3.0 / 4, 4.0 / 3}, rng);
    REQUIRE(b.top >= 0);
    REQUIRE(b.left >= 0);
    REQUIRE(b.top + b.height <= 300);
    REQUIRE(b.left + b.width <= 400);
    double area = double(b.height) * b.width / (300.0 * 400.0);
    double ar = double(b.width) / b.height;
    if (b.width == 400 && b.height == 300) ++fallback;
    CHECK(area >= 0.08 * 0.95);
    CHECK(ar >= 0.75 * 0.95);
    CHECK(ar <= 4.0 / 3 * 1.05);
  }
  CHECK(fallback < 2000);
  // Impossible request -> timm's fallback: center crop with the ratio clamped into range.
  auto b = random_resized_crop_box(100, 100, {1.0, 1.0}, {2.0, 2.0}, rng);
  CHECK(b.width == 100);
  CHECK(b.height == 50);
  CHECK(b.top == 25);
  CHECK(b.left == 0);
}

TEST_CASE("eval transform resizes the shorter side then center crops", "[data][transforms]") {
  // 50 rows x 100 cols, columns encode their x position.
  cv::Mat img(50, 100, CV_8UC1);
  for (int x = 0; x < 100; ++x) img.col(x).setTo(x * 2);
  TransformConfig tc;
  tc.size = 32;
  tc.crop_pct = 0.875;  // resize to floor(32 / 0.875) = 36 -> 72 x 36, crop 32 from the middle
  tc.channels = 1;
  tc.interpolation = "bilinear";
  std::mt19937_64 rng(0);
  auto out = apply_transform(img, tc, rng);
  REQUIRE(out.rows == 32);
  REQUIRE(out.cols == 32);
  // Center crop of the 72-wide resize starts at column 20 of 72, i.e. x ~ 27.8 of the source.
  CHECK(std::abs(int(out.at<uint8_t>(16, 0)) - 56) <= 3);
  CHECK(std::abs(int(out.at<uint8_t>(16, 31)) - 142) <= 3);
  tc.channels = 3;
  CHECK(apply_transform(img, tc, rng).channels() == 3);
}

TEST_CASE("train transform is a deterministic function of the sample's generator", "[data][transforms]") {
  auto img = make_image(60, 80, 5);
  TransformConfig tc;
  tc.train = true;
  tc.size = 24;
  tc.hflip = 0.0;
  tc.interpolation = "bilinear";
  std::mt19937_64 r1(11), r2(11);
  auto a = apply_transform(img, tc, r1);
  auto b = apply_transform(img, tc, r2);
  CHECK(cv::norm(a, b, cv::NORM_INF) == 0);
  tc.hflip = 1.0;  // same crop (same draws come first), then always flipped
  std::mt19937_64 r3(11);
  auto c = apply_transform(img, tc, r3);
  cv::Mat flipped;
  cv::flip(a, flipped, 1);
  CHECK(cv::norm(c, flipped, cv::NORM_INF) == 0);
}

namespace {
class Synthetic : public Dataset {
 public:
  explicit Synthetic(size_t n, std::set<size_t> broken = {}) : n_(n), broken_(std::move(broken)) {}
  size_t size() const override { return n_; }
  int64_t label(size_t i) const override { return int64_t(i % 3); }
  cv::Mat image(size_t i) const override {
    if (broken_.count(i)) throw DecodeError("cannot decode 'broken-" + std::to_string(i) + "'");
    return make_image(30 + int(i % 5), 40, int(i));
  }
  std::string describe(size_t i) const override { return std::to_string(i); }
  int64_t num_classes() const override { return 3; }
  std::vector<std::string> class_names() const override { return {"a", "b", "c"}; }

 private:
  size_t n_;
  std::set<size_t> broken_;
};

std::vector<Batch> epoch_batches(Loader& l, int64_t epoch) {
  l.start_epoch(epoch);
  std::vector<Batch> out;
  while (auto b = l.next()) out.push_back(*b);
  return out;
}
}  // namespace

TEST_CASE("loader batches are identical for any thread count", "[data][loader]") {
  TransformConfig tc;
  tc.train = true;
  tc.size = 16;
  LoaderOptions o;
  o.batch_size = 7;
  o.shuffle = true;
  o.drop_last = true;
  o.seed = 3;
  auto ds = std::make_shared<Synthetic>(40);
  o.workers = 0;
  Loader l0(ds, tc, o);
  o.workers = 3;
  Loader l3(ds, tc, o);
  CHECK(l0.num_batches() == 5);  // 40 // 7, remainder dropped
  for (int64_t epoch : {0, 1}) {
    auto a = epoch_batches(l0, epoch), b = epoch_batches(l3, epoch);
    REQUIRE(a.size() == 5);
    REQUIRE(b.size() == 5);
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(torch::equal(a[i].images, b[i].images));
      CHECK(torch::equal(a[i].labels, b[i].labels));
      CHECK(a[i].images.sizes() == std::vector<int64_t>{7, 16, 16, 3});
    }
  }
  // Different epochs give different orders.
  auto e0 = epoch_batches(l0, 0), e1 = epoch_batches(l0, 1);
  CHECK_FALSE((torch::equal(e0[0].labels, e1[0].labels) && torch::equal(e0[0].images, e1[0].images)));
}

TEST_CASE("loader skips unreadable images, warns and counts", "[data][loader]") {
  TransformConfig tc;
  tc.size = 8;
  LoaderOptions o;
  o.batch_size = 4;
  o.workers = 2;
  Loader l(std::make_shared<Synthetic>(10, std::set<size_t>{1, 6}), tc, o);
  auto batches = epoch_batches(l, 0);
  REQUIRE(batches.size() == 3);  // eval: remainder kept
  CHECK(batches[0].images.size(0) == 3);
  CHECK(batches[1].images.size(0) == 3);
  CHECK(batches[2].images.size(0) == 2);
  CHECK(l.skipped_this_epoch() == 2);
  CHECK(batches[0].labels[1].item<int64_t>() == 2);  // sample 1 skipped: 0, 2, 3
}

TEST_CASE("training refills skipped images from the next index and stops when nothing is readable", "[data][loader][fault]") {
  TransformConfig tc;
  tc.size = 8;
  LoaderOptions o;
  o.batch_size = 4;
  o.workers = 2;
  o.refill_unreadable = true;
  Loader l(std::make_shared<Synthetic>(10, std::set<size_t>{1, 6, 7}), tc, o);
  auto batches = epoch_batches(l, 0);
  REQUIRE(batches.size() == 3);
  for (auto& b : batches) CHECK(b.images.size(0) == (&b == &batches.back() ? 2 : 4));  // no batch shrinks
  CHECK(l.skipped_this_epoch() == 3);  // 1; 6 and then 7 in its place; 7 again: three images
  // labels are index % 3
  CHECK(batches[0].labels[1].item<int64_t>() == 2);  // 1 -> 2
  CHECK(batches[1].labels[2].item<int64_t>() == 2);  // 6 -> 7 -> 8
  CHECK(batches[1].labels[3].item<int64_t>() == 2);  // 7 -> 8
  std::set<size_t> all;
  for (size_t i = 0; i < 60; ++i) all.insert(i);
  Loader dead(std::make_shared<Synthetic>(60, all), tc, o);
  dead.start_epoch(0);
  try {
    while (dead.next()) {
    }
    FAIL("an unreadable split must stop the loader");
  } catch (const UserError& e) {  // the data's fault: one line, exit code 2
    CHECK_THAT(std::string(e.what()), Catch::Contains("50 unreadable images in a row"));
  }
  // a split smaller than the limit: every image tried once, and said so
  std::set<size_t> ten;
  for (size_t i = 0; i < 10; ++i) ten.insert(i);
  Loader small(std::make_shared<Synthetic>(10, ten), tc, o);
  small.start_epoch(0);
  CHECK_THROWS_WITH(([&] {
                      while (small.next()) {
                      }
                    }()),
                    Catch::Contains("all 10 images are unreadable"));
  CHECK(small.skipped_this_epoch() == 10);
}

TEST_CASE("device normalisation matches the per-element formula", "[data][normalize]") {
  auto x = torch::randint(0, 256, {2, 5, 7, 3}, torch::kUInt8);
  std::vector<double> mean{0.485, 0.456, 0.406}, sd{0.229, 0.224, 0.225};
  auto y = normalize_nhwc_u8(x, mean, sd);
  REQUIRE(y.sizes() == std::vector<int64_t>{2, 3, 5, 7});
  auto xa = x.accessor<uint8_t, 4>();
  auto ya = y.accessor<float, 4>();
  double worst = 0;
  for (int n = 0; n < 2; ++n)
    for (int c = 0; c < 3; ++c)
      for (int h = 0; h < 5; ++h)
        for (int w = 0; w < 7; ++w)
          worst = std::max(worst, std::abs(ya[n][c][h][w] - (xa[n][h][w][c] / 255.0 - mean[c]) / sd[c]));
  CHECK(worst < 1e-5);
  // channels-last in the same pass: the same numbers, in NHWC memory
  auto cl = normalize_nhwc_u8(x, mean, sd, /*channels_last=*/true);
  CHECK(cl.is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK(torch::equal(cl, y));
}

TEST_CASE("CUDA: the device normalisation kernel equals the CPU path bit for bit, in both layouts",
          "[cuda][data][normalize]") {
  test::skip_unless(torch::cuda::is_available());
  REQUIRE(normalize_has_cuda_kernel());
  for (int64_t c : {3, 1}) {
    auto x = torch::randint(0, 256, {3, 17, 29, c}, torch::kUInt8);
    std::vector<double> mean(size_t(c), 0.45), sd(size_t(c), 0.226);
    if (c == 3) mean = {0.485, 0.456, 0.406}, sd = {0.229, 0.224, 0.225};
    const auto want = normalize_nhwc_u8(x, mean, sd);
    for (bool cl : {false, true}) {
      auto got = normalize_nhwc_u8(x.to(torch::kCUDA), mean, sd, cl);
      CHECK(got.is_contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous));
      CHECK(torch::equal(got.cpu(), want));
    }
  }
}

TEST_CASE("mixup and cutmix mix each sample with its mirror", "[data][mixup]") {
  auto x0 = torch::arange(4 * 1 * 8 * 8, torch::kFloat32).view({4, 1, 8, 8});
  auto y = torch::tensor({0, 1, 2, 3});
  MixupConfig c;
  c.num_classes = 4;
  c.label_smoothing = 0.0;
  c.mixup_alpha = 0.4;
  std::mt19937_64 rng(3);
  auto x = x0.clone();
  auto t = apply_mixup(x, y, c, rng);
  // batch mode: one lam; x = lam x + (1 - lam) flip(x); the target row for sample 0 says the same.
  double lam = t[0][0].item<double>();
  CHECK(t[0][3].item<double>() == Approx(1 - lam));
  CHECK((x - (x0 * lam + x0.flip(0) * (1 - lam))).abs().max().item<double>() < 1e-3);
  // cutmix: a box of the mirror image, and lam = 1 - box area / image area.
  c.mixup_alpha = 0;
  c.cutmix_alpha = 1.0;
  for (int k = 0; k < 20; ++k) {
    x = x0.clone();
    t = apply_mixup(x, y, c, rng);
    auto from_mirror = (x != x0) & (x == x0.flip(0));
    double frac = from_mirror[0].to(torch::kFloat32).mean().item<double>();
    CHECK(t[0][0].item<double>() == Approx(1.0 - frac).margin(1e-6));
    CHECK(((x == x0) | (x == x0.flip(0))).all().item<bool>());
  }
  // elem mode: per-sample lams, sample i with n-1-i; prob 0 leaves everything alone.
  c.mode = "elem";
  c.prob = 0.0;
  x = x0.clone();
  t = apply_mixup(x, y, c, rng);
  CHECK(torch::equal(x, x0));
  CHECK(torch::equal(t, torch::eye(4)));
}

TEST_CASE("DCT-scaled JPEG decode: within 2 levels (mean) of a full decode + area resize", "[data][decode]") {
  auto img = make_image(400, 520, 3);
  cv::GaussianBlur(img, img, {0, 0}, 1.0);
  const std::string jpg = encode(img, ".jpg");
  CHECK(jpeg_size(jpg, "t") == cv::Size(520, 400));
  auto full = decode_jpeg(jpg, 1, "t");
  CHECK(cv::norm(full, decode_image(jpg, "t"), cv::NORM_INF) == 0);
  for (int d : {2, 4, 8}) {
    INFO("1/" << d);
    auto scaled = decode_jpeg(jpg, d, "t");
    REQUIRE(scaled.size() == cv::Size((520 + d - 1) / d, (400 + d - 1) / d));
    cv::Mat ref, diff;
    cv::resize(full, ref, scaled.size(), 0, 0, cv::INTER_AREA);
    cv::absdiff(scaled, ref, diff);
    // The scaled IDCT filters each 8x8 block by itself; area averaging of the full decode is the
    // reference. Measured: mean 0.39-0.49, so 2 levels is a margin a wrong scale would not meet.
    CHECK(cv::mean(diff.reshape(1))[0] < 2.0);
  }
}

TEST_CASE("transforms from JPEG bytes: the same random draws, pixels within tolerance of decode + transform",
          "[data][transforms]") {
  auto img = make_image(400, 520, 4);
  cv::GaussianBlur(img, img, {0, 0}, 1.0);
  const std::string jpg = encode(img, ".jpg");
  const cv::Mat decoded = decode_image(jpg, "t");
  TransformConfig tc;
  tc.size = 48;
  for (bool train : {true, false}) {
    tc.train = train;
    for (uint64_t seed = 0; seed < 20; ++seed) {
      INFO("train " << train << " seed " << seed);
      std::mt19937_64 r1(seed), r2(seed);
      auto a = apply_transform_encoded(jpg, tc, r1, "t");
      auto b = apply_transform(decoded, tc, r2);
      CHECK(r1() == r2());  // the same number of draws
      REQUIRE(a.size() == b.size());
      cv::Mat diff;
      cv::absdiff(a, b, diff);
      // Crops >= 2x the output decode at 1/2..1/8: the result is a differently filtered
      // downscale of the same region (measured mean 0.5-3.3 levels over these 40 cases).
      CHECK(cv::mean(diff.reshape(1))[0] < 4.0);
    }
  }
}

namespace {
// JPEG files in memory: the loader's encoded-bytes path.
class JpegSynthetic : public Dataset {
 public:
  explicit JpegSynthetic(size_t n) {
    for (size_t i = 0; i < n; ++i) files_.push_back(encode(make_image(120 + int(i % 7) * 10, 160, int(i)), ".jpg"));
  }
  size_t size() const override { return files_.size(); }
  int64_t label(size_t i) const override { return int64_t(i % 3); }
  cv::Mat image(size_t i) const override { return decode_image(files_[i], describe(i)); }
  bool encoded(size_t i, std::string& bytes) const override {
    bytes = files_[i];
    return true;
  }
  std::string describe(size_t i) const override { return "jpeg-" + std::to_string(i); }
  int64_t num_classes() const override { return 3; }
  std::vector<std::string> class_names() const override { return {"a", "b", "c"}; }

 private:
  std::vector<std::string> files_;
};
}  // namespace

TEST_CASE("JPEG batches are bitwise the same for -j 1 and -j 4, and for 1 rank and the union of 2", "[data][loader]") {
  TransformConfig tc;
  tc.train = true;
  tc.size = 32;
  tc.interpolation = "random";
  LoaderOptions o;
  o.batch_size = 4;
  o.shuffle = true;
  o.drop_last = true;
  o.seed = 9;
  auto ds = std::make_shared<JpegSynthetic>(32);
  std::map<int64_t, at::Tensor> by_index;  // sample index -> its augmented image, 1 rank, 1 thread
  for (int64_t workers : {1, 4}) {
    o.workers = workers;
    Loader l(ds, tc, o);
    for (auto& b : epoch_batches(l, 2))
      for (int64_t k = 0; k < b.indices.size(0); ++k) {
        const int64_t idx = b.indices[k].item<int64_t>();
        if (workers == 1) by_index[idx] = b.images[k].clone();
        else CHECK(torch::equal(by_index.at(idx), b.images[k]));
      }
  }
  REQUIRE(by_index.size() == 32);
  size_t seen = 0;
  for (int64_t rank : {0, 1}) {
    o.workers = 2;
    o.rank = rank;
    o.world = 2;
    Loader l(ds, tc, o);
    for (auto& b : epoch_batches(l, 2))
      for (int64_t k = 0; k < b.indices.size(0); ++k, ++seen)
        CHECK(torch::equal(by_index.at(b.indices[k].item<int64_t>()), b.images[k]));
  }
  CHECK(seen == 32);
}

TEST_CASE("decoding a JPEG region gives the full decode's pixels there", "[data][decode]") {
  auto img = make_image(300, 410, 7);
  cv::GaussianBlur(img, img, {0, 0}, 1.0);
  cv::Mat gray;
  cv::cvtColor(img, gray, cv::COLOR_RGB2GRAY);
  for (const cv::Mat& src : {img, gray}) {
    const std::string jpg = encode(src, ".jpg");
    for (int d : {1, 2, 4}) {
      auto full = decode_jpeg(jpg, d, "t");
      for (cv::Rect r : {cv::Rect(0, 0, full.cols, full.rows), cv::Rect(13, 7, 40, 31), cv::Rect(full.cols - 9, full.rows - 5, 9, 5),
                         cv::Rect(17, 0, 1, full.rows)}) {
        INFO("channels " << src.channels() << " 1/" << d << " region " << r);
        auto part = decode_jpeg_region(jpg, d, r, "t");
        REQUIRE(part.size() == r.size());
        REQUIRE(part.channels() == full.channels());
        // Fancy chroma upsampling near the crop's edges may round differently: within 1 level.
        CHECK(cv::norm(part, full(r), cv::NORM_INF) <= 1);
      }
    }
  }
  CHECK_THROWS_AS(decode_jpeg_region(std::string("\xFF\xD8\xFF\xE0 broken", 12), 1, {0, 0, 1, 1}, "b"), DecodeError);
}

namespace {
// An ImageFolder of n small JPEGs in 3 classes (file i in class i % 3); `corrupt` gets garbage.
std::string write_jpeg_folder(const std::string& root, int n, int corrupt = -1) {
  for (int i = 0; i < n; ++i) {
    const std::string path = fmt::format("{}/train/c{}/{:04d}.jpg", root, i % 3, i);
    test::write_file(path, i == corrupt ? std::string("\xFF\xD8\xFF\xE0 not a jpeg", 15)
                                        : encode(make_image(40 + i % 5, 52, i), ".jpg"));
  }
  return root;
}
}  // namespace

TEST_CASE("pack writes tar shards that read back as the same samples", "[data][shards]") {
  test::TempDir dir("pack");
  write_jpeg_folder(dir / "in", 30);
  PackOptions po;
  po.data_dir = dir / "in";
  po.out = dir / "out";
  po.shard_size = 8000;  // several shards
  auto res = pack_image_folder(po);
  CHECK(res.samples == 30);
  CHECK(res.shards > 2);
  auto shards = find_shards(dir / "out/train");
  REQUIRE(shards.size() == size_t(res.shards));
  std::string err;
  auto members = list_tar(shards[0], &err);
  CHECK(err.empty());
  REQUIRE(members.size() >= 2);
  CHECK(members[0].name.size() == 13);  // 000000000.jpg
  CHECK(members[1].name == members[0].name.substr(0, 9) + ".cls");
  auto folder = create_dataset("", dir / "in", "train");
  auto tars = create_dataset("", dir / "out", "train");  // the split folder holds shards
  REQUIRE(tars->size() == folder->size());
  CHECK(tars->num_classes() == 3);
  CHECK(tars->class_names() == folder->class_names());
  CHECK(tars->shard_starts().size() == shards.size() + 1);
  for (size_t i = 0; i < folder->size(); ++i) {
    CHECK(tars->label(i) == folder->label(i));
    CHECK(cv::norm(tars->image(i), folder->image(i), cv::NORM_INF) == 0);
  }
  // --max-size re-encodes the larger images as JPEG.
  po.out = dir / "small";
  po.max_size = 45;
  auto small = pack_image_folder(po);
  CHECK(small.reencoded > 0);
  auto st = create_dataset("", dir / "small", "train");
  for (size_t i = 0; i < st->size(); ++i) CHECK(std::max(st->image(i).rows, st->image(i).cols) <= 45);
  // Packing again into a folder that holds shards is refused before anything is written (the reader
  // would take the old shards with the new ones); --overwrite removes them first, also a leftover .tmp
  po.out = dir / "out";
  po.max_size = 0;
  po.shard_size = 1ull << 30;  // one shard: the old ones past it would linger
  CHECK_THROWS_WITH(pack_image_folder(po), Catch::Contains("already holds") && Catch::Contains("--overwrite"));
  CHECK(find_shards(dir / "out/train") == shards);
  test::write_file(dir / "out/train/shard-000099.tar.tmp", "partial");
  po.overwrite = true;
  auto again = pack_image_folder(po);
  CHECK(again.shards == 1);
  CHECK(find_shards(dir / "out/train").size() == 1);
  CHECK_FALSE(std::filesystem::exists(dir / "out/train/shard-000099.tar.tmp"));
  CHECK(create_dataset("", dir / "out", "train")->size() == 30);
}

TEST_CASE("a corrupt image inside a shard is skipped and counted, and a truncated shard keeps what precedes", "[data][shards][fault]") {
  test::TempDir dir("shardbad");
  write_jpeg_folder(dir / "in", 12, 5);
  PackOptions po;
  po.data_dir = dir / "in";
  po.out = dir / "out";
  pack_image_folder(po);  // copies bytes as they are: the corrupt file goes into the shard
  auto ds = create_dataset("", dir / "out", "train");
  REQUIRE(ds->size() == 12);
  TransformConfig tc;
  tc.size = 16;
  LoaderOptions o;
  o.batch_size = 4;
  o.workers = 2;
  Loader l(ds, tc, o);
  int64_t images = 0;
  for (auto& b : epoch_batches(l, 0)) images += b.images.size(0);
  CHECK(images == 11);
  CHECK(l.skipped_this_epoch() == 1);
  // Cut the shard in the middle of a member: the samples before the cut remain.
  auto shard = find_shards(dir / "out/train").at(0);
  const auto members = list_tar(shard);
  std::filesystem::resize_file(shard, members[14].offset + 10);
  std::string err;
  auto kept = list_tar(shard, &err);
  CHECK_THAT(err, Catch::Contains("truncated"));
  CHECK(kept.size() == 14);
  auto ds2 = create_dataset("", dir / "out", "train");
  CHECK(ds2->size() == 7);
  // Cut exactly at a member's header block: no partial block, but no end-of-archive blocks either.
  std::filesystem::resize_file(shard, members[12].offset - 512);
  err.clear();
  CHECK(list_tar(shard, &err).size() == 12);
  CHECK_THAT(err, Catch::Contains("cut short"));
  // an intact shard reports nothing
  po.overwrite = true;
  pack_image_folder(po);
  err.clear();
  CHECK(list_tar(find_shards(dir / "out/train").at(0), &err).size() == 24);
  CHECK(err.empty());
}

TEST_CASE("tar .cls labels are read as Python's int() reads them, not by their numeric prefix", "[data][shards][fault]") {
  auto member = [](const std::string& name, const std::string& data) {
    std::string h(512, '\0');
    h.replace(0, name.size(), name);
    h.replace(100, 7, "0000644");
    h.replace(108, 7, "0000000");
    h.replace(116, 7, "0000000");
    h.replace(124, 11, fmt::format("{:011o}", data.size()));
    h.replace(136, 11, "00000000000");
    h[156] = '0';
    h.replace(257, 6, std::string("ustar\0", 6));
    h.replace(263, 2, "00");
    h.replace(148, 8, "        ");
    uint64_t sum = 0;
    for (unsigned char c : h) sum += c;
    h.replace(148, 7, fmt::format("{:06o}", sum) + std::string(1, '\0'));
    return h + data + std::string((512 - data.size() % 512) % 512, '\0');
  };
  const std::string jpg = encode(make_image(8, 8, 3), ".jpg");
  const std::vector<std::pair<std::string, bool>> labels = {
      {"1", true}, {" 2\n", true}, {"+2", true}, {"-0", true}, {"1e2", false}, {"1.5", false}, {"0x1", false},
      {"2abc", false}, {"1 2", false}, {"", false}, {"-3", false}, {"1000000", false}, {"9223372036854775807", false}};
  std::string tar;
  for (size_t i = 0; i < labels.size(); ++i)
    tar += member(fmt::format("{:04d}.jpg", i), jpg) + member(fmt::format("{:04d}.cls", i), labels[i].first);
  tar += std::string(1024, '\0');
  test::TempDir d("cls");
  test::write_file(d / "train/shard-000000.tar", tar);
  auto ds = create_dataset("", d.path.string(), "train");
  size_t accepted = 0;
  for (auto& [text, ok] : labels) accepted += ok;
  CHECK(ds->size() == accepted);
  CHECK(ds->num_classes() == 3);  // labels 1, 2, 2, 0
}

TEST_CASE("a tar member whose size field is near 2^64 ends the shard index with a reason", "[data][shards][fault]") {
  // One header block (valid checksum) with a GNU base-256 size, then a few data blocks.
  auto header = [](const std::string& name, char type, uint64_t size) {
    std::string h(512, '\0');
    h.replace(0, name.size(), name);
    h.replace(100, 7, "0000644");
    h.replace(108, 7, "0000000");
    h.replace(116, 7, "0000000");
    h[124] = char(0x80);
    for (int b = 0; b < 8; ++b) h[size_t(124 + 4 + b)] = char((size >> (56 - 8 * b)) & 0xff);
    h.replace(136, 11, "00000000000");
    h[156] = type;
    h.replace(257, 6, std::string("ustar\0", 6));
    h.replace(263, 2, "00");
    h.replace(148, 8, "        ");
    uint64_t sum = 0;
    for (unsigned char c : h) sum += c;
    const std::string cs = fmt::format("{:06o}", sum);
    h.replace(148, 6, cs);
    h[154] = '\0';
    return h;
  };
  test::TempDir d("tarbomb");
  for (char type : {'0', 'L'}) {
    INFO("type " << type);
    const std::string path = d / (std::string("s") + type + ".tar");
    test::write_file(path, header("a.jpg", type, 0xFFFFFFFFFFFFFE00ull) + std::string(2048, 'x'));
    std::string err;
    const auto members = list_tar(path, &err);  // returns at once: no wrap-around, no endless loop
    CHECK(members.empty());
    CHECK_THAT(err, Catch::Contains("past the end of the file"));
  }
  // a long-name header of 2 MiB is refused rather than read into memory
  const std::string big = d / "big.tar";
  test::write_file(big, header("././@LongLink", 'L', 2u << 20) + std::string((2u << 20) + 512, 'n'));
  std::string err;
  CHECK(list_tar(big, &err).empty());
  CHECK_THAT(err, Catch::Contains("long-name header"));
}

TEST_CASE("shard order: shards dealt to ranks, buffer-shuffled, equal lengths, same for any thread count", "[data][shards]") {
  std::vector<size_t> starts{0, 10, 25, 30, 48, 60};  // 5 shards of 60 samples
  auto a = shard_order(starts, 1, 3, 0, 1, 8, 60);
  auto b = shard_order(starts, 1, 3, 0, 1, 8, 60);
  CHECK(a == b);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 60; ++i) CHECK(sorted[size_t(i)] == i);  // a permutation
  CHECK(a != shard_order(starts, 1, 4, 0, 1, 8, 60));             // another epoch, another order
  // Two ranks: disjoint shards, each padded or cut to the same length.
  auto r0 = shard_order(starts, 1, 3, 0, 2, 8, 30), r1 = shard_order(starts, 1, 3, 1, 2, 8, 30);
  CHECK(r0.size() == 30);
  CHECK(r1.size() == 30);
  auto shard_of = [&](int64_t i) { return std::upper_bound(starts.begin(), starts.end(), size_t(i)) - starts.begin() - 1; };
  std::set<int64_t> s0, s1;
  for (auto i : r0) s0.insert(shard_of(i));
  for (auto i : r1) s1.insert(shard_of(i));
  for (auto s : s0) CHECK(s1.count(s) == 0);
  // Fewer shards than ranks: every rank reads all of them and takes its share of the stream.
  auto few0 = shard_order({0, 10}, 1, 0, 0, 2, 4, 5), few1 = shard_order({0, 10}, 1, 0, 1, 2, 4, 5);
  std::set<int64_t> all(few0.begin(), few0.end());
  all.insert(few1.begin(), few1.end());
  CHECK(all.size() == 10);
}

TEST_CASE("ImageFolder's scan is cached and invalidated when a folder changes", "[data][folder]") {
  test::TempDir dir("scan");
  write_jpeg_folder(dir / "in", 9);
  setenv("XDG_CACHE_HOME", (dir / "cache").c_str(), 1);
  auto small = create_dataset("", dir / "in", "train");  // below the default 10,000 files: no cache
  CHECK(!std::filesystem::exists(dir / "cache/imgtrain"));
  setenv("IMGTRAIN_SCAN_CACHE_MIN_FILES", "1", 1);
  auto a = create_dataset("", dir / "in", "train");
  CHECK(a->size() == 9);
  std::vector<std::string> cached;
  for (auto& e : std::filesystem::recursive_directory_iterator(dir / "cache")) cached.push_back(e.path().string());
  REQUIRE(cached.size() == 2);  // the imgtrain folder and one scan file
  // A new file with its folder's mtime put back: the cache (9 files) is used, so it is not seen.
  const auto cls = std::filesystem::path(dir / "in/train/c1");
  const auto t = std::filesystem::last_write_time(cls);
  test::write_file((cls / "new.jpg").string(), encode(make_image(40, 52, 99), ".jpg"));
  std::filesystem::last_write_time(cls, t);
  auto b = create_dataset("", dir / "in", "train");
  CHECK(b->size() == 9);
  for (size_t i = 0; i < 9; ++i) CHECK(b->describe(i) == a->describe(i));
  // The folder's real mtime: a rescan finds the 10th file.
  std::filesystem::last_write_time(cls, t + std::chrono::seconds(5));
  CHECK(create_dataset("", dir / "in", "train")->size() == 10);
  setenv("IMGTRAIN_SCAN_CACHE", "0", 1);  // off: always scans
  std::filesystem::remove(cls / "new.jpg");
  std::filesystem::last_write_time(cls, t + std::chrono::seconds(5));
  CHECK(create_dataset("", dir / "in", "train")->size() == 9);
  unsetenv("IMGTRAIN_SCAN_CACHE");
  unsetenv("IMGTRAIN_SCAN_CACHE_MIN_FILES");
  unsetenv("XDG_CACHE_HOME");
}

TEST_CASE("detection targets move with the image, and the pad collate keeps each image's size", "[data][target]") {
  // Two images of different sizes and channel layout HWC: padded to multiples of 32, top-left.
  cv::Mat a(30, 45, CV_8UC3, cv::Scalar(1, 2, 3)), b(64, 20, CV_8UC3, cv::Scalar(9, 8, 7));
  auto batch = pad_collate({a, b});
  CHECK(batch.images.sizes() == at::IntArrayRef{2, 64, 64, 3});
  CHECK(torch::equal(batch.sizes, torch::tensor({30, 45, 64, 20}, torch::kLong).view({2, 2})));
  CHECK(batch.images[0][29][44][2].item<int>() == 3);
  CHECK(batch.images[0][30][0].sum().item<int>() == 0);  // padding below
  CHECK(batch.images[0][0][45].sum().item<int>() == 0);  // and to the right
  CHECK(batch.images[1][63][19][0].item<int>() == 9);
  CHECK(batch.images[1].narrow(1, 20, 44).sum().item<int>() == 0);
  CHECK(pad_collate({cv::Mat(32, 33, CV_8UC1, cv::Scalar(5))}, 32).images.sizes() == at::IntArrayRef{1, 32, 64, 1});
  CHECK_THROWS(pad_collate({a, cv::Mat(4, 4, CV_8UC1)}));

  // One flip decision for the image and its boxes (torchvision: x1' = w - x2, x2' = w - x1).
  cv::Mat img(10, 40, CV_8UC1, cv::Scalar(0));
  img.at<uint8_t>(2, 3) = 255;
  BoxTarget t{torch::tensor({3.0f, 2.0f, 11.0f, 6.0f, 0.0f, 0.0f, 40.0f, 10.0f}).view({2, 4}), torch::tensor({1, 2})};
  std::mt19937_64 rng(1);
  CHECK(random_hflip(img, t, 1.0, rng));
  CHECK(img.at<uint8_t>(2, 36) == 255);
  CHECK(torch::equal(t.boxes, torch::tensor({29.0f, 2.0f, 37.0f, 6.0f, 0.0f, 0.0f, 40.0f, 10.0f}).view({2, 4})));
  CHECK_FALSE(random_hflip(img, t, 0.0, rng));
  // p = 0.5 flips about half the time, from the generator alone
  int flips = 0;
  for (int i = 0; i < 2000; ++i) flips += random_hflip(img, t, 0.5, rng);
  CHECK(flips > 900);
  CHECK(flips < 1100);

  // Resizing 40x10 to 80x25: x by 2, y by 2.5.
  BoxTarget r{torch::tensor({4.0f, 2.0f, 8.0f, 6.0f}).view({1, 4}), torch::tensor({1})};
  resize_boxes(r, {40, 10}, {80, 25});
  CHECK(torch::allclose(r.boxes, torch::tensor({8.0f, 5.0f, 16.0f, 15.0f}).view({1, 4})));
}
