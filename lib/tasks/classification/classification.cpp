#include "tasks/classification/classification.h"

#include "core/error.h"
#include "core/log.h"
#include "core/meter.h"
#include "core/rng.h"
#include "dist/dist.h"
#include "engine/setup.h"
#include "io/weights.h"
#include "model_zoo/registry.h"

#include <torch/torch.h>

#include <algorithm>
#include <fmt/ranges.h>

#include <opencv2/core.hpp>

namespace imgtrain::tasks {
namespace {

ClassifierImpl& classifier(torch::nn::Module& m) {
  auto* c = m.as<ClassifierImpl>();
  if (!c) throw std::logic_error("the classification task was given a model that is not a classifier");
  return *c;
}

}  // namespace

// timm's RandomErasing on the normalised batch, each sample from its own (seed, epoch, index)
// generator, so the result does not depend on batch composition or thread count. The draws are
// made on the host (a few numbers per sample); the pixels are written where the batch lives, in
// place: one transfer of the fill values per batch, no copy of the batch.
at::Tensor random_erase(at::Tensor x, const at::Tensor& indices, const data::RandomErasingConfig& c, uint64_t seed,
                        int64_t epoch) {
  const int h = int(x.size(2)), w = int(x.size(3)), ch = int(x.size(1));
  const auto idx = indices.to(torch::kCPU, torch::kLong).contiguous();
  std::vector<std::pair<int64_t, data::ErasePatch>> patches;
  std::vector<float> values;
  for (int64_t i = 0; i < x.size(0); ++i) {
    auto rng = sample_rng(seed ^ 0x657261736500ull, uint64_t(epoch), uint64_t(idx.data_ptr<int64_t>()[i]));
    for (auto& p : data::plan_random_erasing(h, w, ch, c, rng)) {
      values.insert(values.end(), p.values.begin(), p.values.end());
      patches.emplace_back(i, std::move(p));
    }
  }
  if (patches.empty()) return x;
  torch::NoGradGuard ng;
  auto all = torch::from_blob(values.data(), {int64_t(values.size())}, torch::kFloat).to(x.device(), x.scalar_type(),
                                                                                        false, /*copy=*/true);
  int64_t offset = 0;
  for (auto& [i, p] : patches) {
    const int64_t n = int64_t(p.values.size());
    auto region = x[i].narrow(1, p.rect.y, p.rect.height).narrow(2, p.rect.x, p.rect.width);
    auto v = all.narrow(0, offset, n);
    if (n == ch) region.copy_(v.view({ch, 1, 1}));  // one value per channel
    else region.copy_(v.view({p.rect.height, p.rect.width, ch}).permute({2, 0, 1}));
    offset += n;
  }
  return x;
}

namespace {

class ClassificationEvaluator : public engine::Evaluator {
 public:
  explicit ClassificationEvaluator(dist::Context* ctx) : ctx_(ctx) {}
  void update(const engine::EvalOutputs& out, const data::Batch& batch) override {
    const auto& logits = out.at("logits");
    auto acc = accuracy(logits, batch.labels.to(logits.device()), {1, 5});
    std::vector<double> v{out.at("loss").item<double>(), acc[0], acc[1]};
    if (ctx_) v = ctx_->mean(v);  // timm's reduce_tensor of loss, acc1, acc5 per batch
    const int64_t n = logits.size(0);
    loss_.update(v[0], n);
    top1_.update(v[1], n);
    top5_.update(v[2], n);
  }
  engine::NamedValues summarize() const override {
    return {{"loss", loss_.avg()}, {"top1", top1_.avg()}, {"top5", top5_.avg()}};
  }
  std::string progress(bool validate_style) const override {
    if (validate_style)
      return fmt::format("Loss: {:>7.4f} ({:>6.4f})  Acc@1: {:>7.3f} ({:>7.3f})  Acc@5: {:>7.3f} ({:>7.3f})",
                         loss_.val, loss_.avg(), top1_.val, top1_.avg(), top5_.val, top5_.avg());
    return fmt::format("Loss: {:>7.3f} ({:>6.3f})  Acc@1: {:>7.3f} ({:>7.3f})  Acc@5: {:>7.3f} ({:>7.3f})",
                       loss_.val, loss_.avg(), top1_.val, top1_.avg(), top5_.val, top5_.avg());
  }
  // Images seen by all ranks (timm's OrderedDistributedSampler pads the last ones by wrapping).
  int64_t count() const override { return loss_.count * (ctx_ ? ctx_->world() : 1); }
  std::string summary_line() const override {
    return fmt::format(" * Acc@1 {:.3f} ({:.3f}) Acc@5 {:.3f} ({:.3f})", top1_.avg(), 100 - top1_.avg(), top5_.avg(),
                       100 - top5_.avg());
  }
  engine::NamedValues result_fields() const override {
    return {{"top1", engine::round_to(top1_.avg(), 4)},
            {"top1_err", engine::round_to(100 - top1_.avg(), 4)},
            {"top5", engine::round_to(top5_.avg(), 4)},
            {"top5_err", engine::round_to(100 - top5_.avg(), 4)}};
  }

