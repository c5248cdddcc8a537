// The COCO reader and evaluator against pycocotools (make_coco_eval_refs.py): the 12 stats and the
// full precision / recall / scores arrays must be equal, not close. Plus the reader on bad files.
#include "data/coco.h"
#include "tasks/detection/coco_eval.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>

using namespace imgtrain;

namespace {

std::vector<double> read_f64(const std::string& path) {
  const std::string bytes = test::read_file(path);
  REQUIRE(!bytes.empty());
  REQUIRE(bytes.size() % 8 == 0);
  std::vector<double> v(bytes.size() / 8);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

// Equal to 1e-12 (exact expected): counts the entries that differ, reports the first.
void check_equal(const std::string& what, const std::vector<double>& ours, const std::vector<double>& ref) {
  INFO(what);
  REQUIRE(ours.size() == ref.size());
  size_t bad = 0, first = 0, exact = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool both_nan = std::isnan(ours[i]) && std::isnan(ref[i]);
    if (both_nan || ours[i] == ref[i]) ++exact;
    if (!both_nan && !(std::abs(ours[i] - ref[i]) <= 1e-12)) {
      if (!bad) first = i;
      ++bad;
    }
  }
  INFO("first difference at " << first << ": ours " << ours[first] << " pycocotools " << ref[first]);
  CHECK(bad == 0);
  CHECK(exact == ref.size());
}

void check_case(const std::string& name, const std::string& dt_file, coco::IouType type) {
  const std::string dir = std::string(IMGTRAIN_PARITY_DIR) + "/coco_eval";
  coco::LoadOptions lo;
  lo.keep_degenerate_boxes = true;  // pycocotools keeps every box
  auto gt = coco::load_dataset(dir + "/gt.json", lo);
  CHECK(gt.skipped == 0);
  auto dt = coco::load_results(gt, dir + "/" + dt_file);
  CHECK(dt.skipped == 0);
  coco::EvalParams p;
  p.iou_type = type;
  auto r = coco::evaluate(gt, dt, p);
  const auto shapes = nlohmann::json::parse(test::read_file(dir + "/shapes.json"))[name];
  CHECK(shapes["iou_thrs"].get<std::vector<double>>() == r.params.iou_thrs);
  CHECK(shapes["rec_thrs"].get<std::vector<double>>() == r.params.rec_thrs);
  CHECK(shapes["precision"].get<std::vector<size_t>>() == std::vector<size_t>{r.T, r.R, r.K, r.A, r.M});
  check_equal(name + " stats", std::vector<double>(r.stats.begin(), r.stats.end()), read_f64(dir + "/" + name + "_stats.bin"));
  check_equal(name + " precision", r.precision, read_f64(dir + "/" + name + "_precision.bin"));
  check_equal(name + " recall", r.recall, read_f64(dir + "/" + name + "_recall.bin"));
  check_equal(name + " scores", r.scores, read_f64(dir + "/" + name + "_scores.bin"));
  check_equal(name + " per-category AP", r.per_category_ap, read_f64(dir + "/" + name + "_percat.bin"));
  CHECK(coco::format_summary(r) == test::read_file(dir + "/" + name + "_summary.txt"));

  // one thread and many give the same bits
  p.threads = 1;
  auto r1 = coco::evaluate(gt, dt, p);
  p.threads = 7;
  auto r7 = coco::evaluate(gt, dt, p);
  CHECK(std::memcmp(r1.precision.data(), r7.precision.data(), r1.precision.size() * 8) == 0);
  CHECK(std::memcmp(r1.precision.data(), r.precision.data(), r1.precision.size() * 8) == 0);
  CHECK(std::memcmp(r1.scores.data(), r7.scores.data(), r1.scores.size() * 8) == 0);
  CHECK(std::memcmp(r1.recall.data(), r7.recall.data(), r1.recall.size() * 8) == 0);
}

}  // namespace

TEST_CASE("COCOeval bbox equals pycocotools", "[parity][coco]") {
  check_case("bbox", "dt_bbox.json", coco::IouType::bbox);
}

TEST_CASE("COCOeval segm equals pycocotools", "[parity][coco]") {
  check_case("segm", "dt_segm.json", coco::IouType::segm);
}

