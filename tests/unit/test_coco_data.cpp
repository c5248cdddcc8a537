// COCO detection data: the training view of an instances json (torchvision's coco_utils rules),
// the standard layout, aspect-ratio grouping and the loader's detection batches.
#include "core/error.h"
#include "core/log.h"
#include "data/coco_detection.h"
#include "data/loader.h"
#include "tasks/detection/evaluator.h"
#include "two_ranks.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <torch/torch.h>

#include <fstream>
#include <set>

using namespace imgtrain;
using namespace imgtrain::data;

namespace {

std::string user_error(const std::function<void()>& f) { return test::error_text<UserError>(f); }

// A COCO folder: images 7 (60x40), 3 (30x50, grayscale), 5 (40x40, a crowd and a 1-px-wide box),
// 9 (20x20, no annotation), 4 (64x32); categories 90 "b" and 2 "a" (ids out of order).
struct CocoFolder {
  test::TempDir dir{"coco"};
  CocoFolder() {
    struct Im {
      int id, w, h;
      bool gray;
    };
    const std::vector<Im> ims = {{7, 60, 40, false}, {3, 30, 50, true}, {5, 40, 40, false}, {9, 20, 20, false},
                                 {4, 64, 32, false}};
    std::filesystem::create_directories(dir / "train2017");
    nlohmann::json j;
    j["categories"] = {{{"id", 90}, {"name", "b"}}, {{"id", 2}, {"name", "a"}}};
    for (auto& im : ims) {
      j["images"].push_back({{"id", im.id}, {"file_name", std::to_string(im.id) + ".png"}, {"width", im.w},
                             {"height", im.h}});
      cv::Mat m(im.h, im.w, im.gray ? CV_8UC1 : CV_8UC3, cv::Scalar(0, 0, 0));
      // a marker pixel at (x 2, y 1), to see flips
      if (im.gray) m.at<uint8_t>(1, 2) = 255;
      else m.at<cv::Vec3b>(1, 2) = {255, 255, 255};
      cv::imwrite(dir / ("train2017/" + std::to_string(im.id) + ".png"), m);
    }
    auto ann = [&](int id, int image, int cat, std::vector<double> box, int crowd = 0) {
      nlohmann::json a = {{"id", id}, {"image_id", image}, {"category_id", cat}, {"bbox", box}, {"iscrowd", crowd},
                          {"area", box[2] * box[3]}};
      const double x = box[0], y = box[1], x2 = box[0] + box[2], y2 = box[1] + box[3];
      if (crowd) a["segmentation"] = {{"counts", {0, 40 * 40}}, {"size", {40, 40}}};
      else a["segmentation"] = {{x, y, x2, y, x2, y2, x, y2}};
      j["annotations"].push_back(a);
    };
    ann(1, 7, 90, {2, 1, 10, 8});
    ann(2, 7, 2, {-5, 30, 20, 20});   // clamped to x 0..15, y 30..40
    ann(3, 7, 2, {70, 5, 4, 4});      // outside the image: zero width after clamping, dropped
    ann(4, 3, 2, {1, 1, 5, 5});
    ann(5, 5, 90, {0, 0, 40, 40}, 1);  // crowd
    ann(6, 5, 2, {3, 3, 1, 5});       // width 1: with the crowd, nothing usable
    ann(7, 4, 90, {0, 0, 64, 32});
    test::write_file(dir / "annotations/instances_train2017.json", j.dump());
  }
};

}  // namespace

