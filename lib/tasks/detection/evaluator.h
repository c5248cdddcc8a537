// The detection task's Evaluator: per image, the model's detections (in the original image's
// pixels, as torchvision's postprocess leaves them) become COCO results (xywh boxes, json
// category ids, masks as RLE); after the pass every rank's results are gathered, each image kept
// once (sharded evaluation leaves no duplicates; a padded one would be dropped here as
// torchvision's merge does), and scored by the C++ COCOeval against the gt json (bbox, and segm
// when the model predicts masks). summarize() reports COCOeval's 12 stats per iou type, in percent
// like Detectron2: bbox_AP, bbox_AP50, bbox_AP75, bbox_APs, bbox_APm, bbox_APl, then segm_*
// (-1 where COCOeval has no gt to score, e.g. no small objects).
#pragma once
#include "data/coco_detection.h"
#include "engine/task.h"
#include "tasks/detection/coco_eval.h"

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace imgtrain::tasks {

// The evaluation forward's outputs for a batch of B images, by name: "boxes" float [N, 4]
// (x1, y1, x2, y2), "scores" [N], "labels" int64 [N] and "counts" int64 [B] (detections per
// image, in batch order); with masks, "masks" float or uint8 [N, H, W] per image is passed as
// "masks.<i>" (i the image's place in the batch), thresholded at 0.5 as torchvision's
// prepare_for_coco_segmentation does.
class CocoEvaluator : public engine::Evaluator {
 public:
  CocoEvaluator(std::shared_ptr<const data::CocoDetection> ds, dist::Context* ctx, bool segm,
                std::string results_path = "");

  void update(const engine::EvalOutputs& out, const data::Batch& batch) override;
  void sync() override;
  engine::NamedValues summarize() const override;
  std::string progress(bool validate_style) const override;
  int64_t count() const override { return int64_t(images_.size()); }
  std::string summary_line() const override;
  engine::NamedValues result_fields() const override { return summarize(); }

  const std::vector<coco::Detection>& detections() const { return dets_; }
  // The printed COCOeval summaries (12 lines per iou type), after sync().
  const std::string& report() const { return report_; }

  static std::vector<std::string> metric_names(bool segm);

 private:
  std::shared_ptr<const data::CocoDetection> ds_;
  dist::Context* ctx_;
  bool segm_;
  std::string results_path_;
  std::vector<coco::Detection> dets_;
  std::set<int64_t> images_;  // ids of the images evaluated (this rank's until sync)
  int64_t batches_ = 0;
  engine::NamedValues stats_;
  std::string report_;
};

// The boxes of one image's detections in COCO's xywh (torchvision's convert_to_xywh).
coco::Box to_xywh(const float* xyxy);

// Serialises detections for the gather (and reads them back): a compact binary form.
std::string pack_detections(const std::vector<coco::Detection>& d);
// `used`, when given, receives the bytes read (what follows is the caller's).
std::vector<coco::Detection> unpack_detections(const std::string& bytes, size_t* used = nullptr);

}  // namespace imgtrain::tasks
