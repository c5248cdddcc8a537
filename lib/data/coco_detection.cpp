#include "data/coco_detection.h"

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

namespace fs = std::filesystem;

namespace imgtrain::data {
namespace {

// torchvision's ConvertCocoPolysToMask box: xywh -> x1y1x2y2 in float32, clamped to the image.
std::array<float, 4> clamped_box(const coco::Box& b, uint32_t w, uint32_t h) {
  const float x = float(b[0]), y = float(b[1]);
  std::array<float, 4> o{x, y, x + float(b[2]), y + float(b[3])};
  o[0] = std::clamp(o[0], 0.0f, float(w));
  o[2] = std::clamp(o[2], 0.0f, float(w));
  o[1] = std::clamp(o[1], 0.0f, float(h));
  o[3] = std::clamp(o[3], 0.0f, float(h));
  return o;
}

}  // namespace

CocoDetection::CocoDetection(std::string image_dir, const std::string& ann_file, CocoOptions opt)
    : dir_(std::move(image_dir)), opt_(opt) {
  try {
    gt_ = coco::load_dataset(ann_file);
  } catch (const std::runtime_error& e) {
    throw UserError(e.what());
  }
  warnings_ = gt_.warnings;
  for (auto& c : gt_.categories) cat_ids_.push_back(c.id);
  std::sort(cat_ids_.begin(), cat_ids_.end());
  // torchvision's CocoDetection: ids = sorted(coco.imgs.keys())
  std::vector<uint32_t> order(gt_.images.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return gt_.images[a].id < gt_.images[b].id; });
  for (uint32_t pos : order) {
    if (opt_.train) {
      // _coco_remove_images_without_annotations: no annotation at all, or every box with a side <= 1
      const auto& anns = gt_.image_annotations(gt_.images[pos].id);
      const bool usable = std::any_of(anns.begin(), anns.end(), [&](uint32_t a) {
        const auto& bb = gt_.annotations[a].bbox;
        return bb[2] > 1 && bb[3] > 1;
      });
      if (!usable) {
        ++removed_;
        continue;
      }
    }
    ids_.push_back(pos);
  }
  if (removed_)
    warnings_.push_back(fmt::format("{}: {} of {} images have no usable annotation and are left out of training",
                                    ann_file, removed_, gt_.images.size()));
  if (opt_.masks && opt_.train) {  // Mask R-CNN would learn an empty mask for such objects
    size_t unmasked = 0;
    int64_t first = 0;
    for (uint32_t pos : ids_)
      for (uint32_t a : gt_.image_annotations(gt_.images[pos].id)) {
        const auto& ann = gt_.annotations[a];
        if (ann.iscrowd || ann.seg != coco::SegKind::none || label_of_category(ann.category_id) < 0) continue;
        if (!unmasked++) first = ann.id;
      }
    if (unmasked)
      warnings_.push_back(fmt::format("{}: {} annotation(s) have no segmentation (missing, empty or unreadable): their "
                                      "mask targets are empty (first: id {})",
                                      ann_file, unmasked, first));
  }
  if (ids_.empty()) throw UserError(fmt::format("{}: no images to {}", ann_file, opt_.train ? "train on" : "evaluate"));
}

std::string CocoDetection::describe(size_t i) const { return (fs::path(dir_) / image_info(i).file_name).string(); }

bool CocoDetection::encoded(size_t i, std::string& bytes) const {
  read_file_bytes(describe(i), bytes);
  return true;
}

cv::Mat CocoDetection::image(size_t i) const {
  std::string bytes;
  encoded(i, bytes);
  return decode_image(bytes, describe(i));
}

cv::Size CocoDetection::image_size(size_t i) const {
  const auto& im = image_info(i);
  return {int(im.width), int(im.height)};
}

int64_t CocoDetection::num_classes() const {
  if (cat_ids_.empty()) return 1;
  return opt_.contiguous_labels ? int64_t(cat_ids_.size()) + 1 : cat_ids_.back() + 1;
}