TEST_CASE("COCO training view: torchvision's filtering, id order, contiguous labels and RLE masks", "[data][coco]") {
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {});
  // 9 (no annotation) is removed; 5 stays: its crowd's box counts as usable in torchvision's
  // _has_only_empty_bbox, though the crowd is no target. The rest in id order.
  REQUIRE(ds->size() == 4);
  CHECK(ds->removed_images() == 1);
  CHECK(ds->image_info(0).id == 3);
  CHECK(ds->image_info(1).id == 4);
  CHECK(ds->image_info(2).id == 5);
  CHECK(ds->image_info(3).id == 7);
  CHECK(ds->warnings().back().find("1 of 5 images have no usable annotation") != std::string::npos);
  // categories sorted by id: 2 -> 1, 90 -> 2; background 0
  CHECK(ds->num_classes() == 3);
  CHECK(ds->class_names() == std::vector<std::string>{"__background__", "a", "b"});
  CHECK(ds->category_of_label(1) == 2);
  CHECK(ds->category_of_label(2) == 90);
  CHECK(ds->category_of_label(0) == -1);
  CHECK(ds->label_of_category(90) == 2);

  auto t = ds->target(3);  // image 7
  CHECK(t.image_id == 7);
  REQUIRE(t.boxes.sizes() == at::IntArrayRef{2, 4});
  CHECK(torch::equal(t.boxes, torch::tensor({2.f, 1.f, 12.f, 9.f, 0.f, 30.f, 15.f, 40.f}).view({2, 4})));
  CHECK(torch::equal(t.labels, torch::tensor({2, 1}, torch::kLong)));
  REQUIRE(t.masks.size() == 2);
  CHECK(t.masks[0].h == 40);
  CHECK(t.masks[0].w == 60);
  CHECK(t.masks[0] == coco::ann_to_rle(ds->coco().annotations[0], 40, 60));
  CHECK(coco::rle_area(t.masks[0]) > 0);
  CHECK(ds->image_size(3) == cv::Size(60, 40));

  // evaluation keeps every image (crowds still left out of the targets); label = category id
  auto ev = open_coco(f.dir.path.string(), "train", "", {.train = false, .contiguous_labels = false, .masks = false});
  CHECK(ev->size() == 5);
  CHECK(ev->num_classes() == 91);
  CHECK(ev->category_of_label(90) == 90);
  CHECK(ev->category_of_label(3) == -1);
  auto crowd_only = ev->target(2);  // image 5: the crowd is dropped, the 1-px box stays (x2 > x1)
  CHECK(crowd_only.boxes.size(0) == 1);
  CHECK(crowd_only.masks.empty());
  CHECK(ev->target(4).boxes.sizes() == at::IntArrayRef{0, 4});  // image 9

  // an explicit (images, json) pair
  auto pair = open_coco("", f.dir / "train2017", f.dir / "annotations/instances_train2017.json", {});
  CHECK(pair->size() == 4);
  for (auto& w : pair->warnings()) CHECK(w.find("no segmentation") == std::string::npos);

  // annotations without a segmentation (no key; an empty list): counted where masks are trained
  auto j = nlohmann::json::parse(test::read_file(f.dir / "annotations/instances_train2017.json"));
  for (auto& a : j["annotations"]) {
    if (a["id"] == 4) a["segmentation"] = nlohmann::json::array();
    if (a["id"] == 7) a.erase("segmentation");
  }
  test::write_file(f.dir / "annotations/unmasked.json", j.dump());
  auto unmasked = open_coco("", f.dir / "train2017", f.dir / "annotations/unmasked.json", {});
  CHECK_THAT(unmasked->warnings().back(), Catch::Contains("2 annotation(s) have no segmentation") &&
                                              Catch::Contains("mask targets are empty (first: id 4)"));
  CHECK(coco::rle_area(unmasked->target(0).masks.at(0)) == 0);  // image 3's annotation 4
  auto boxes_only = open_coco("", f.dir / "train2017", f.dir / "annotations/unmasked.json", {.masks = false});
  for (auto& w : boxes_only->warnings()) CHECK(w.find("no segmentation") == std::string::npos);
}

TEST_CASE("a polygon far outside any image keeps its box and loses its mask, instead of stopping the evaluator",
          "[data][coco][fault]") {
  // found by fuzz_coco_json: the rasteriser refused the coordinate with an exception no caller expects
  const std::string gt = R"({"images": [{"id": 1, "file_name": "a.jpg", "height": 20, "width": 30}],
    "categories": [{"id": 1, "name": "x"}],
    "annotations": [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [2, 3, 10, 5], "area": 50, "iscrowd": 0,
                     "segmentation": [[2, 3, 1e100, 3, 12, 8, 2, 8]]}]})";
  const auto d = coco::parse_dataset(gt, "g.json");
  REQUIRE(d.annotations.size() == 1);
  CHECK(d.annotations[0].seg == coco::SegKind::none);
  REQUIRE_FALSE(d.warnings.empty());
  CHECK_THAT(d.warnings[0], Catch::Contains("beyond 1,000,000 pixels") && Catch::Contains("7"));
  CHECK(coco::rle_area(coco::ann_to_rle(d.annotations[0], 20, 30)) == 0);
  // found by fuzz_coco_json too: a box result far outside the image, made into a mask for segm
  // evaluation (pycocotools' rasteriser would cast it to an int: undefined): the reader's error
  // type with the reason, not the rasteriser's invalid_argument
  const auto res = coco::parse_results(
      d, R"([{"image_id": 1, "category_id": 1, "bbox": [2e42, 3, 9, 5], "score": 0.9},
             {"image_id": 1, "category_id": 1, "bbox": [2, 3, 9, 5], "score": 0.8}])", "r.json");
  REQUIRE(res.annotations.size() == 2);
  CHECK_THROWS_AS(coco::ann_to_rle(res.annotations[0], 20, 30), std::runtime_error);
  CHECK_THROWS_WITH(coco::ann_to_rle(res.annotations[0], 20, 30), Catch::Contains("beyond 100,000,000 pixels"));
  CHECK(coco::rle_area(coco::ann_to_rle(res.annotations[1], 20, 30)) > 0);
}