TEST_CASE("COCOeval segm of box results equals pycocotools", "[parity][coco]") {
  check_case("segm_boxres", "dt_bbox.json", coco::IouType::segm);
}

TEST_CASE("numpy mean by pairwise summation", "[parity][coco]") {
  const auto v = read_f64(std::string(IMGTRAIN_PARITY_DIR) + "/coco_eval/mean_check.bin");
  size_t i = 0, arrays = 0;
  while (i < v.size()) {
    const size_t n = size_t(v[i]);
    REQUIRE(i + 1 + n < v.size());
    INFO("n = " << n);
    CHECK(coco::numpy_mean(&v[i + 1], n) == v[i + 1 + n]);
    i += n + 2;
    ++arrays;
  }
  CHECK(arrays == 13);
}

namespace {

const char* kImages = R"("images": [{"id": 1, "file_name": "a.jpg", "height": 10, "width": 20},
                                    {"id": 2, "file_name": "b.jpg", "height": 8, "width": 8}])";
const char* kCats = R"("categories": [{"id": 1, "name": "one"}, {"id": 2, "name": "two"}])";

std::string write(const test::TempDir& tmp, const std::string& name, const std::string& text) {
  test::write_file(tmp / name, text);
  return tmp / name;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("COCO reader rejects broken files with one clear line", "[coco]") {
  test::TempDir tmp("coco");
  auto load = [&](const std::string& name, const std::string& text) {
    const std::string path = write(tmp, name, text);
    return error_of([&] { coco::load_dataset(path); });
  };
  std::string e = load("invalid.json", R"({"images": [}, )");
  CHECK(has(e, "invalid.json"));
  CHECK(has(e, "invalid JSON"));
  CHECK(e.find('\n') == std::string::npos);

  e = load("nokeys.json", std::string("{") + kImages + ", " + kCats + "}");
  CHECK(has(e, "nokeys.json"));
  CHECK(has(e, "\"annotations\""));

  e = load("wrongtype.json", std::string("{\"images\": {}, \"annotations\": [], ") + kCats + "}");
  CHECK(has(e, "\"images\" is not a list"));
  e = load("wrongscalar.json", std::string("{") + kImages + ", \"annotations\": 3, " + kCats + "}");
  CHECK(has(e, "\"annotations\" is not a list"));
  e = load("toplist.json", "[1, 2]");
  CHECK(has(e, "top level is not an object"));
  e = load("empty.json", "");
  CHECK(has(e, "invalid JSON"));
  e = error_of([&] { coco::load_dataset(tmp / "missing.json"); });
  CHECK(has(e, "missing.json"));
  CHECK(has(e, "cannot open"));
}

TEST_CASE("COCO reader counts and skips bad annotations", "[coco]") {
  test::TempDir tmp("coco");
  const std::string anns = R"("annotations": [
    {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0,
     "segmentation": [[1, 1, 5, 1, 5, 5, 1, 5]]},
    {"id": 2, "image_id": 99, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0},
    {"id": 3, "image_id": 1, "category_id": 42, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0},
    {"id": 4, "image_id": 1, "category_id": 1, "bbox": [1, 1, 0, 4], "area": 16, "iscrowd": 0},
    {"id": 5, "image_id": 1, "category_id": 1, "bbox": [1, 1, -2, 4], "area": 16, "iscrowd": 0},
    {"id": 6, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4], "area": 16, "iscrowd": 0},
    {"id": 7, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0,
     "segmentation": [[1, 1, 5, 1, 5]]},
    {"id": 8, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 1,
     "segmentation": {"size": [10, 20], "counts": [5, 10, 3]}},
    {"id": 9, "image_id": 2, "category_id": 2, "bbox": [0, 0, 2, 2], "area": 4, "iscrowd": 1,
     "segmentation": {"size": [8, 8], "counts": [10, 4, 50]}},
    {"id": 10, "image_id": 2, "category_id": 2, "bbox": [0, 0, 2, 2], "iscrowd": 0},
    {"image_id": 2, "category_id": 2, "bbox": [0, 0, 2, 2], "area": 4},
    {"id": 12, "image_id": 2, "category_id": 2, "bbox": [0, 0, 2, "x"], "area": 4},
    {"id": 13, "image_id": 1, "category_id": 2, "bbox": [0, 0, 2, 2], "area": 4,
     "segmentation": {"size": [8, 8], "counts": [10, 4, 50]}},
    "not an object",
    {"id": 14, "image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5], "area": 9,
     "segmentation": [[1, 1, 2, 2], [0, 0, 4, 0, 4, 4]]}])";
  const std::string path = write(tmp, "anns.json", std::string("{") + kImages + ", " + anns + ", " + kCats + "}");
  coco::Dataset d;
  REQUIRE_NOTHROW(d = coco::load_dataset(path));
  std::vector<int64_t> ids;
  for (auto& a : d.annotations) ids.push_back(a.id);
  // 7 (odd polygon: truncated as pycocotools), 8 (bad RLE) and 13 (RLE of another size) keep their
  // boxes: pycocotools' bbox evaluation never reads the segmentation
  CHECK(ids == std::vector<int64_t>{1, 7, 8, 9, 10, 13, 14});
  CHECK(d.skipped == 8);
  std::string all;
  for (auto& w : d.warnings) all += w + "\n";
  INFO(all);
  CHECK(has(all, "anns.json: 1 annotation skipped: unknown image_id (id 2 (image_id 99))"));
  CHECK(has(all, "unknown category_id (id 3"));
  CHECK(has(all, "2 annotations skipped: empty box (w or h <= 0) (id 4, id 5)"));
  CHECK(has(all, "no bbox of 4 finite numbers (id 6, id 12)"));
  CHECK(has(all, "odd number of coordinates: the last one ignored, as pycocotools (id 7)"));
  CHECK(has(all, "1 annotation kept without their segmentation (a bad RLE; segm scores an empty mask) (id 8"));
  CHECK(has(all, "no integer id (#10, #13)"));
  CHECK(has(all, "an RLE whose size differs from the image size; segm scores an empty mask) (id 13)"));
  CHECK(has(all, "without a numeric area: w*h used (id 10)"));
  CHECK(has(all, "first polygon has under 3 points (pycocotools cannot rasterise them) (id 14)"));
  // its mask comes from the polygons of 3+ points
  CHECK(coco::ann_to_rle(d.annotations[6], 10, 20) == coco::rle_from_polygon({0, 0, 4, 0, 4, 4}, 10, 20));
  CHECK(d.annotations[4].area == 4);
  CHECK(d.annotations[3].iscrowd);
  CHECK(d.annotations[3].seg == coco::SegKind::rle);
  CHECK(d.annotations[1].polygons == std::vector<std::vector<double>>{{1, 1, 5, 1, 5}});  // kept; frPoly ignores the 5th
  CHECK(d.annotations[2].iscrowd);  // the crowd with a bad RLE is still an ignore region for boxes
  CHECK(d.annotations[2].seg == coco::SegKind::none);
  CHECK(d.annotations[5].seg == coco::SegKind::none);
  CHECK(d.annotations[0].seg == coco::SegKind::polygons);
  CHECK(d.image_annotations(2).size() == 2);
  CHECK(d.image_annotations(1).size() == 5);
  CHECK(d.image_annotations(77).empty());
  REQUIRE(d.category(2) != nullptr);
  CHECK(d.category(2)->name == "two");
  CHECK(d.image(1)->file_name == "a.jpg");

  // pycocotools keeps empty boxes; the evaluator's reading does too
  coco::LoadOptions keep;
  keep.keep_degenerate_boxes = true;
  auto k = coco::load_dataset(path, keep);
  CHECK(k.annotations.size() == 9);
  CHECK(k.skipped == 6);
}

