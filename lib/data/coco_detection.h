// COCO detection data for training and evaluation, as torchvision's detection reference reads it
// (references/detection/coco_utils.py): images in id order, crowd annotations left out of the
// training targets (the evaluator sees them as ignore regions through the gt json), boxes
// converted to x1y1x2y2 in float32 and clamped to the image, boxes without positive width and
// height dropped, and for training the images without a usable annotation removed. Category ids
// become contiguous labels 1..K (0 is the background), or stay the json's ids (torchvision's
// 91-class COCO models); the mapping is kept for writing results. Masks are made per sample, as
// RLE at the image's size (never dense per instance in memory).
#pragma once
#include "data/coco.h"
#include "data/dataset.h"

#include <memory>
#include <string>
#include <vector>

namespace imgtrain::data {

struct CocoOptions {
  bool train = true;              // remove images without a usable annotation
  bool contiguous_labels = true;  // labels 1..K in category-id order; false: label = category id
  bool masks = true;              // targets carry instance masks
};

class CocoDetection : public Dataset {
 public:
  // `image_dir` holds the files named by the json's file_name; `ann_file` an instances_*.json.
  CocoDetection(std::string image_dir, const std::string& ann_file, CocoOptions opt = {});

  size_t size() const override { return ids_.size(); }
  int64_t label(size_t) const override { return 0; }
  cv::Mat image(size_t i) const override;
  bool encoded(size_t i, std::string& bytes) const override;
  std::string describe(size_t i) const override;
  bool has_targets() const override { return true; }
  BoxTarget target(size_t i, cv::Size image = {}) const override;
  cv::Size image_size(size_t i) const override;
  // Background included: K + 1 (contiguous) or the largest category id + 1.
  int64_t num_classes() const override;
  std::vector<std::string> class_names() const override;

  const coco::Dataset& coco() const { return gt_; }
  const coco::Image& image_info(size_t i) const { return gt_.images[ids_[i]]; }
  // The json category id of a label (for results files); -1 for the background or an unknown label.
  int64_t category_of_label(int64_t label) const;
  int64_t label_of_category(int64_t category_id) const;
  // Lines to print once: the reader's per-annotation problems and the images removed for training.
  const std::vector<std::string>& warnings() const { return warnings_; }
  size_t removed_images() const { return removed_; }

 private:
  std::string dir_;
  CocoOptions opt_;
  coco::Dataset gt_;
  std::vector<uint32_t> ids_;  // positions in gt_.images, in image-id order
  std::vector<int64_t> cat_ids_;  // sorted category ids; contiguous label l is cat_ids_[l - 1]
  std::vector<std::string> warnings_;
  size_t removed_ = 0;
};

// The standard layout `root/{split}2017/` + `root/annotations/instances_{split}2017.json` (also
// without the 2017: `root/{split}/` + `instances_{split}.json`); `ann_file`, when given, names the
// json and `split` the image folder (relative to root, or absolute). UserError when a piece is
// missing, naming the paths tried.
std::shared_ptr<CocoDetection> open_coco(const std::string& root, const std::string& split, const std::string& ann_file,
                                         CocoOptions opt);

}  // namespace imgtrain::data