TEST_CASE("COCO layout errors name what was looked for", "[data][coco]") {
  CocoFolder f;
  auto msg = user_error([&] { open_coco(f.dir.path.string(), "val", "", {}); });
  CHECK(msg.find("COCO split 'val'") != std::string::npos);
  CHECK(msg.find("instances_val2017.json") != std::string::npos);
  CHECK(user_error([&] { open_coco("", "x", "", {}); }).find("--data-dir is required") != std::string::npos);
  CHECK(user_error([&] { open_coco(f.dir.path.string(), "train2017", f.dir / "nope.json", {}); })
            .find("no such file") != std::string::npos);
  test::write_file(f.dir / "broken.json", "{\"images\": [");
  auto broken = user_error([&] { open_coco(f.dir.path.string(), "train2017", f.dir / "broken.json", {}); });
  CHECK(broken.find("broken.json") != std::string::npos);
  CHECK(broken.find('\n') == std::string::npos);
}

TEST_CASE("aspect-ratio groups: torchvision's bins and Detectron2's two buckets", "[data][coco]") {
  // k = 3: bins 2^linspace(-1, 1, 7) = 0.5, 0.63, 0.79, 1, 1.26, 1.59, 2; bisect_right
  CHECK(quantize_aspect_ratios({0.4, 0.5, 0.7, 1.0, 1.333, 1.5, 2.0, 3.0}, 3) ==
        std::vector<int64_t>{0, 1, 2, 4, 5, 5, 7, 7});
  CHECK(quantize_aspect_ratios({0.99, 1.0, 1.01}, 0) == std::vector<int64_t>{0, 1, 1});
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  // widths/heights: 30x50, 64x32, 40x40, 60x40, 20x20 (id order 3, 4, 5, 7, 9)
  CHECK(aspect_ratio_groups(*ds, 0, true) == std::vector<int64_t>{1, 0, 1, 0, 1});
  CHECK(aspect_ratio_groups(*ds, 0) == std::vector<int64_t>{0, 1, 1, 1, 1});
}