TEST_CASE("COCO results load as loadRes reads them", "[coco]") {
  test::TempDir tmp("coco");
  const std::string gt_path = write(tmp, "gt.json", std::string("{") + kImages + R"(, "annotations": [
    {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0}], )" + kCats + "}");
  auto gt = coco::load_dataset(gt_path);
  auto res = [&](const std::string& name, const std::string& text) {
    const std::string path = write(tmp, name, text);
    return error_of([&] { coco::load_results(gt, path); });
  };
  std::string e = res("empty.json", "[]");
  CHECK(has(e, "empty.json"));
  CHECK(has(e, "empty"));
  e = res("foreign.json", R"([{"image_id": 1, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5},
                              {"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5}])");
  CHECK(has(e, "not in the ground truth"));
  CHECK(has(e, "image ids 5"));
  e = res("obj.json", "{}");
  CHECK(has(e, "top level is not a list"));
  e = res("neither.json", R"([{"image_id": 1, "category_id": 1, "score": 0.5}])");
  CHECK(has(e, "neither"));

  const std::string ok = write(tmp, "ok.json", R"([
    {"image_id": 1, "category_id": 1, "bbox": [1.5, 2, 3, 4], "score": 0.9},
    {"image_id": 2, "category_id": 2, "bbox": [0, 0, 2, 2]},
    {"image_id": 2, "category_id": 7, "bbox": [0, 0, 2, 5], "score": 0.1}])");
  auto dt = coco::load_results(gt, ok);
  REQUIRE(dt.annotations.size() == 2);
  CHECK(dt.skipped == 1);
  CHECK(dt.annotations[0].id == 1);
  CHECK(dt.annotations[1].id == 2);
  CHECK(dt.annotations[0].area == 12);
  CHECK(dt.annotations[0].seg == coco::SegKind::box);
  CHECK(!dt.annotations[0].iscrowd);
  CHECK(dt.images.size() == gt.images.size());

  // what write_results_json writes reads back the same
  std::vector<coco::Detection> dets(2);
  dets[0] = {1, 1, {0.1, 0.2, 3.3000000000000003, 4}, 0.123456789, false, {}};
  dets[1] = {2, 2, {1, 2, 3, 4}, 1e-7, false, {}};
  const std::string back = tmp / "back.json";
  coco::write_results_json(back, dets);
  auto rd = coco::load_results(gt, back);
  REQUIRE(rd.annotations.size() == 2);
  CHECK(rd.annotations[0].bbox == coco::Box{0.1, 0.2, 3.3000000000000003, 4});
  CHECK(rd.annotations[0].score == 0.123456789);
  CHECK(rd.annotations[1].score == 1e-7);
  CHECK(rd.annotations[1].image_id == 2);
}

