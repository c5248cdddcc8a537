// COCO detection evaluation with pycocotools' COCOeval numbers, bit for bit (iouType bbox and
// segm, useCats=1, the default parameters): evaluateImg's greedy matching, accumulate's
// precision / recall / score arrays and summarize's 12 stats, computed in parallel over
// (image, category) cells and categories with results independent of the thread count.
// Plain C++ (no torch); namespace imgtrain::coco, next to the dataset reader.
#pragma once
#include "data/coco.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace imgtrain::coco {

enum class IouType { bbox, segm };

struct EvalParams {
  IouType iou_type = IouType::bbox;
  // Defaults are pycocotools' Params.setDetParams: iouThrs = np.linspace(.5, .95, 10) (its exact
  // doubles), recThrs = np.linspace(0, 1, 101), maxDets 1/10/100, area ranges all / small /
  // medium / large = [0, 1e10], [0, 32²], [32², 96²], [96², 1e10] (both ends inclusive).
  std::vector<double> iou_thrs = default_iou_thrs();
  std::vector<double> rec_thrs = default_rec_thrs();
  std::vector<int> max_dets = {1, 10, 100};
  std::vector<std::array<double, 2>> area_rng = {{0, 1e10}, {0, 1024}, {1024, 9216}, {9216, 1e10}};
  std::vector<std::string> area_lbl = {"all", "small", "medium", "large"};
  size_t threads = 0;  // 0: std::thread::hardware_concurrency()

  static std::vector<double> default_iou_thrs();
  static std::vector<double> default_rec_thrs();
};

struct EvalResult {
  IouType iou_type = IouType::bbox;
  EvalParams params;
  std::vector<int64_t> img_ids, cat_ids;  // sorted, as COCOeval's params (gt's images, categories)
  size_t T = 0, R = 0, K = 0, A = 0, M = 0;
  // C order, -1 where a setting has no gt (as eval['precision'], ['recall'], ['scores']).
  std::vector<double> precision;  // [T, R, K, A, M]
  std::vector<double> recall;     // [T, K, A, M]
  std::vector<double> scores;     // [T, R, K, A, M]
  std::array<double, 12> stats{};  // COCOeval.stats
  // detectron2's per-category AP: mean of precision[:, :, k, all, maxDets 100] over entries > -1;
  // NaN for a category without gt. In [0, 1] (detectron2 prints it * 100).
  std::vector<double> per_category_ap;

  double precision_at(size_t t, size_t r, size_t k, size_t a, size_t m) const {
    return precision[(((t * R + r) * K + k) * A + a) * M + m];
  }
  double recall_at(size_t t, size_t k, size_t a, size_t m) const { return recall[((t * K + k) * A + a) * M + m]; }
};

// evaluate() + accumulate() + summarize() of COCOeval(gt, dt, iouType). `dt` comes from
// load_results(gt, ...). For segm, masks are made as annToRLE makes them (ann_to_rle).
EvalResult evaluate(const Dataset& gt, const Dataset& dt, const EvalParams& params = {});

// The names of COCOeval.stats' 12 entries: AP, AP50, AP75, APs, APm, APl, AR1, AR10, AR100, ARs,
// ARm, ARl.
const std::array<const char*, 12>& stat_names();

// The 12 lines summarize() prints, each ending in '\n', e.g.
// " Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ] = 0.378".
std::string format_summary(const EvalResult& r);

// np.mean of the entries: numpy's pairwise summation (what COCOeval's np.mean does), / n.
double numpy_mean(const double* v, size_t n);

// A detection for a COCO results json (what loadRes reads back).
struct Detection {
  int64_t image_id = 0, category_id = 0;
  Box bbox{};  // x, y, w, h
  double score = 0;
  bool has_mask = false;
  Rle mask;    // written as compressed RLE {"size": [h, w], "counts": "..."} when has_mask
};
// Writes [{"image_id", "category_id", "bbox", "score"[, "segmentation"]}, ...] with numbers in
// their shortest round-trip form. Throws std::runtime_error when the file cannot be written.
void write_results_json(const std::string& path, const std::vector<Detection>& dets);
std::string results_json(const std::vector<Detection>& dets);

}  // namespace imgtrain::coco
