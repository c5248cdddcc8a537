// imgtrain::coco against pycocotools.mask (references from make_coco_mask_refs.py): counts and
// strings equal, IoUs equal to the bit. Plus the error paths and an O(runs) check of rle_iou.
#include "data/coco_mask.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <bit>
#include <cstdlib>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>

using namespace imgtrain::coco;
using nlohmann::json;

namespace {

const json& refs() {
  static const json j = [] {
    const std::string path = std::string(IMGTRAIN_PARITY_DIR) + "/coco_mask/coco_mask_refs.json";
    std::ifstream f(path);
    if (!f) throw std::runtime_error("missing " + path + " (run make_coco_mask_refs.py)");
    return json::parse(f);
  }();
  return j;
}

std::vector<uint8_t> mask_of(const std::string& bits) {
  std::vector<uint8_t> m(bits.size());
  for (size_t i = 0; i < bits.size(); i++) m[i] = bits[i] == '1';
  return m;
}

Box box_of(const json& j) { return {j[0].get<double>(), j[1].get<double>(), j[2].get<double>(), j[3].get<double>()}; }

uint64_t bits(double v) { return std::bit_cast<uint64_t>(v); }
double from_hex(const std::string& s) { return std::strtod(s.c_str(), nullptr); }

Rle rle_of(const json& e) { return rle_from_string(e[2].get<std::string>(), e[0].get<uint32_t>(), e[1].get<uint32_t>()); }

// The IoU matrices must agree bit for bit (the arithmetic is the same, operation by operation).
void check_iou(const json& c, const std::vector<double>& got) {
  const auto& want = c["iou"];
  REQUIRE(got.size() == want.size() * (want.empty() ? 0 : want[0].size()));
  const size_t n = want[0].size();
  for (size_t d = 0; d < want.size(); d++)
    for (size_t g = 0; g < n; g++) {
      INFO("dt " << d << " gt " << g << " got " << got[d * n + g] << " want " << want[d][g].get<std::string>());
      CHECK(bits(got[d * n + g]) == bits(from_hex(want[d][g].get<std::string>())));
    }
}

}  // namespace

TEST_CASE("coco rle encode and decode match pycocotools", "[parity][coco]") {
  for (const auto& c : refs()["encode"]) {
    const uint32_t h = c["h"], w = c["w"];
    INFO(h << "x" << w << " " << c["string"].get<std::string>());
    const auto m = mask_of(c["mask"]);
    const auto want = c["counts"].get<std::vector<uint32_t>>();
    const Rle r = rle_encode(m.data(), h, w);
    CHECK(r.counts == want);
    CHECK(rle_to_string(r) == c["string"].get<std::string>());
    const Rle back = rle_from_string(c["string"].get<std::string>(), h, w);
    CHECK(back == r);
    CHECK(rle_decode(back) == m);
    CHECK(rle_from_counts(want, h, w) == r);
    CHECK(rle_area(r) == c["area"].get<uint64_t>());
    const Box bb = rle_to_bbox(r);
    for (int k = 0; k < 4; k++) CHECK(bits(bb[k]) == bits(c["bbox"][k].get<double>()));
  }
}

TEST_CASE("coco uncompressed counts with empty runs match pycocotools", "[parity][coco]") {
  for (const auto& c : refs()["counts"]) {
    const uint32_t h = c["h"], w = c["w"];
    INFO(h << "x" << w << " " << c["counts"].dump());
    const Rle r = rle_from_counts(c["counts"].get<std::vector<uint32_t>>(), h, w);
    CHECK(rle_to_string(r) == c["string"].get<std::string>());
    CHECK(rle_from_string(c["string"].get<std::string>(), h, w) == r);
    CHECK(rle_area(r) == c["area"].get<uint64_t>());
    const Box bb = rle_to_bbox(r);  // no foreground: pycocotools' wrapped-around uint width
    for (int k = 0; k < 4; k++) CHECK(bits(bb[k]) == bits(c["bbox"][k].get<double>()));
  }
}

TEST_CASE("coco rle merge matches pycocotools", "[parity][coco]") {
  for (const auto& c : refs()["merge"]) {
    const uint32_t h = c["h"], w = c["w"];
    std::vector<Rle> in;
    for (const auto& s : c["inputs"]) in.push_back(rle_from_string(s.get<std::string>(), h, w));
    INFO(h << "x" << w << " n=" << in.size());
    CHECK(rle_to_string(rle_merge(in, false)) == c["union"].get<std::string>());
    CHECK(rle_to_string(rle_merge(in, true)) == c["intersect"].get<std::string>());
  }
}

TEST_CASE("coco rle from boxes matches pycocotools", "[parity][coco]") {
  for (const auto& c : refs()["frbbox"]) {
    const uint32_t h = c["h"], w = c["w"];
    INFO(h << "x" << w << " " << c["bbox"].dump());
    CHECK(rle_to_string(rle_from_bbox(box_of(c["bbox"]), h, w)) == c["string"].get<std::string>());
  }
}