TEST_CASE("COCOeval scores perfect detections as 1", "[coco]") {
  test::TempDir tmp("coco");
  const std::string gt_path = write(tmp, "gt.json", std::string("{") + kImages + R"(, "annotations": [
    {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "area": 16, "iscrowd": 0},
    {"id": 2, "image_id": 2, "category_id": 2, "bbox": [0, 0, 8, 8], "area": 64, "iscrowd": 0}], )" + kCats + "}");
  auto gt = coco::load_dataset(gt_path);
  std::vector<coco::Detection> dets(3);
  dets[0] = {1, 1, {1, 1, 4, 4}, 0.9, false, {}};
  dets[1] = {2, 2, {0, 0, 8, 8}, 0.8, false, {}};
  dets[2] = {2, 1, {0, 0, 2, 2}, 0.1, false, {}};  // a false positive, ranked last
  coco::write_results_json(tmp / "dt.json", dets);
  auto r = coco::evaluate(gt, coco::load_results(gt, tmp / "dt.json"));
  // not exactly 1: one detection's precision is 1 / (1 + np.spacing(1)), as in pycocotools
  CHECK(r.stats[0] == Approx(1.0));
  CHECK(r.stats[1] == Approx(1.0));
  CHECK(r.stats[3] == Approx(1.0));  // both are small (area < 32²)
  CHECK(r.stats[4] == -1.0);         // no medium gt
  CHECK(r.stats[8] == 1.0);
  REQUIRE(r.per_category_ap.size() == 2);
  CHECK(r.per_category_ap[0] == Approx(1.0));
  CHECK(r.per_category_ap[1] == Approx(1.0));
  CHECK(has(coco::format_summary(r),
            " Average Precision  (AP) @[ IoU=0.50:0.95 | area=medium | maxDets=100 ] = -1.000\n"));
}