TEST_CASE("grouped batches: one group per batch, the stream's order, len(order) / batch full batches", "[data][coco]") {
  // groups: even indices 0, odd 1
  std::vector<int64_t> groups(10);
  for (size_t i = 0; i < groups.size(); ++i) groups[i] = int64_t(i % 2);
  // 0 2 | 1 3 | 4 6 | 5 7 yielded as they fill; 8 (group 0) and 9 (group 1) are left and one more
  // batch is due: equal sizes, so the buffer first in dict order (group 0, re-created right after
  // its last yield, before group 1's) is completed with its group's first sample
  CHECK(grouped_batches({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, groups, 2) == std::vector<int64_t>{0, 2, 1, 3, 4, 6, 5, 7, 8, 0});
  // the fuller buffer first
  CHECK(grouped_batches({1, 0, 2}, {0, 1, 0}, 3) == std::vector<int64_t>{0, 2, 0});
  // a group smaller than what is missing repeats itself
  CHECK(grouped_batches({0, 1}, {0, 1}, 2) == std::vector<int64_t>{0, 0});
  CHECK(grouped_batches({0, 1}, {0, 1}, 3).empty());
}

TEST_CASE("loader: detection batches of whole images, flipped with their targets, grouped and sharded", "[data][coco]") {
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  TransformConfig tc;
  tc.train = true;
  tc.hflip = 1.0;  // always flip: the marker pixel and boxes must move together
  tc.min_sizes = {640, 672, 704};
  LoaderOptions lo;
  lo.batch_size = 2;
  lo.workers = 0;
  lo.shuffle = false;
  Loader l(ds, tc, lo);
  l.start_epoch(0);
  REQUIRE(l.num_batches() == 3);
  auto b = l.next();
  REQUIRE(b);
  // images 3 (30x50, gray -> RGB) and 4 (64x32): padded to 64x64
  CHECK(b->images.sizes() == at::IntArrayRef{2, 64, 64, 3});
  CHECK(torch::equal(b->sizes, torch::tensor({50, 30, 32, 64}, torch::kLong).view({2, 2})));
  CHECK(b->images[0][1][30 - 1 - 2][1].item<int>() == 255);  // gray expanded, mirrored
  CHECK(b->images[1][1][64 - 1 - 2][0].item<int>() == 255);
  REQUIRE(b->targets.size() == 2);
  CHECK(torch::equal(b->targets[0].boxes, torch::tensor({24.f, 1.f, 29.f, 6.f}).view({1, 4})));
  CHECK(b->targets[0].masks[0] == rle_hflip(ds->target(0).masks[0]));
  CHECK(b->targets[0].image_id == 3);
  for (auto& t : b->targets) CHECK((t.min_size == 640 || t.min_size == 672 || t.min_size == 704));
  CHECK(torch::equal(b->indices, torch::tensor({0, 1}, torch::kLong)));

  // the same batches for any thread count
  lo.workers = 3;
  lo.shuffle = true;
  Loader a(ds, tc, lo), c(ds, tc, [&] { auto o = lo; o.workers = 1; return o; }());
  a.start_epoch(4);
  c.start_epoch(4);
  for (size_t i = 0; i < a.num_batches(); ++i) {
    auto x = a.next(), y = c.next();
    CHECK(torch::equal(x->images, y->images));
    CHECK(torch::equal(x->indices, y->indices));
    for (size_t k = 0; k < x->targets.size(); ++k) CHECK(x->targets[k].min_size == y->targets[k].min_size);
  }

  // grouped (two buckets): every batch one bucket; 2 ranks make equal steps
  lo.two_bucket_grouping = true;
  const auto groups = aspect_ratio_groups(*ds, 0, true);
  for (auto [world, bs] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 1}}) {
    std::vector<size_t> steps;
    lo.batch_size = bs;
    for (int64_t r = 0; r < world; ++r) {
      lo.rank = r;
      lo.world = world;
      Loader g(ds, tc, lo);
      g.start_epoch(1);
      steps.push_back(g.num_batches());
      size_t seen = 0;
      while (auto gb = g.next()) {
        std::set<int64_t> gs;
        for (int64_t k = 0; k < gb->indices.size(0); ++k) gs.insert(groups[size_t(gb->indices[k].item<int64_t>())]);
        CHECK(gs.size() == 1);
        CHECK(gb->indices.size(0) == bs);
        ++seen;
      }
      CHECK(seen == g.num_batches());
    }
    CHECK(steps == (world == 1 ? std::vector<size_t>{2} : std::vector<size_t>{3, 3}));
  }

  // sharded evaluation: ranks disjoint and covering, no duplicate (5 images over 2 ranks: 3 + 2)
  TransformConfig ec;
  LoaderOptions eo;
  eo.batch_size = 2;
  eo.workers = 0;
  eo.pad_shares = false;
  std::multiset<int64_t> all;
  for (int64_t r = 0; r < 2; ++r) {
    eo.rank = r;
    eo.world = 2;
    Loader e(ds, ec, eo);
    e.start_epoch(0);
    CHECK(e.num_batches() == size_t(r == 0 ? 2 : 1));
    while (auto eb = e.next())
      for (auto& t : eb->targets) {
        all.insert(t.image_id);
        CHECK(t.min_size == 0);
      }
  }
  CHECK(all == std::multiset<int64_t>{3, 4, 5, 7, 9});
}

