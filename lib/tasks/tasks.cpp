#include "tasks/tasks.h"

#include "cli/adapters.h"
#include "core/error.h"
#include "model_zoo/registry.h"
#include "tasks/classification/classification.h"

namespace imgtrain::tasks {
namespace {

void check_labels(const data::Dataset& ds, int64_t num_classes, const std::string& what) {
  if (ds.num_classes() > num_classes)
    throw UserError(fmt::format("--num-classes {}: the {} split has {} classes", num_classes, what, ds.num_classes()));
}

// What checkpoints record about a classification model (enough to rebuild it).
engine::CheckpointMeta classification_meta(const std::string& arch, int64_t num_classes, const engine::DataConfig& dc,
                                           const std::string& gp) {
  engine::CheckpointMeta m;
  m.arch = arch;
  m.task = "classification";
  m.num_classes = num_classes;
  m.in_chans = dc.in_chans;
  m.global_pool = gp;
  m.img_size = dc.img_size;
  m.crop_pct = dc.crop_pct;
  return m;
}

TaskSetup classification_setup(const cli::Config& cfg, int64_t rank, int64_t world) {
  TaskSetup s;
  const auto& defaults = model_zoo::model_defaults(cfg.model);  // unknown model fails before data loading
  s.data = engine::resolve_data_config({cfg.in_chans, cfg.img_size, cfg.crop_pct, cfg.interpolation}, defaults);
  s.train = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.train_split);
  s.eval = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.val_split);
  const int64_t num_classes = cfg.num_classes.value_or(s.train->num_classes());
  check_labels(*s.train, num_classes, "train");
  check_labels(*s.eval, num_classes, "validation");
  if ((cfg.mixup > 0 || cfg.cutmix > 0 || !cfg.cutmix_minmax.empty()) && cfg.batch_size % 2)
    throw UserError(fmt::format("--batch-size {}: mixup/cutmix mixes each sample with its mirror and needs an even "
                                "batch size", cfg.batch_size));
  if (int64_t(s.train->size()) / world < cfg.batch_size)
    throw UserError(fmt::format("--batch-size {}: the train split has only {} images for {} process(es) (batches "
                                "drop the remainder)", cfg.batch_size, s.train->size(), world));

  const auto& dc = s.data;
  ClassificationOptions o;
  o.model = cfg.model;
  o.model_args = cli::model_args(cfg, num_classes, dc.in_chans, dc.img_size);
  o.bn_momentum = cfg.bn_momentum;
  o.bn_eps = cfg.bn_eps;
  o.pretrained = cfg.pretrained;
  o.pretrained_path = cfg.pretrained_path;
  o.loss.smoothing = cfg.smoothing;
  o.loss.bce = cfg.bce_loss;
  o.loss.bce_target_thresh = cfg.bce_target_thresh;
  o.loss.bce_sum = cfg.bce_sum;
  o.mixup.mixup_alpha = cfg.mixup;
  o.mixup.cutmix_alpha = cfg.cutmix;
  o.mixup.cutmix_minmax = cfg.cutmix_minmax;
  o.mixup.prob = cfg.mixup_prob;
  o.mixup.switch_prob = cfg.mixup_switch_prob;
  o.mixup.mode = cfg.mixup_mode;
  o.mixup.label_smoothing = cfg.smoothing;
  o.mixup.num_classes = num_classes;
  o.mixup_off_epoch = cfg.mixup_off_epoch;
  if (cfg.reprob > 0 && !cfg.no_aug) {
    data::RandomErasingConfig re;
    re.probability = cfg.reprob;
    re.mode = data::parse_erase_mode(cfg.remode);
    re.max_count = int(cfg.recount);
    o.erase = re;
  }
  o.seed = uint64_t(cfg.seed);
  o.rank = rank;
  s.task = std::make_unique<ClassificationTask>(std::move(o));

