#include "tasks/detection/detection.h"

#include "core/error.h"
#include "core/log.h"
#include "data/target.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "tasks/detection/evaluator.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

namespace imgtrain::tasks {
namespace {

using model_zoo::detection::GeneralizedRCNNImpl;

GeneralizedRCNNImpl& rcnn(torch::nn::Module& m) {
  auto* r = dynamic_cast<GeneralizedRCNNImpl*>(&m);
  if (!r) throw std::logic_error("the detection task drives GeneralizedRCNN models only");
  return *r;
}

// splitmix64: the sampler's seed for one step from (seed, rank, epoch, batch).
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

model_zoo::detection::ImageBatch detection_input(const at::Tensor& x, const data::Batch& batch, double default_min,
                                                 double max_size, std::vector<model_zoo::detection::Target>* targets,
                                                 bool masks) {
  model_zoo::detection::ImageBatch ib;
  std::vector<at::Tensor> images;
  const auto sizes = batch.sizes.to(at::kCPU);
  for (int64_t i = 0; i < x.size(0); ++i) {
    const int64_t h = sizes[i][0].item<int64_t>(), w = sizes[i][1].item<int64_t>();
    auto img = x[i].narrow(1, 0, h).narrow(2, 0, w).to(at::kFloat);
    const auto& t = batch.targets.at(size_t(i));
    const double min_size = t.min_size > 0 ? double(t.min_size) : default_min;
    auto r = data::detection_resize(img, t, min_size, max_size, targets && masks);
    ib.sizes.push_back({r.image.size(1), r.image.size(2)});
    if (targets) {
      model_zoo::detection::Target tt;
      tt.boxes = r.boxes.defined() ? r.boxes : at::zeros({0, 4}, img.options());
      tt.labels = t.labels.defined() ? t.labels.to(img.device()) : at::zeros({0}, img.options().dtype(at::kLong));
      if (masks)
        tt.masks = r.masks.defined() ? r.masks
                                     : at::zeros({tt.boxes.size(0), r.image.size(1), r.image.size(2)},
                                                 img.options().dtype(at::kByte));
      targets->push_back(std::move(tt));
    }
    images.push_back(std::move(r.image));
  }
  ib.tensors = data::batch_images(images, 32);
  if (x.is_contiguous(at::MemoryFormat::ChannelsLast))
    ib.tensors = ib.tensors.contiguous(at::MemoryFormat::ChannelsLast);
  return ib;
}

std::shared_ptr<torch::nn::Module> DetectionTask::create_model() const {
  return model_zoo::detection::create_rcnn(o_.model, o_.rcnn).ptr();
}

void DetectionTask::load_pretrained(torch::nn::Module& model) const {
  if (o_.pretrained_path.empty()) return;
  // A state dict, or a checkpoint's (imgtrain's, timm's, torchvision's) EMA weights if it has
  // them, else its model's.
  const auto file = io::load_weights_file(o_.pretrained_path);
  log::info("{}", model_zoo::detection::load_rcnn_weights(rcnn(model), file, io::weights_prefix(file, /*prefer_ema=*/true),
                                                          fmt::format("--pretrained-path '{}'", o_.pretrained_path),
                                                          o_.pretrained_path));
}

engine::StepOutput DetectionTask::forward_train(torch::nn::Module& model, at::Tensor x, const data::Batch& batch,
                                                const engine::StepContext& s) {
  auto& m = rcnn(model);
  std::vector<model_zoo::detection::Target> targets;
  auto input = detection_input(x, batch, o_.eval_min_size, o_.max_size, &targets, m.has_mask());
  if (s.input_dtype) input.tensors = input.tensors.to(*s.input_dtype);
  // The balanced samplers' draws: one generator per step, from the run's seed, rank and position.
  auto gen = at::detail::createCPUGenerator(
      mix(o_.seed ^ mix(uint64_t(o_.rank) ^ mix(uint64_t(s.epoch) ^ mix(uint64_t(s.batch_idx))))));
  m.generator = gen;
  auto res = m.forward(input, &targets);
  m.generator.reset();
  engine::StepOutput out;
  for (auto& [k, v] : res.losses) {
    out.loss = out.loss.defined() ? out.loss + v : v;
    out.parts.emplace_back(k, v.detach());
  }
  return out;
}

engine::EvalOutputs DetectionTask::forward_eval(torch::nn::Module& model, const at::Tensor& x,
                                                const data::Batch& batch, const engine::StepContext& s) {
  auto& m = rcnn(model);
  auto input = detection_input(x, batch, o_.eval_min_size, o_.max_size, nullptr, false);
  if (x.scalar_type() != at::kFloat) input.tensors = input.tensors.to(x.scalar_type());
  auto res = m.forward(input);
  engine::EvalOutputs out;
  std::vector<at::Tensor> boxes, scores, labels;
  std::vector<int64_t> counts;
  const auto sizes = batch.sizes.to(at::kCPU);
  for (size_t i = 0; i < res.detections.size(); ++i) {
    auto& d = res.detections[i];
    model_zoo::detection::postprocess(d, input.sizes[i], {sizes[int64_t(i)][0].item<int64_t>(),
                                                          sizes[int64_t(i)][1].item<int64_t>()},
                                      /*threshold=*/0.5, o_.rcnn.mask_convention);
    boxes.push_back(d.boxes);
    scores.push_back(d.scores);
    labels.push_back(d.labels);
    counts.push_back(d.boxes.size(0));
    if (d.masks.defined()) out.tensors[fmt::format("masks.{}", i)] = d.masks;
  }
  out.tensors["boxes"] = at::cat(boxes);
  out.tensors["scores"] = at::cat(scores);
  out.tensors["labels"] = at::cat(labels);
  out.tensors["counts"] = at::tensor(counts, at::TensorOptions().dtype(at::kLong));
  return out;
}

std::unique_ptr<engine::Evaluator> DetectionTask::evaluator(dist::Context* ctx) const {
  const bool segm = model_zoo::detection::rcnn_has_mask(o_.model);
  return std::make_unique<CocoEvaluator>(o_.eval_data, ctx, segm, o_.results_path);
}

std::vector<std::string> DetectionTask::metric_names() const {
  return CocoEvaluator::metric_names(model_zoo::detection::rcnn_has_mask(o_.model));
}

}  // namespace imgtrain::tasks