std::vector<std::string> CocoDetection::class_names() const {
  std::vector<std::string> names(static_cast<size_t>(num_classes()));
  names[0] = "__background__";
  for (auto& c : gt_.categories) {
    const int64_t l = label_of_category(c.id);
    if (l > 0) names[size_t(l)] = c.name;
  }
  return names;
}

int64_t CocoDetection::label_of_category(int64_t category_id) const {
  auto it = std::lower_bound(cat_ids_.begin(), cat_ids_.end(), category_id);
  if (it == cat_ids_.end() || *it != category_id) return -1;
  return opt_.contiguous_labels ? int64_t(it - cat_ids_.begin()) + 1 : category_id;
}

int64_t CocoDetection::category_of_label(int64_t label) const {
  if (label <= 0) return -1;
  if (opt_.contiguous_labels) return label <= int64_t(cat_ids_.size()) ? cat_ids_[size_t(label - 1)] : -1;
  return std::binary_search(cat_ids_.begin(), cat_ids_.end(), label) ? label : -1;
}

BoxTarget CocoDetection::target(size_t i, cv::Size image) const {
  const auto& im = image_info(i);
  const uint32_t width = image.width > 0 ? uint32_t(image.width) : im.width;
  const uint32_t height = image.height > 0 ? uint32_t(image.height) : im.height;
  std::vector<float> boxes;
  std::vector<int64_t> labels;
  BoxTarget t;
  t.image_id = im.id;
  for (uint32_t a : gt_.image_annotations(im.id)) {
    const auto& ann = gt_.annotations[a];
    if (ann.iscrowd) continue;  // ignore regions: the evaluator's business, not a training target
    const int64_t label = label_of_category(ann.category_id);
    if (label < 0) continue;  // the reader already counted annotations of unknown categories
    const auto b = clamped_box(ann.bbox, width, height);
    if (!(b[3] > b[1] && b[2] > b[0])) continue;  // torchvision's keep
    boxes.insert(boxes.end(), b.begin(), b.end());
    labels.push_back(label);
    if (opt_.masks) t.masks.push_back(coco::ann_to_rle(ann, height, width));
  }
  const int64_t n = int64_t(labels.size());
  t.boxes = torch::from_blob(boxes.data(), {n, 4}, torch::kFloat).clone();
  t.labels = torch::from_blob(labels.data(), {n}, torch::kLong).clone();
  return t;
}

std::shared_ptr<CocoDetection> open_coco(const std::string& root, const std::string& split, const std::string& ann_file,
                                         CocoOptions opt) {
  std::error_code ec;
  if (root.empty() && ann_file.empty())
    throw UserError("--data-dir is required for a COCO dataset (the folder holding annotations/ and the image folders)");
  auto under_root = [&](const std::string& p) { return fs::path(p).is_absolute() || root.empty() ? fs::path(p) : fs::path(root) / p; };
  std::vector<std::string> tried;
  std::string images, ann = ann_file;
  if (!ann_file.empty()) {
    images = under_root(split).string();
    tried.push_back(images);
    if (!fs::is_directory(images, ec)) images.clear();
  } else {
    for (const std::string& folder : {split + "2017", split}) {
      const auto dir = under_root(folder);
      const auto json = fs::path(root) / "annotations" / ("instances_" + dir.filename().string() + ".json");
      tried.push_back(dir.string() + " + " + json.string());
      if (fs::is_directory(dir, ec) && fs::is_regular_file(json, ec)) {
        images = dir.string();
        ann = json.string();
        break;
      }
    }
  }
  if (images.empty())
    throw UserError(fmt::format("COCO split '{}': no image folder and annotations found (tried {})", split,
                                fmt::join(tried, "; ")));
  if (!fs::is_regular_file(ann, ec)) throw UserError(fmt::format("COCO annotations '{}': no such file", ann));
  return std::make_shared<CocoDetection>(images, ann, opt);
}

}  // namespace imgtrain::data
