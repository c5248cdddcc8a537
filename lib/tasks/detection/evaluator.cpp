#include "tasks/detection/evaluator.h"

#include "core/log.h"
#include "dist/dist.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstring>
#include <map>
#include <stdexcept>

namespace imgtrain::tasks {
namespace {

const size_t kReported = 6;  // Detectron2's table: AP .. APl

template <typename T>
void put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}
template <typename T>
T take(const std::string& s, size_t& at) {
  if (at + sizeof(T) > s.size()) throw std::runtime_error("detection gather: truncated buffer");
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  at += sizeof v;
  return v;
}

// A results set scored as pycocotools scores loadRes(results): the gt's images and categories.
coco::Dataset results_dataset(const coco::Dataset& gt, const std::vector<coco::Detection>& dets) {
  if (!dets.empty()) return coco::parse_results(gt, coco::results_json(dets), "detections");
  coco::Dataset empty;  // torchvision: COCO() when there are no results; every AP is then 0 (or -1)
  empty.images = gt.images;
  empty.categories = gt.categories;
  empty.build_index();
  return empty;
}

}  // namespace

coco::Box to_xywh(const float* b) { return {double(b[0]), double(b[1]), double(b[2] - b[0]), double(b[3] - b[1])}; }

std::string pack_detections(const std::vector<coco::Detection>& d) {
  std::string s;
  put(s, uint64_t(d.size()));
  for (const auto& x : d) {
    put(s, x.image_id);
    put(s, x.category_id);
    for (double v : x.bbox) put(s, v);
    put(s, x.score);
    put(s, uint8_t(x.has_mask));
    if (x.has_mask) {
      put(s, x.mask.h);
      put(s, x.mask.w);
      put(s, uint64_t(x.mask.counts.size()));
      s.append(reinterpret_cast<const char*>(x.mask.counts.data()), x.mask.counts.size() * sizeof(uint32_t));
    }
  }
  return s;
}

std::vector<coco::Detection> unpack_detections(const std::string& s, size_t* used) {
  size_t at = 0;
  const auto n = take<uint64_t>(s, at);
  std::vector<coco::Detection> d(n);
  for (auto& x : d) {
    x.image_id = take<int64_t>(s, at);
    x.category_id = take<int64_t>(s, at);
    for (double& v : x.bbox) v = take<double>(s, at);
    x.score = take<double>(s, at);
    x.has_mask = take<uint8_t>(s, at) != 0;
    if (x.has_mask) {
      x.mask.h = take<uint32_t>(s, at);
      x.mask.w = take<uint32_t>(s, at);
      const auto c = take<uint64_t>(s, at);
      if (at + c * sizeof(uint32_t) > s.size()) throw std::runtime_error("detection gather: truncated buffer");
      x.mask.counts.resize(c);
      std::memcpy(x.mask.counts.data(), s.data() + at, c * sizeof(uint32_t));
      at += c * sizeof(uint32_t);
    }
  }
  if (used) *used = at;
  return d;
}

CocoEvaluator::CocoEvaluator(std::shared_ptr<const data::CocoDetection> ds, dist::Context* ctx, bool segm,
                             std::string results_path)
    : ds_(std::move(ds)), ctx_(ctx), segm_(segm), results_path_(std::move(results_path)) {}

std::vector<std::string> CocoEvaluator::metric_names(bool segm) {
  std::vector<std::string> n;
  for (const char* t : {"bbox", "segm"}) {
    if (std::string(t) == "segm" && !segm) break;
    for (size_t i = 0; i < kReported; ++i) n.push_back(fmt::format("{}_{}", t, coco::stat_names()[i]));
  }
  return n;
}