TEST_CASE("coco rle from polygons matches pycocotools", "[parity][coco]") {
  for (const auto& c : refs()["polygons"]) {
    const uint32_t h = c["h"], w = c["w"];
    const auto polys = c["polys"].get<std::vector<std::vector<double>>>();
    INFO(c["name"].get<std::string>() << " " << h << "x" << w << " " << c["polys"].dump());
    for (size_t i = 0; i < polys.size(); i++)
      CHECK(rle_to_string(rle_from_polygon(polys[i], h, w)) == c["strings"][i].get<std::string>());
    if (c.contains("merged")) CHECK(rle_to_string(rle_from_polygons(polys, h, w)) == c["merged"].get<std::string>());
  }
}

TEST_CASE("coco mask iou matches pycocotools to the bit", "[parity][coco]") {
  for (const auto& c : refs()["rle_iou"]) {
    std::vector<Rle> dt, gt;
    for (const auto& e : c["dt"]) dt.push_back(rle_of(e));
    for (const auto& e : c["gt"]) gt.push_back(rle_of(e));
    const auto crowd = c["iscrowd"].get<std::vector<uint8_t>>();
    std::vector<double> got(dt.size() * gt.size(), 99);
    rle_iou(dt, gt, crowd, got.data());
    check_iou(c, got);
  }
}

TEST_CASE("coco box iou matches pycocotools to the bit", "[parity][coco]") {
  for (const auto& c : refs()["bbox_iou"]) {
    std::vector<Box> dt, gt;
    for (const auto& e : c["dt"]) dt.push_back(box_of(e));
    for (const auto& e : c["gt"]) gt.push_back(box_of(e));
    const auto crowd = c["iscrowd"].get<std::vector<uint8_t>>();
    std::vector<double> got(dt.size() * gt.size(), 99);
    bbox_iou(dt, gt, crowd, got.data());
    check_iou(c, got);
  }
}

// ---- error paths and invariants (no references needed) ----

TEST_CASE("coco rle strings that are malformed throw", "[coco]") {
  using Catch::Matchers::Contains;
  // "3" is one run of 3 pixels: not the 4 of a 2x2 mask
  CHECK_THROWS_WITH(rle_from_string("3", 2, 2), Contains("sum to 3") && Contains("h*w"));
  CHECK_THROWS_WITH(rle_from_string("1~1", 1, 2), Contains("invalid character"));
  CHECK_THROWS_WITH(rle_from_string("1 1", 1, 2), Contains("invalid character"));
  CHECK_THROWS_WITH(rle_from_string(std::string("1\0", 2), 1, 1), Contains("invalid character"));
  CHECK_THROWS_WITH(rle_from_string("0P", 4, 4), Contains("truncated"));  // 'P': continuation bit set
  CHECK_THROWS_WITH(rle_from_string("PPPPPPPP0", 4, 4), Contains("too long"));
  CHECK_THROWS_WITH(rle_from_string("O", 4, 4), Contains("out of range"));  // a single -1
  CHECK_THROWS_AS(rle_from_string("", 2, 2), std::invalid_argument);
  CHECK(rle_from_string("4", 2, 2).counts == std::vector<uint32_t>{4});
  CHECK(rle_from_string("", 0, 3).counts.empty());
}

TEST_CASE("coco rle strings of random bytes parse or throw invalid_argument", "[coco]") {
  // Whatever the bytes: a clean std::invalid_argument or an RLE that covers the mask and
  // survives a round trip through its own canonical string.
  std::mt19937 rng(7);
  const std::string alphabet = "0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmno~ \x7f";
  int parsed = 0;
  for (int it = 0; it < 20000; it++) {
    const uint32_t h = rng() % 6, w = rng() % 6;
    std::string str(rng() % 10, '0');
    for (auto& ch : str) ch = alphabet[rng() % alphabet.size()];
    try {
      const Rle r = rle_from_string(str, h, w);
      parsed++;
      REQUIRE(rle_decode(r).size() == size_t(h) * w);
      REQUIRE(rle_from_string(rle_to_string(r), h, w) == r);
    } catch (const std::invalid_argument&) {
    }
  }
  CHECK(parsed > 100);
}

TEST_CASE("coco rle counts that do not cover the mask throw", "[coco]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(rle_from_counts({1, 2}, 2, 2), Contains("sum to 3"));
  CHECK_THROWS_WITH(rle_from_counts({4, 1}, 2, 2), Contains("sum to 5"));
  const Rle bad{2, 2, {1, 1}};
  CHECK_THROWS_AS(rle_decode(bad), std::invalid_argument);
  CHECK_THROWS_AS(rle_area(bad), std::invalid_argument);
  CHECK_THROWS_AS(rle_to_bbox(Rle{0, 3, {0, 2}}), std::invalid_argument);  // would divide by h = 0
  CHECK_THROWS_AS(rle_to_string(bad), std::invalid_argument);
  double o = 0;
  CHECK_THROWS_AS(rle_iou({bad}, {rle_from_counts({4}, 2, 2)}, {}, &o), std::invalid_argument);
  CHECK_THROWS_WITH(rle_from_counts({0}, 70000, 70000), Contains("2^32"));
}