TEST_CASE("loader: large-scale jitter gives size x size images whose boxes and masks stay inside", "[data][coco]") {
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  TransformConfig tc;
  tc.train = true;
  tc.lsj_size = 48;
  tc.lsj_scale = {0.3, 2.0};
  LoaderOptions lo;
  lo.batch_size = 2;
  lo.workers = 0;
  lo.shuffle = true;
  Loader l(ds, tc, lo);
  int64_t boxes = 0;
  std::set<int64_t> corner;  // the bottom-right pixel: padded (the fill) in some draws, not in others
  for (int64_t epoch = 0; epoch < 6; ++epoch) {
    l.start_epoch(epoch);
    while (auto b = l.next()) {
      const int64_t n = b->images.size(0);
      CHECK(b->images.sizes() == at::IntArrayRef{n, 64, 64, 3});  // 48 x 48, padded to 32's multiples
      CHECK(torch::equal(b->sizes, torch::full({n, 2}, 48, torch::kLong)));
      for (int64_t k = 0; k < n; ++k) corner.insert(b->images[k][47][47][0].item<int64_t>());
      for (auto& t : b->targets) {
        REQUIRE(int64_t(t.masks.size()) == t.boxes.size(0));
        REQUIRE(t.labels.size(0) == t.boxes.size(0));
        boxes += t.boxes.size(0);
        if (!t.boxes.size(0)) continue;
        CHECK(t.boxes.min().item<float>() >= 0.f);
        CHECK(t.boxes.max().item<float>() <= 48.f);
        for (auto& m : t.masks) CHECK((m.h == 48 && m.w == 48));
      }
    }
  }
  CHECK(boxes > 0);
  CHECK(corner.count(123) == 1);
  CHECK(corner.size() > 1);
}

TEST_CASE("an unreadable COCO image is skipped and counted", "[data][coco]") {
  CocoFolder f;
  std::filesystem::remove(f.dir / "train2017/4.png");
  auto ds = open_coco(f.dir.path.string(), "train", "", {});
  LoaderOptions lo;
  lo.batch_size = 3;
  lo.workers = 0;
  Loader l(ds, TransformConfig{}, lo);
  l.start_epoch(0);
  auto b = l.next();
  REQUIRE(b);
  CHECK(l.skipped_this_epoch() == 1);
  CHECK(b->targets.size() == 2);
  CHECK(b->images.size(0) == 2);
}

TEST_CASE("a COCO image whose annotations give another size: the target fits the decoded image, warned once",
          "[data][coco]") {
  CocoFolder f;
  // image 7's annotations say 60x40; the file is 80x50 (torchvision's ConvertCocoPolysToMask clamps
  // to and rasterises at the decoded image's size)
  cv::imwrite(f.dir / "train2017/7.png", cv::Mat(50, 80, CV_8UC3, cv::Scalar(0, 0, 0)));
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  REQUIRE(ds->image_size(0) == cv::Size(30, 50));  // id order 3, 4, 5, 7, 9
  REQUIRE(ds->image_size(3) == cv::Size(60, 40));
  CHECK(ds->target(3).boxes.size(0) == 2);  // the annotations' size: the box at x 70 is outside
  const auto t = ds->target(3, cv::Size(80, 50));
  CHECK(torch::equal(t.boxes, torch::tensor({2.f, 1.f, 12.f, 9.f, 0.f, 30.f, 15.f, 50.f, 70.f, 5.f, 74.f, 9.f}).view({3, 4})));
  REQUIRE(t.masks.size() == 3);
  CHECK((t.masks[0].h == 50 && t.masks[0].w == 80));
  test::TempDir logs("cocolog");
  log::set_file(logs / "log.txt");
  TransformConfig tc;
  tc.train = false;
  LoaderOptions lo;
  lo.batch_size = 1;
  lo.workers = 0;
  lo.shuffle = false;
  Loader l(ds, tc, lo);
  for (int epoch = 0; epoch < 2; ++epoch) {
    l.start_epoch(epoch);
    while (auto b = l.next())
      if (b->targets.at(0).image_id == 7) CHECK(torch::equal(b->targets[0].boxes, t.boxes));
  }
  log::set_file("");
  const auto text = test::read_file(logs / "log.txt");
  CHECK_THAT(text, Catch::Contains("7.png': the image is 80x50 but its annotations say 60x40"));
  CHECK(text.find("the image is") == text.rfind("the image is"));  // once, not every epoch
}