  auto& tc = s.train_transform;
  tc = cli::train_geometry(cfg, int(dc.img_size), int(dc.in_chans));
  tc.no_aug = cfg.no_aug;
  tc.vflip = cfg.vflip;
  if (!cfg.aa.empty() && !cfg.no_aug) {
    auto hp = data::timm_aa_hparams(cfg.aa, int(dc.img_size), dc.mean, cfg.train_interpolation);
    tc.auto_augment = std::make_shared<const data::AugmentPolicy>(data::parse_augment(cfg.aa, hp));
  }
  // timm: colour jitter only without an --aa policy (or with a '3a' one)
  tc.color_jitter = cfg.aa.empty() || cfg.aa.find("3a") != std::string::npos ? cfg.color_jitter : 0.0;
  s.eval_transform = tc;
  s.eval_transform.train = false;
  s.eval_transform.crop_pct = dc.crop_pct;
  s.eval_transform.interpolation = dc.interpolation;

  s.model_meta = classification_meta(cfg.model, num_classes, dc, cfg.gp);
  return s;
}

TaskSetup classification_validate_setup(const cli::Config& cfg, const engine::CheckpointMeta* meta) {
  TaskSetup s;
  const engine::CheckpointMeta none;
  const auto& m = meta ? *meta : none;
  std::string arch = cfg.model;
  if (!m.arch.empty() && cfg.model == cli::Config{}.model) arch = m.arch;  // --model at its default: the checkpoint's
  const auto& defaults = model_zoo::model_defaults(arch);
  engine::DataOverrides o{cfg.in_chans, cfg.img_size, cfg.crop_pct, cfg.interpolation};
  if (!o.in_chans) o.in_chans = m.in_chans;
  std::string gp = cfg.gp;
  if (gp.empty() && m.global_pool) gp = *m.global_pool;
  if (!o.img_size) {
    o.img_size = m.img_size;  // a checkpoint's own training size and eval crop
    if (o.img_size && !o.crop_pct) o.crop_pct = m.crop_pct;
  }
  if (!o.img_size && !cfg.use_train_size && defaults.test_input_size) {  // timm: the test size by default
    o.img_size = defaults.test_input_size;
    if (!o.crop_pct && defaults.test_crop_pct > 0) o.crop_pct = defaults.test_crop_pct;
  }
  s.data = engine::resolve_data_config(o, defaults);
  const auto& dc = s.data;
  s.eval = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.split);
  const int64_t num_classes = cfg.num_classes.value_or(m.num_classes.value_or(s.eval->num_classes()));
  check_labels(*s.eval, num_classes, cfg.split);

  ClassificationOptions co;
  co.model = arch;
  co.model_args = cli::model_args(cfg, num_classes, dc.in_chans, dc.img_size);
  co.model_args.global_pool = gp;
  co.pretrained = cfg.pretrained;
  co.pretrained_path = cfg.pretrained_path;
  s.task = std::make_unique<ClassificationTask>(std::move(co));
  s.eval_transform.size = int(dc.img_size);
  s.eval_transform.channels = int(dc.in_chans);
  s.eval_transform.crop_pct = dc.crop_pct;
  s.eval_transform.interpolation = dc.interpolation;
  s.model_meta = classification_meta(arch, num_classes, dc, gp);
  return s;
}

}  // namespace

TaskSetup create_validate_task(const cli::Config& cfg, const engine::CheckpointMeta* meta) {
  std::string arch = cfg.model;
  if (meta && !meta->arch.empty() && cfg.model == cli::Config{}.model) arch = meta->arch;
  const std::string task = model_zoo::model_task(arch);
  if (task == "classification") return classification_validate_setup(cfg, meta);
  throw UserError(fmt::format("--model {}: a {} model; imgtrain validates only classification models so far", arch,
                              task));
}

TaskSetup create_train_task(const cli::Config& cfg, int64_t rank, int64_t world) {
  const std::string task = model_zoo::model_task(cfg.model);
  cli::check_flags_for_task(cfg, task, cfg.model);
  if (task == "classification") return classification_setup(cfg, rank, world);
  throw UserError(fmt::format("--model {}: a {} model; imgtrain trains only classification models so far", cfg.model,
                              task));
}

}  // namespace imgtrain::tasks