TEST_CASE("coco rle merge of different sizes throws", "[coco]") {
  using Catch::Matchers::Contains;
  const Rle a = rle_from_counts({2, 2}, 2, 2), b = rle_from_counts({4}, 4, 1);
  CHECK_THROWS_WITH(rle_merge({a, b}), Contains("different sizes"));
  CHECK_THROWS_WITH(rle_merge({a, a, b}, true), Contains("different sizes"));
  CHECK(rle_merge({}) == Rle{});
  CHECK(rle_merge({a}) == a);
}

TEST_CASE("coco polygons that pycocotools cannot take throw, and odd ones lose their last value", "[coco]") {
  using Catch::Matchers::Contains;
  // an odd last value is ignored, as frPoly's int(len / 2) points
  CHECK(rle_from_polygon({1, 1, 5, 5, 3, 8, 2}, 10, 10) == rle_from_polygon({1, 1, 5, 5, 3, 8}, 10, 10));
  CHECK(rle_from_polygons({{1, 1, 5, 5, 3, 8, 9}, {1, 1, 2}}, 10, 10) ==
        rle_merge({rle_from_polygon({1, 1, 5, 5, 3, 8}, 10, 10), rle_from_polygon({1, 1}, 10, 10)}));
  CHECK_THROWS_WITH(rle_from_polygons({}, 10, 10), Contains("no polygons"));
  // frPyObjects reads a 4-value first polygon as boxes (and fails), a shorter one it rejects
  CHECK_THROWS_WITH(rle_from_polygons({{1, 1, 5, 5}}, 10, 10), Contains("first polygon"));
  CHECK_THROWS_WITH(rle_from_polygons({{1, 1}, {1, 1, 5, 5, 3, 8}}, 10, 10), Contains("first polygon"));
  CHECK_THROWS_WITH(rle_from_polygon({1, 1, 5, 5, std::nan(""), 8}, 10, 10), Contains("out of range"));
  CHECK_THROWS_WITH(rle_from_polygon({1, 1, 5e9, 5, 3, 8}, 10, 10), Contains("out of range"));
  CHECK_THROWS_AS(rle_from_bbox({0, 0, 1e300, 1}, 10, 10), std::invalid_argument);
  // short polygons are what rleFrPoly makes of them: nothing
  CHECK(rle_from_polygon({}, 3, 4).counts == std::vector<uint32_t>{12});
  CHECK(rle_from_polygon({1, 1}, 3, 4).counts == std::vector<uint32_t>{12});
  CHECK(rle_from_polygon({1, 1, 5, 5, 3, 8}, 0, 4).counts == std::vector<uint32_t>{0});
}

TEST_CASE("coco iou with a wrong iscrowd length throws", "[coco]") {
  const Rle a = rle_from_counts({2, 2}, 2, 2);
  double o[2];
  CHECK_THROWS_AS(rle_iou({a}, {a, a}, {1}, o), std::invalid_argument);
  CHECK_THROWS_AS(bbox_iou({Box{0, 0, 1, 1}}, {Box{0, 0, 1, 1}}, {1, 0}, o), std::invalid_argument);
  rle_iou({a}, {a, a}, {}, o);  // empty iscrowd: no crowd
  CHECK(o[0] == 1.0);
  CHECK(o[1] == 1.0);
}

TEST_CASE("coco rle iou walks runs and never decodes", "[coco]") {
  // 60000 x 60000 = 3.6e9 pixels: a dense decode would need 3.6 GB per mask; the run walk needs
  // a few runs per column of the box.
  const uint32_t n = 60000;
  const Box ba{0, 0, 30000, 30000}, bb{15000, 15000, 30000, 30000}, bc{40000, 0, 100, 60000};
  const std::vector<Rle> dt = {rle_from_bbox(ba, n, n), rle_from_bbox(bc, n, n)};
  const std::vector<Rle> gt = {rle_from_bbox(bb, n, n), rle_from_bbox(ba, n, n)};
  CHECK(rle_area(dt[0]) == 30000ull * 30000ull);
  const Box got = rle_to_bbox(dt[0]);
  CHECK((got[0] == 0 && got[1] == 0 && got[2] == 30000 && got[3] == 30000));
  double o[4], ob[4];
  rle_iou(dt, gt, {0, 1}, o);  // (speed is a benchmark's business; this only shows it works at this size)
  bbox_iou({ba, bc}, {bb, ba}, {0, 1}, ob);
  for (int k = 0; k < 4; k++) CHECK(bits(o[k]) == bits(ob[k]));  // integer boxes: the same arithmetic
  CHECK(o[0] == 15000.0 * 15000.0 / (2 * 30000.0 * 30000.0 - 15000.0 * 15000.0));
  CHECK(o[1] == 1.0);
  CHECK(o[2] == 100.0 * 30000.0 / (100.0 * 60000.0 + 30000.0 * 30000.0 - 100.0 * 30000.0));
  CHECK(o[3] == 0.0);
}