TEST_CASE("rle_hflip mirrors the mask", "[data][coco]") {
  std::vector<uint8_t> m(5 * 7, 0);  // column-major h 5, w 7
  m[0 * 5 + 1] = m[2 * 5 + 4] = m[6 * 5 + 0] = 1;
  auto r = rle_hflip(coco::rle_encode(m.data(), 5, 7));
  auto d = coco::rle_decode(r);
  for (int x = 0; x < 7; ++x)
    for (int y = 0; y < 5; ++y) CHECK(d[size_t(x * 5 + y)] == m[size_t((6 - x) * 5 + y)]);
}

namespace {
// Image sizes only: what the grouping and the sampler see.
class SizesOnly : public Dataset {
 public:
  explicit SizesOnly(std::vector<cv::Size> s) : s_(std::move(s)) {}
  size_t size() const override { return s_.size(); }
  int64_t label(size_t) const override { return 0; }
  cv::Mat image(size_t) const override { throw DecodeError("no pixels"); }
  std::string describe(size_t i) const override { return std::to_string(i); }
  bool has_targets() const override { return true; }
  cv::Size image_size(size_t i) const override { return s_[i]; }
  int64_t num_classes() const override { return 1; }
  std::vector<std::string> class_names() const override { return {"bg"}; }

 private:
  std::vector<cv::Size> s_;
};
}  // namespace

TEST_CASE("grouped batching equals torchvision's GroupedBatchSampler over DistributedSampler", "[data][coco][parity]") {
  // Golden batches from torchvision's references/detection/group_by_aspect_ratio.py
  // (tests/parity/make_grouped_refs.py says how they were made).
  std::ifstream f(std::string(IMGTRAIN_SOURCE_DIR) + "/tests/data/grouped_batches.json");
  REQUIRE(f);
  const auto j = nlohmann::json::parse(f);
  REQUIRE(j["cases"].size() == 6);
  for (const auto& c : j["cases"]) {
    std::vector<cv::Size> sizes;
    for (auto& hw : c["hw"]) sizes.emplace_back(hw[1].get<int>(), hw[0].get<int>());
    auto ds = std::make_shared<SizesOnly>(sizes);
    const int64_t k = c["k"], bs = c["batch_size"], world = c["world"], epoch = c["epoch"];
    INFO("n " << sizes.size() << " k " << k << " batch " << bs << " world " << world << " epoch " << epoch);
    CHECK(aspect_ratio_groups(*ds, k) == c["groups"].get<std::vector<int64_t>>());
    for (int64_t r = 0; r < world; ++r) {
      LoaderOptions lo;
      lo.batch_size = bs;
      lo.workers = 0;
      lo.shuffle = c["shuffle"];
      lo.seed = 42;
      lo.rank = r;
      lo.world = world;
      lo.aspect_ratio_group_factor = k;
      Loader l(ds, TransformConfig{}, lo);
      l.start_epoch(epoch);
      std::vector<int64_t> want;
      for (auto& b : c["batches"][size_t(r)])
        for (auto& i : b) want.push_back(i.get<int64_t>());
      CHECK(l.num_batches() == c["batches"][size_t(r)].size());
      CHECK(l.order() == want);
    }
  }
}

namespace {
// What a detector would output for a batch: every target box (shifted by half a pixel, score
// falling with its place) and its mask, plus one false positive of label 1 per image.
engine::EvalOutputs fake_detections(const Batch& b) {
  std::vector<at::Tensor> boxes, scores, labels;
  std::vector<int64_t> counts;
  engine::EvalOutputs o;
  for (size_t i = 0; i < b.targets.size(); ++i) {
    const auto& t = b.targets[i];
    const int64_t n = t.boxes.size(0);
    boxes.push_back(torch::cat({t.boxes + 0.5, torch::tensor({0.f, 0.f, 3.f, 3.f}).view({1, 4})}));
    scores.push_back(torch::cat({torch::linspace(0.9, 0.5, n), torch::tensor({0.3})}));
    labels.push_back(torch::cat({t.labels, torch::tensor({1}, torch::kLong)}));
    counts.push_back(n + 1);
    const int64_t h = b.sizes[int64_t(i)][0].item<int64_t>(), w = b.sizes[int64_t(i)][1].item<int64_t>();
    auto m = torch::zeros({n + 1, 1, h, w});
    if (n) m.narrow(0, 0, n).copy_(dense_masks(t).unsqueeze(1).to(torch::kFloat) * 0.9);
    o.tensors[fmt::format("masks.{}", i)] = m;
  }
  o.tensors["boxes"] = torch::cat(boxes);
  o.tensors["scores"] = torch::cat(scores);
  o.tensors["labels"] = torch::cat(labels);
  o.tensors["counts"] = torch::tensor(counts, torch::kLong);
  return o;
}

engine::NamedValues evaluate_shard(std::shared_ptr<CocoDetection> ds, dist::Context* ctx, bool pad,
                                   std::vector<coco::Detection>* dets = nullptr) {
  LoaderOptions lo;
  lo.batch_size = 2;
  lo.workers = 0;
  lo.pad_shares = pad;
  lo.rank = ctx ? ctx->rank() : 0;
  lo.world = ctx ? ctx->world() : 1;
  Loader l(ds, TransformConfig{}, lo);
  l.start_epoch(0);
  tasks::CocoEvaluator ev(ds, ctx, true);
  while (auto b = l.next()) ev.update(fake_detections(*b), *b);
  ev.sync();
  CHECK(ev.count() == 5);
  if (dets) *dets = ev.detections();
  return ev.summarize();
}
}  // namespace