void CocoEvaluator::update(const engine::EvalOutputs& out, const data::Batch& batch) {
  ++batches_;
  const auto boxes = out.at("boxes").to(at::kCPU, at::kFloat).contiguous();
  const auto scores = out.at("scores").to(at::kCPU, at::kDouble).contiguous();
  const auto labels = out.at("labels").to(at::kCPU, at::kLong).contiguous();
  const auto counts = out.at("counts").to(at::kCPU, at::kLong).contiguous();
  if (size_t(counts.numel()) != batch.targets.size())
    throw std::invalid_argument("detection evaluator: 'counts' does not match the batch's images");
  int64_t first = 0;
  for (size_t i = 0; i < batch.targets.size(); ++i) {
    const int64_t image_id = batch.targets[i].image_id, n = counts[int64_t(i)].item<int64_t>();
    images_.insert(image_id);
    at::Tensor masks;
    if (segm_) {
      auto it = out.tensors.find(fmt::format("masks.{}", i));
      if (it == out.tensors.end()) throw std::invalid_argument("detection evaluator: segm needs 'masks.<i>' outputs");
      // [N, 1, H, W] or [N, H, W] probabilities; > 0.5 as torchvision, then column-major for RLE
      masks = (it->second.to(at::kCPU).to(at::kFloat).reshape({n, it->second.size(-2), it->second.size(-1)}) > 0.5)
                  .to(at::kByte).transpose(1, 2).contiguous();
    }
    for (int64_t k = 0; k < n; ++k) {
      coco::Detection d;
      d.image_id = image_id;
      d.category_id = ds_->category_of_label(labels[first + k].item<int64_t>());
      if (d.category_id < 0) continue;  // background or a label the dataset does not have
      d.bbox = to_xywh(boxes.data_ptr<float>() + (first + k) * 4);
      d.score = scores[first + k].item<double>();
      if (segm_) {
        d.has_mask = true;
        d.mask = coco::rle_encode(masks[k].data_ptr<uint8_t>(), uint32_t(masks.size(2)), uint32_t(masks.size(1)));
      }
      dets_.push_back(std::move(d));
    }
    first += n;
  }
}

void CocoEvaluator::sync() {
  if (ctx_ && ctx_->world() > 1) {
    // Every rank's images and detections in one gather; each image kept from the first rank
    // that evaluated it (a padded share repeats some).
    std::string mine = pack_detections(dets_);
    for (int64_t id : images_) mine.append(reinterpret_cast<const char*>(&id), sizeof id);
    std::vector<coco::Detection> all;
    std::map<int64_t, size_t> owner;  // image id -> rank
    images_.clear();
    const auto parts = ctx_->all_gather_bytes(mine);
    for (size_t r = 0; r < parts.size(); ++r) {
      size_t used = 0;
      for (auto& d : unpack_detections(parts[r], &used)) {
        auto [it, fresh] = owner.emplace(d.image_id, r);
        if (it->second == r) all.push_back(std::move(d));
      }
      for (size_t i = used; i + sizeof(int64_t) <= parts[r].size(); i += sizeof(int64_t)) {
        int64_t id;
        std::memcpy(&id, parts[r].data() + i, sizeof id);
        images_.insert(id);
      }
    }
    dets_ = std::move(all);
  }
  // Scored against the images evaluated (a partial pass scores only what it saw, as COCOeval
  // with params.imgIds = the evaluated ids); the whole gt is used as it is when all were seen.
  const coco::Dataset& full = ds_->coco();
  coco::Dataset subset;
  if (images_.size() != full.images.size()) {
    for (auto& im : full.images)
      if (images_.count(im.id)) subset.images.push_back(im);
    for (auto& a : full.annotations)
      if (images_.count(a.image_id)) subset.annotations.push_back(a);
    subset.categories = full.categories;
    subset.path = full.path;
    subset.build_index();
  }
  const coco::Dataset& gt = images_.size() != full.images.size() ? subset : full;
  const auto dt = results_dataset(gt, dets_);
  stats_.clear();
  report_.clear();
  for (auto type : {coco::IouType::bbox, coco::IouType::segm}) {
    if (type == coco::IouType::segm && !segm_) break;
    coco::EvalParams p;
    p.iou_type = type;
    const auto r = coco::evaluate(gt, dt, p);
    const char* name = type == coco::IouType::bbox ? "bbox" : "segm";
    report_ += fmt::format("IoU metric: {}\n{}", name, coco::format_summary(r));
    for (size_t i = 0; i < kReported; ++i) stats_.emplace_back(fmt::format("{}_{}", name, coco::stat_names()[i]),
                                                                r.stats[i] < 0 ? -1.0 : 100 * r.stats[i]);
  }
  if (!results_path_.empty() && (!ctx_ || ctx_->rank() == 0)) coco::write_results_json(results_path_, dets_);
}

engine::NamedValues CocoEvaluator::summarize() const {
  if (stats_.empty()) {
    engine::NamedValues z;
    for (auto& n : metric_names(segm_)) z.emplace_back(n, 0.0);
    return z;
  }
  return stats_;
}

std::string CocoEvaluator::progress(bool) const {
  return fmt::format("Images: {}  Detections: {}", images_.size(), dets_.size());
}

std::string CocoEvaluator::summary_line() const {
  std::string s = " *";
  for (auto& [n, v] : summarize()) s += fmt::format(" {} {:.3f}", n, v);
  return s;
}

}  // namespace imgtrain::tasks
