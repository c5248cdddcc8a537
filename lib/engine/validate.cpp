// `imgtrain validate`: timm's validate.py for one checkpoint (or pretrained weights) over one split.
#include "cli/config.h"
#include "core/batch_norm.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/checkpoint.h"
#include "engine/commands.h"
#include "engine/evaluate.h"
#include "engine/setup.h"
#include "io/weights.h"
#include "model_zoo/registry.h"
#include "tasks/tasks.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdio>

namespace imgtrain::engine {

int validate(const cli::Config& cfg) {
  if (cfg.checkpoint.empty() && !cfg.pretrained && cfg.pretrained_path.empty())
    throw UserError("validate needs --checkpoint FILE, --pretrained or --pretrained-path FILE");
  require_file(cfg.checkpoint, "--checkpoint");
  require_file(cfg.pretrained_path, "--pretrained-path");
  require_writable(cfg.results_file, "--results-file");  // before the evaluation, not after it
  const auto device = resolve_device(cfg.device, cfg.tf32);
  std::optional<Checkpoint> ck;
  if (!cfg.checkpoint.empty()) ck = Checkpoint::read(cfg.checkpoint);
  auto setup = tasks::create_validate_task(cfg, ck ? &ck->meta() : nullptr);
  Task& task = *setup.task;
  auto model = task.create_model();
  if (ck) {
    try {
      if (cfg.use_ema && ck->weights_prefix(true) != "ema.")
        log::warn("--use-ema: '{}' holds no EMA weights; the model's own weights are validated (as timm's "
                  "validate.py does)",
                  cfg.checkpoint);
      ck->load_weights(*model, cfg.use_ema);
    } catch (const io::WeightsMismatch& e) {  // weights that do not fit: say which flag built another model
      const auto& m = ck->meta();
      std::string why;  // pooling changes only names (ViT: norm or fc_norm), the size only pos_embed's shape
      const bool names_differ = !e.missing.empty() || !e.unexpected.empty();
      const bool pos_embed_shape =
          std::find(e.wrong_shape.begin(), e.wrong_shape.end(), "pos_embed") != e.wrong_shape.end();
      if (names_differ && !cfg.gp.empty() && m.global_pool && *m.global_pool != cfg.gp)
        why += fmt::format(" (the checkpoint was trained with {}; --gp {} builds other layers)",
                           m.global_pool->empty() ? "the model's default pooling" : "--gp " + *m.global_pool, cfg.gp);
      if (pos_embed_shape && cfg.img_size && m.img_size && *cfg.img_size != *m.img_size)
        why += fmt::format(" (the checkpoint was trained at --img-size {}; --checkpoint loads weights as they are: "
                           "--model {} --pretrained-path {} resamples a ViT's position embeddings)",
                           *m.img_size, m.arch.empty() ? cfg.model : m.arch, cfg.checkpoint);
      if (why.empty()) throw;
      throw UserError(e.what() + why);
    }
  } else
    task.load_pretrained(*model);
  model->to(device);
  if (cfg.channels_last) to_channels_last(*model);
  if (cfg.fuse_bn) set_inference_fusion(*model, true);
  const int64_t params = model_zoo::count_params(*model);
  log::info("Model {} created, param count: {}", setup.model_meta.arch, params);

  data::LoaderOptions lo;
  lo.batch_size = setup.validate_batch_size && !cfg.was_given("batch-size") ? setup.validate_batch_size : cfg.batch_size;
  lo.workers = cfg.workers;
  lo.pin_memory = cfg.pinned_batches(device.is_cuda());
  lo.cuda_device = device.is_cuda() ? device.index() : -1;
  lo.pad_shares = !setup.sharded_eval;
  data::Loader loader(setup.eval, setup.eval_transform, lo);
  EvalOptions eo;
  eo.device = device;
  eo.mean = setup.data.mean;
  eo.std = setup.data.std;
  eo.channels_last = cfg.channels_last;
  eo.amp = resolve_amp(cfg.amp, cfg.amp_dtype, cfg.amp_opt_level);
  warn_cpu_float16(eo.amp, device);
  eo.log_interval = cfg.log_interval;
  eo.validate_style = true;
  const auto res = evaluate(task, *model, loader, eo);
  log::info("{}", res.summary_line);

  nlohmann::ordered_json r;
  r["model"] = setup.model_meta.arch;
  for (auto& [k, v] : res.result_fields) r[k] = v;
  r["param_count"] = round_to(double(params) / 1e6, 2);
  r["img_size"] = setup.data.img_size;
  r["crop_pct"] = setup.data.crop_pct;
  r["interpolation"] = setup.data.interpolation;
  std::printf("--result\n%s\n", r.dump(4).c_str());
  write_results(cfg.results_file, cfg.results_format, r);
  return 0;
}

}  // namespace imgtrain::engine