TEST_CASE("COCO evaluator: the model's outputs as COCO results, scored as pycocotools would", "[data][coco]") {
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  std::vector<coco::Detection> dets;
  const auto stats = evaluate_shard(ds, nullptr, false, &dets);
  REQUIRE(stats.size() == 12);
  CHECK(stats[0].first == "bbox_AP");
  CHECK(stats[6].first == "segm_AP");
  // the same numbers as COCOeval over the results json of these detections
  const auto dt = coco::parse_results(ds->coco(), coco::results_json(dets), "dets");
  for (auto type : {coco::IouType::bbox, coco::IouType::segm}) {
    coco::EvalParams p;
    p.iou_type = type;
    const auto r = coco::evaluate(ds->coco(), dt, p);
    const size_t off = type == coco::IouType::bbox ? 0 : 6;
    for (size_t i = 0; i < 6; ++i) CHECK(stats[off + i].second == (r.stats[i] < 0 ? -1.0 : 100 * r.stats[i]));
  }
  // json category ids, xywh boxes: image 7's box (2, 1, 12, 9) of category 90, shifted by 0.5
  bool found = false;
  for (auto& d : dets)
    if (d.image_id == 7 && d.category_id == 90) {
      CHECK(d.bbox == coco::Box{2.5, 1.5, 10, 8});
      CHECK(d.has_mask);
      found = true;
    }
  CHECK(found);
  // half-pixel shifts miss the strict IoU thresholds on the small boxes: between 0 and 100
  CHECK(stats[0].second > 0.0);
  CHECK(stats[0].second < 100.0);

  // images seen but no detections at all: zeros, no crash; no image at all: -1 (no gt), as COCOeval
  tasks::CocoEvaluator empty(ds, nullptr, true);
  LoaderOptions lo;
  lo.workers = 0;
  Loader l(ds, TransformConfig{}, lo);
  l.start_epoch(0);
  while (auto b = l.next()) {
    engine::EvalOutputs o;
    o.tensors["boxes"] = torch::zeros({0, 4});
    o.tensors["scores"] = o.tensors["labels"] = torch::zeros({0});
    o.tensors["counts"] = torch::zeros({int64_t(b->targets.size())}, torch::kLong);
    for (size_t i = 0; i < b->targets.size(); ++i) o.tensors[fmt::format("masks.{}", i)] = torch::zeros({0, 1, 4, 4});
    empty.update(o, *b);
  }
  empty.sync();
  CHECK(empty.summarize()[0].second == 0.0);
  CHECK(empty.summarize()[6].second == 0.0);
  tasks::CocoEvaluator none(ds, nullptr, false);
  none.sync();
  CHECK(none.summarize()[0].second == -1.0);
}

TEST_CASE("COCO evaluation sharded over 2 ranks equals one process, with or without padded duplicates", "[dist][coco]") {
  CocoFolder f;
  auto ds = open_coco(f.dir.path.string(), "train", "", {.train = false});
  const auto one = evaluate_shard(ds, nullptr, false);
  for (bool pad : {false, true}) {
    std::vector<engine::NamedValues> got(2);
    test::two_ranks([&](int rank, dist::Context& ctx) { got[size_t(rank)] = evaluate_shard(ds, &ctx, pad); });
    CHECK(got[0] == one);
    CHECK(got[1] == one);
  }
}