 private:
  dist::Context* ctx_;
  AverageMeter loss_, top1_, top5_;
};

}  // namespace

std::vector<double> accuracy(const at::Tensor& out, const at::Tensor& target, const std::vector<int64_t>& ks) {
  int64_t maxk = std::min<int64_t>(*std::max_element(ks.begin(), ks.end()), out.size(1));
  auto pred = std::get<1>(out.topk(maxk, 1, true, true)).t();
  auto correct = pred.eq(target.view({1, -1}).expand_as(pred));
  std::vector<double> res;
  for (auto k : ks) {
    k = std::min(k, maxk);
    res.push_back(correct.narrow(0, 0, k).reshape(-1).to(torch::kFloat32).sum().item<double>() * 100.0 /
                  double(out.size(0)));
  }
  return res;
}

std::shared_ptr<torch::nn::Module> ClassificationTask::create_model() const {
  auto model = model_zoo::create_model(o_.model, o_.model_args);
  engine::apply_bn_args(*model, o_.bn_momentum, o_.bn_eps);
  return model;
}

std::string pretrained_weights_path(const std::string& model, bool pretrained, const std::string& pretrained_path) {
  if (!pretrained_path.empty() || !pretrained) return pretrained_path;
  const auto& d = model_zoo::model_defaults(model);
  auto [arch, tag] = model_zoo::split_model_name(model);
  if (tag.empty()) {
    if (d.tags.empty()) throw UserError(fmt::format("--pretrained: timm has no pretrained weights for {}", arch));
    tag = d.tags.front();
  } else if (!d.tags.empty() && std::find(d.tags.begin(), d.tags.end(), tag) == d.tags.end()) {
    // timm: "Invalid pretrained tag (...) for ...", before any download
    throw UserError(fmt::format("--pretrained: '{}' is not one of timm's pretrained tags for {} ({})", tag, arch,
                                fmt::join(d.tags, ", ")));
  }
  return io::find_hub_weights(arch, tag);
}

std::optional<int64_t> weights_class_count(const std::string& path, const std::string& classifier) {
  const auto st = io::load_weights_file(path);
  const std::string key = io::weights_prefix(st, true) + classifier + ".weight";
  for (auto& [k, v] : st.tensors)
    if (k == key && v.dim() >= 2) return v.size(0);
  return std::nullopt;
}

void ClassificationTask::load_pretrained(torch::nn::Module& model) const {
  if (!o_.pretrained && o_.pretrained_path.empty()) return;
  const auto& d = model_zoo::model_defaults(o_.model);
  const std::string path = pretrained_weights_path(o_.model, o_.pretrained, o_.pretrained_path);
  auto st = io::load_weights_file(path);
  auto note = io::load_pretrained(model, st, {d.first_conv, d.classifier}, path);
  log::info("Loaded pretrained weights from '{}'{}", path, note.empty() ? "" : " (" + note + ")");
  if (o_.scored_as_loaded && note.find("re-initialised") != std::string::npos)
    log::warn("--num-classes {}: '{}' holds a classifier for another class count, so the {} scored here is "
              "initialised at random (as timm's validate.py does)",
              o_.model_args.num_classes, path, d.classifier);
}

engine::ParamInfo ClassificationTask::param_info(torch::nn::Module& model) const {
  auto& c = classifier(model);
  return {c.no_weight_decay(), c.group_matcher()};
}

void ClassificationTask::start_epoch(int64_t epoch) {
  mixup_enabled_ = !(o_.mixup_off_epoch && epoch >= o_.mixup_off_epoch);
}

engine::StepOutput ClassificationTask::forward_train(torch::nn::Module& model, at::Tensor x, const data::Batch& b,
                                                     const engine::StepContext& s) {
  if (o_.erase) x = random_erase(x, b.indices, *o_.erase, o_.seed, s.epoch);
  at::Tensor y = b.labels.to(x.device());
  if (o_.mixup.active() && mixup_enabled_ && x.size(0) % 2 == 0) {
    // Each rank mixes with its own draws (timm seeds each rank's mixup with seed + rank).
    auto rng = sample_rng((o_.seed + uint64_t(o_.rank)) ^ 0x6d69787570ull, uint64_t(s.epoch), uint64_t(s.batch_idx));
    y = data::apply_mixup(x, y, o_.mixup, rng);
  }
  if (s.input_dtype) x = x.to(*s.input_dtype);
  auto logits = classifier(model).forward(x);
  if (s.float32_loss) logits = logits.to(torch::kFloat32);
  auto loss = train_loss(logits, y, o_.loss);
  return {loss, {{"loss", loss}}};
}

engine::EvalOutputs ClassificationTask::forward_eval(torch::nn::Module& model, const at::Tensor& x,
                                                     const data::Batch& b, const engine::StepContext& s) {
  auto out = classifier(model).forward(x);
  if (out.scalar_type() != torch::kFloat32 && !s.autocast) out = out.to(torch::kFloat32);  // O2
  auto loss = torch::nn::functional::cross_entropy(out, b.labels.to(x.device()));
  return {{{"logits", out.to(torch::kFloat32)}, {"loss", loss}}};
}

std::unique_ptr<engine::Evaluator> ClassificationTask::evaluator(dist::Context* ctx) const {
  return std::make_unique<ClassificationEvaluator>(ctx);
}

}  // namespace imgtrain::tasks
