#include "engine/evaluate.h"

#include "core/error.h"
#include "core/log.h"
#include "core/meter.h"
#include "engine/amp.h"

#include <torch/torch.h>

#include <chrono>

namespace imgtrain::engine {

double EvalResult::get(const std::string& name) const {
  for (auto& [k, v] : metrics)
    if (k == name) return v;
  throw std::out_of_range("no metric '" + name + "'");
}

EvalResult evaluate(Task& task, torch::nn::Module& model, data::Loader& loader, const EvalOptions& o) {
  using Clock = std::chrono::steady_clock;
  torch::NoGradGuard ng;
  model.eval();
  const auto in_dtype = model.parameters().front().scalar_type();  // half under O2
  auto evaluator = task.evaluator(o.dist);
  StepContext step;
  step.autocast = o.amp.enabled;
  AverageMeter batch_time;
  loader.start_epoch(0);
  const int64_t last_idx = int64_t(loader.num_batches()) - 1;
  auto end = Clock::now();
  int64_t batch_idx = 0;
  while (auto b = loader.next()) {
    if (b->images.size(0) == 0) {
      ++batch_idx;
      continue;
    }
    auto x = model_input(b->images, o.device, o.mean, o.std, o.channels_last).to(in_dtype);
    step.batch_idx = batch_idx;
    EvalOutputs out;
    {
      AutocastScope autocast(o.amp.enabled, o.device.type(), o.amp.dtype);
      out = task.forward_eval(model, x, *b, step);
    }
    evaluator->update(out, *b);
    batch_time.update(std::chrono::duration<double>(Clock::now() - end).count());
    end = Clock::now();
    if (batch_idx == last_idx || batch_idx % o.log_interval == 0) {
      const double time_val = batch_time.val, time_avg = batch_time.avg();
      if (o.validate_style)
        log::info("Test: [{:>4d}/{}]  Time: {:.3f}s ({:.3f}s, {:>7.2f}/s)  {}", batch_idx, loader.num_batches(),
                  time_val, time_avg, double(x.size(0)) / std::max(time_avg, 1e-9), evaluator->progress(true));
      else
        log::info("Test{}: [{:>4d}/{}]  Time: {:.3f} ({:.3f})  {}", o.log_suffix, batch_idx, last_idx, time_val,
                  time_avg, evaluator->progress(false));
    }
    ++batch_idx;
  }
  if (loader.skipped_this_epoch())
    log::warn("evaluation skipped {} unreadable image(s)", loader.skipped_this_epoch());
  evaluator->sync();
  // Metrics over no image would read as a score of 0 and pick checkpoints by it.
  if (evaluator->count() == 0)
    throw UserError(fmt::format("evaluation saw no image: {}", loader.skipped_this_epoch()
                                    ? fmt::format("all {} were unreadable", loader.skipped_this_epoch())
                                    : std::string("the split is empty")));
  return {evaluator->summarize(), evaluator->count(), evaluator->summary_line(), evaluator->result_fields()};
}

}  // namespace imgtrain::engine
