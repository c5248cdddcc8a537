#include "tasks/tasks.h"

#include "cli/adapters.h"
#include "core/error.h"
#include "core/log.h"
#include "model_zoo/registry.h"
#include "tasks/classification/classification.h"
#include "tasks/detection/detection.h"

#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string_view>

namespace imgtrain::tasks {
namespace {

// `from`: where num_classes came from, when not from --num-classes ("the train split", a checkpoint)
void check_labels(const data::Dataset& ds, int64_t num_classes, const std::string& what,
                  const std::string& from = "") {
  if (ds.num_classes() > num_classes)
    throw UserError(from.empty() ? fmt::format("--num-classes {}: the {} split has {} classes", num_classes, what,
                                               ds.num_classes())
                                 : fmt::format("the {} split has {} classes, but {} has {}", what, ds.num_classes(),
                                               from, num_classes));
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

data::FolderOptions folder_options(const cli::Config& cfg) { return {cfg.input_key, cfg.class_map}; }

TaskSetup classification_setup(const cli::Config& cfg, int64_t rank, int64_t world) {
  TaskSetup s;
  const auto& defaults = model_zoo::model_defaults(cfg.model);  // unknown model fails before data loading
  s.data = engine::resolve_data_config(
      {cfg.in_chans, cfg.img_size, cfg.crop_pct, cfg.interpolation, cfg.crop_mode, cfg.mean, cfg.std_dev}, defaults);
  s.train = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.train_split, folder_options(cfg));
  s.eval = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.val_split, folder_options(cfg));
  const int64_t num_classes = cfg.num_classes.value_or(s.train->num_classes());
  check_labels(*s.train, num_classes, "train");
  check_labels(*s.eval, num_classes, "validation", cfg.num_classes ? "" : "the train split");
  // ImageFolder labels are each split's sorted folder names: different folders shift the labels
  // (timm does the same, silently)
  // (class_names() returns a copy: the two lists are held, their iterators compared)
  const auto train_names = s.train->class_names(), eval_names = s.eval->class_names();
  if (!eval_names.empty() && eval_names.size() <= train_names.size() &&
      !std::equal(eval_names.begin(), eval_names.end(), train_names.begin()))
    log::warn("the validation split's classes ({}) are not the train split's ({}): labels follow each split's own "
              "sorted folder names, so they do not match",
              fmt::join(eval_names, ", "), fmt::join(train_names, ", "));

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
  s.eval_transform.crop_mode = dc.crop_mode;
  s.eval_transform.mean = dc.mean;
  s.eval_transform.fast_decode = cfg.fast_decode;

  s.model_meta = classification_meta(cfg.model, num_classes, dc, cfg.gp);
  return s;
}

// A list of numbers in a checkpoint's args.yaml, or {} (absent, empty, or not numbers).
std::vector<double> numbers_arg(const engine::CheckpointMeta& m, const std::string& key) {
  const YAML::Node v = m.arg_node(key);
  if (!v || !v.IsSequence()) return {};
  try {
    return v.as<std::vector<double>>();
  } catch (const YAML::Exception&) {
    return {};
  }
}

TaskSetup classification_validate_setup(const cli::Config& cfg, const engine::CheckpointMeta* meta) {
  TaskSetup s;
  const engine::CheckpointMeta none;
  const auto& m = meta ? *meta : none;
  std::string arch = cfg.model;
  if (!m.arch.empty() && !cfg.model_named()) arch = m.arch;  // no --model: the checkpoint's
  const auto& defaults = model_zoo::model_defaults(arch);
  engine::DataOverrides o{cfg.in_chans, cfg.img_size, cfg.crop_pct, cfg.interpolation, cfg.crop_mode};
  if (!o.in_chans) o.in_chans = m.in_chans;
  std::string gp = cfg.gp, gp_from = "--gp";
  if (gp.empty() && m.global_pool) {
    gp = *m.global_pool;
    gp_from = fmt::format("'{}': metadata 'global_pool'", cfg.checkpoint);
  }
  bool size_from_checkpoint = false;
  if (!o.img_size && m.img_size) {  // a checkpoint's own training size and eval crop
    o.img_size = m.img_size;
    size_from_checkpoint = true;
    if (!o.crop_pct) o.crop_pct = m.crop_pct;
  }
  // the run's --mean / --std (its args.yaml) unless given: its weights were trained on that input
  o.mean = cfg.mean.empty() ? numbers_arg(m, "mean") : cfg.mean;
  o.std_dev = cfg.std_dev.empty() ? numbers_arg(m, "std") : cfg.std_dev;
  // timm (resolve_data_config with use_test_size): the test size unless --img-size, and the test
  // crop unless --crop-pct, also with --img-size
  if (!cfg.use_train_size && !size_from_checkpoint) {
    if (!o.img_size && defaults.test_input_size) o.img_size = defaults.test_input_size;
    if (!o.crop_pct && defaults.test_crop_pct > 0) o.crop_pct = defaults.test_crop_pct;
  }
  s.data = engine::resolve_data_config(o, defaults);
  const auto& dc = s.data;
  s.eval = data::create_dataset(cfg.dataset, cfg.data_dir, cfg.split, folder_options(cfg));
  // The class count: --num-classes, else the checkpoint's, else the pretrained weights' classifier
  // (timm builds the model with its pretrained head: a classifier initialised for the folder's
  // count would be scored at random), else the folder's.
  std::optional<int64_t> weights_classes;
  std::string weights_file;
  if (!cfg.num_classes && !m.num_classes && (cfg.pretrained || !cfg.pretrained_path.empty())) {
    weights_file = pretrained_weights_path(arch, cfg.pretrained, cfg.pretrained_path);
    weights_classes = weights_class_count(weights_file, defaults.classifier);
  }
  const int64_t num_classes =
      cfg.num_classes.value_or(m.num_classes.value_or(weights_classes.value_or(s.eval->num_classes())));
  check_labels(*s.eval, num_classes, cfg.split,
               cfg.num_classes                ? ""
               : m.num_classes                ? fmt::format("the checkpoint '{}'", cfg.checkpoint)
               : weights_classes.has_value() ? fmt::format("the classifier of '{}'", weights_file)
                                              : "");

  ClassificationOptions co;
  co.model = arch;
  co.model_args = cli::model_args(cfg, num_classes, dc.in_chans, dc.img_size);
  co.model_args.global_pool = gp;
  co.model_args.global_pool_from = gp_from;
  co.pretrained = cfg.pretrained;
  co.pretrained_path = cfg.pretrained_path;
  co.scored_as_loaded = true;
  s.task = std::make_unique<ClassificationTask>(std::move(co));
  s.eval_transform.size = int(dc.img_size);
  s.eval_transform.channels = int(dc.in_chans);
  s.eval_transform.crop_pct = dc.crop_pct;
  s.eval_transform.interpolation = dc.interpolation;
  s.eval_transform.crop_mode = dc.crop_mode;
  s.eval_transform.mean = dc.mean;
  s.eval_transform.fast_decode = cfg.fast_decode;
  s.model_meta = classification_meta(arch, num_classes, dc, gp);
  return s;
}


// ---- detection ----------------------------------------------------------------------------------

// The COCO split to read: the flag's value, or COCO's own name for the defaults ("validation" -> val).
std::string coco_split(const std::string& split, bool given) {
  if (!given && split == "validation") return "val";
  return split;
}

// Contiguous labels 1..K by default (Detectron2's mapping, K + 1 classes); --num-classes 91 on
// COCO keeps the json's category ids as labels (torchvision's COCO models).
std::shared_ptr<data::CocoDetection> open_detection_split(const cli::Config& cfg, const std::string& split, bool train,
                                                          bool masks) {
  if (cfg.dataset != "coco")
    throw UserError(fmt::format("--dataset '{}': detection models train on COCO-style data; use --dataset coco",
                                cfg.dataset));
  if (cfg.data_dir.empty()) throw UserError("--data-dir: required (the COCO root with annotations/)");
  if (!cfg.input_key.empty())
    throw UserError("--input-key picks an ImageFolder's file extensions; it has no effect with --dataset coco");
  if (!cfg.class_map.empty())
    throw UserError("--class-map names an ImageFolder's classes; it has no effect with --dataset coco");
  data::CocoOptions co;
  co.train = train;
  co.masks = masks;
  auto ds = data::open_coco(cfg.data_dir, split, "", co);
  if (cfg.num_classes && *cfg.num_classes != ds->num_classes()) {
    co.contiguous_labels = false;  // labels are the category ids: the model needs max id + 1 classes
    auto by_id = data::open_coco(cfg.data_dir, split, "", co);
    if (*cfg.num_classes < by_id->num_classes())
      throw UserError(fmt::format("--num-classes {}: the {} split has {} categories (contiguous labels need {}; "
                                  "labels by category id need {})",
                                  *cfg.num_classes, split, ds->num_classes() - 1, ds->num_classes(),
                                  by_id->num_classes()));
    ds = by_id;
  }
  for (auto& w : ds->warnings()) log::warn("{}", w);
  if (!train && std::none_of(ds->coco().annotations.begin(), ds->coco().annotations.end(),
                             [](const auto& a) { return !a.iscrowd; }))
    log::warn("the {} split has no annotations to score against: every AP is -1 (pycocotools' value), so no "
              "checkpoint is better than another by it",
              split);
  if (ds->removed_images())
    log::info("{}: {} image(s) without a usable annotation left out of training", split, ds->removed_images());
  return ds;
}

model_zoo::detection::RCNNOptions rcnn_options(const cli::Config& cfg, int64_t num_classes) {
  model_zoo::detection::RCNNOptions o;
  o.num_classes = num_classes;
  o.from_weights = !cfg.pretrained_path.empty();
  if (cfg.trainable_backbone_layers) o.trainable_backbone_layers = *cfg.trainable_backbone_layers;
  o.rpn_score_thresh = cfg.rpn_score_thresh;
  o.rpn_pre_nms_top_n_train = cfg.rpn_pre_nms_top_n_train;
  o.rpn_pre_nms_top_n_test = cfg.rpn_pre_nms_top_n_test;
  o.rpn_post_nms_top_n_train = cfg.rpn_post_nms_top_n_train;
  o.rpn_post_nms_top_n_test = cfg.rpn_post_nms_top_n_test;
  o.rpn_nms_thresh = cfg.rpn_nms_thresh;
  o.rpn_batch_size_per_image = cfg.rpn_batch_size_per_image;
  o.box_batch_size_per_image = cfg.box_batch_size_per_image;
  o.box_score_thresh = cfg.box_score_thresh;
  o.box_nms_thresh = cfg.box_nms_thresh;
  o.box_detections_per_img = cfg.box_detections_per_img;
  o.box_sampling_ratio = o.mask_sampling_ratio = cfg.box_sampling_ratio;
  o.roi_aligned = cfg.roi_align_v2;
  o.mask_convention = model_zoo::detection::parse_mask_convention(cfg.mask_convention);
  o.roi_canonical_size = cfg.roi_canonical_size;
  o.mask_rois_per_image = cfg.mask_rois_per_image;
  o.box_loss = cfg.box_loss;
  o.rpn_box_loss = cfg.rpn_box_loss;
  o.fpn_channels = cfg.fpn_channels;
  o.box_head_dim = cfg.box_head_dim;
  o.mask_head_dim = cfg.mask_head_dim;
  o.mask_head_convs = cfg.mask_head_convs;
  return o;
}

double eval_min_size(const cli::Config& cfg) { return cfg.min_size_test.value_or(cfg.min_size.back()); }

engine::DataConfig detection_data_config(const cli::Config& cfg, const std::string& arch) {
  const auto& d = model_zoo::model_defaults(arch);
  engine::DataConfig dc;
  dc.in_chans = 3;
  dc.img_size = int64_t(eval_min_size(cfg));
  dc.crop_pct = 1.0;
  dc.mean.assign(d.mean.begin(), d.mean.end());
  dc.std.assign(d.std.begin(), d.std.end());
  return dc;
}

engine::CheckpointMeta detection_meta(const std::string& arch, int64_t num_classes, const engine::DataConfig& dc,
                                      const cli::Config& cfg) {
  engine::CheckpointMeta m;
  m.arch = arch;
  m.fpn_channels = cfg.fpn_channels;
  m.box_head_dim = cfg.box_head_dim;
  m.mask_head_dim = cfg.mask_head_dim;
  m.mask_head_convs = cfg.mask_head_convs;
  m.roi_canonical_size = cfg.roi_canonical_size;
  m.box_sampling_ratio = cfg.box_sampling_ratio;
  m.roi_align_v2 = cfg.roi_align_v2 ? 1 : 0;
  m.mask_convention = cfg.mask_convention;
  m.task = "detection";
  m.num_classes = num_classes;
  m.in_chans = 3;
  m.img_size = dc.img_size;
  return m;
}

std::vector<int64_t> to_sizes(const std::vector<double>& v) {
  std::vector<int64_t> out;
  for (double d : v) out.push_back(int64_t(d));
  return out;
}


TaskSetup detection_setup(const cli::Config& given, int64_t rank, int64_t world) {
  const cli::Config cfg = with_model_defaults(given);
  TaskSetup s;
  if (cfg.in_chans && *cfg.in_chans != 3) throw UserError("--in-chans: detection models take 3-channel images");
  if (cfg.img_size) throw UserError("--img-size: detection models resize by --min-size / --max-size");
  if (!cfg.mean.empty() || !cfg.std_dev.empty())
    throw UserError("--mean / --std: detection models normalise inside the model, with torchvision's ImageNet values");
  const bool masks = model_zoo::detection::rcnn_has_mask(cfg.model);
  s.data = detection_data_config(cfg, cfg.model);
  auto train = open_detection_split(cfg, coco_split(cfg.train_split, true), true, masks);
  auto eval = open_detection_split(cfg, coco_split(cfg.val_split, cfg.was_given("val-split")), false, masks);
  s.train = train;
  s.eval = eval;
  if (int64_t(train->size()) / world < cfg.batch_size)
    throw UserError(fmt::format("--batch-size {}: the train split has only {} usable images for {} process(es)",
                                cfg.batch_size, train->size(), world));
  const int64_t num_classes = train->num_classes();
  DetectionOptions o;
  o.model = cfg.model;
  o.rcnn = rcnn_options(cfg, num_classes);
  o.pretrained_path = cfg.pretrained_path;
  o.eval_min_size = eval_min_size(cfg);
  o.max_size = cfg.max_size;
  o.seed = uint64_t(cfg.seed);
  o.rank = rank;
  o.eval_data = eval;
  s.task = std::make_unique<DetectionTask>(std::move(o));
  auto& tc = s.train_transform;
  tc.train = true;
  tc.no_aug = cfg.no_aug;
  tc.channels = 3;
  tc.hflip = cfg.hflip;
  tc.min_sizes = to_sizes(cfg.min_size);
  if (cfg.data_augmentation == "multiscale" && !cfg.was_given("min-size"))
    tc.min_sizes = {480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800};  // torchvision's presets
  if (cfg.data_augmentation == "lsj") {
    tc.lsj_size = cfg.lsj_size;
    tc.lsj_scale = cfg.lsj_scale;
  }
  s.eval_transform = tc;
  s.eval_transform.train = false;
  s.eval_transform.min_sizes = {int64_t(eval_min_size(cfg))};
  s.sharded_eval = true;
  s.model_meta = detection_meta(cfg.model, num_classes, s.data, cfg);
  return s;
}

TaskSetup detection_validate_setup(const cli::Config& given, const engine::CheckpointMeta* meta,
                                   const std::string& arch) {
  cli::Config cfg = with_model_defaults(given, arch);
  // The widths, level mapper and RoIAlign the checkpoint's detector was trained with, unless a flag
  // names them.
  auto restore = [&](const char* flag, auto& v, const auto& from_meta) {
    if (from_meta && !cfg.was_given(flag) && !cfg.in_file.count(flag))
      v = static_cast<std::decay_t<decltype(v)>>(*from_meta);
  };
  if (meta) {
    restore("fpn-channels", cfg.fpn_channels, meta->fpn_channels);
    restore("box-head-dim", cfg.box_head_dim, meta->box_head_dim);
    restore("mask-head-dim", cfg.mask_head_dim, meta->mask_head_dim);
    restore("mask-head-convs", cfg.mask_head_convs, meta->mask_head_convs);
    restore("roi-canonical-size", cfg.roi_canonical_size, meta->roi_canonical_size);
    restore("box-sampling-ratio", cfg.box_sampling_ratio, meta->box_sampling_ratio);
    restore("roi-align-v2", cfg.roi_align_v2, meta->roi_align_v2);
    restore("mask-convention", cfg.mask_convention, meta->mask_convention);
    // and the resize it was evaluated at in training (its metadata's img_size: the eval min size;
    // --max-size from its args.yaml), unless a flag names them
    auto named = [&](const char* flag) { return cfg.was_given(flag) || cfg.in_file.count(flag) > 0; };
    if (meta->img_size && !named("min-size") && !named("min-size-test")) cfg.min_size_test = double(*meta->img_size);
    if (!named("max-size"))
      if (const auto v = meta->arg("max_size")) {
        char* end = nullptr;
        const double d = std::strtod(v->c_str(), &end);
        if (end != v->c_str() && *end == '\0' && d > 0) cfg.max_size = d;
      }
  }
  TaskSetup s;
  const bool masks = model_zoo::detection::rcnn_has_mask(arch);
  s.data = detection_data_config(cfg, arch);
  auto eval = open_detection_split(cfg, coco_split(cfg.split, cfg.was_given("split")), false, masks);
  s.eval = eval;
  const int64_t num_classes = cfg.num_classes.value_or(meta && meta->num_classes ? *meta->num_classes
                                                                                  : eval->num_classes());
  if (num_classes < eval->num_classes())
    throw UserError(fmt::format("--num-classes {}: the {} split has {} classes", num_classes, cfg.split,
                                eval->num_classes()));
  DetectionOptions o;
  o.model = arch;
  o.rcnn = rcnn_options(cfg, num_classes);
  o.rcnn.from_weights = false;
  o.pretrained_path = cfg.pretrained_path;
  o.eval_min_size = eval_min_size(cfg);
  o.max_size = cfg.max_size;
  o.eval_data = eval;
  o.results_path = cfg.results_file.empty() ? "" : cfg.results_file + ".detections.json";
  engine::require_writable(o.results_path, "--results-file (its detections)");
  s.task = std::make_unique<DetectionTask>(std::move(o));
  s.eval_transform.channels = 3;
  s.eval_transform.min_sizes = {int64_t(eval_min_size(cfg))};
  s.sharded_eval = true;
  s.validate_batch_size = 1;
  s.model_meta = detection_meta(arch, num_classes, s.data, cfg);
  return s;
}

}  // namespace

std::shared_ptr<torch::nn::Module> module_from_meta(const engine::CheckpointMeta& m, const std::string& what) {
  if (model_zoo::model_task(m.arch) == "detection") {
    model_zoo::detection::RCNNOptions o;
    if (m.num_classes) o.num_classes = *m.num_classes;
    if (m.fpn_channels) o.fpn_channels = *m.fpn_channels;
    if (m.box_head_dim) o.box_head_dim = *m.box_head_dim;
    if (m.mask_head_dim) o.mask_head_dim = *m.mask_head_dim;
    if (m.mask_head_convs) o.mask_head_convs = *m.mask_head_convs;
    return model_zoo::detection::create_rcnn(m.arch, o).ptr();
  }
  ModelArgs margs;
  if (m.num_classes) margs.num_classes = *m.num_classes;
  if (m.in_chans) margs.in_chans = *m.in_chans;
  if (m.img_size) margs.img_size = *m.img_size;
  if (m.global_pool) margs.global_pool = *m.global_pool;
  margs.global_pool_from = fmt::format("'{}': metadata 'global_pool'", what);
  return model_zoo::create_module(m.arch, margs);
}

cli::Config with_model_defaults(const cli::Config& given, const std::string& arch_or_empty) {
  const std::string arch = arch_or_empty.empty() ? given.model : arch_or_empty;
  if (model_zoo::model_task(arch) != "detection") return given;
  cli::Config cfg = given;
  const auto d = model_zoo::detection::rcnn_defaults(arch);
  auto user = [&](const char* f) { return cfg.was_given(f) || cfg.in_file.count(f); };
  if (!user("min-size")) cfg.min_size = {d.min_size};
  if (!user("max-size")) cfg.max_size = d.max_size;
  if (!user("rpn-pre-nms-top-n-test")) cfg.rpn_pre_nms_top_n_test = d.rpn_pre_nms_top_n_test;
  if (!user("rpn-post-nms-top-n-test")) cfg.rpn_post_nms_top_n_test = d.rpn_post_nms_top_n_test;
  if (!user("rpn-score-thresh")) cfg.rpn_score_thresh = d.rpn_score_thresh;
  return cfg;
}

TaskSetup create_validate_task(const cli::Config& cfg, const engine::CheckpointMeta* meta) {
  std::string arch = cfg.model;
  if (meta && !meta->arch.empty() && !cfg.model_named()) {  // no --model: the checkpoint's
    arch = meta->arch;
    if (!model_zoo::find_model(arch))  // not blamed on a --model the user never gave
      throw UserError(fmt::format("--checkpoint: metadata 'arch' is '{}', a model imgtrain does not know "
                                  "(`imgtrain models` lists them; --model overrides the checkpoint's)",
                                  arch));
  }
  const std::string task = model_zoo::model_task(arch);
  cli::check_flags_for_task(cfg, task, arch);
  if (task == "classification") return classification_validate_setup(cfg, meta);
  return detection_validate_setup(cfg, meta, arch);
}

TaskSetup create_train_task(const cli::Config& cfg, int64_t rank, int64_t world) {
  const std::string task = model_zoo::model_task(cfg.model);
  cli::check_flags_for_task(cfg, task, cfg.model);
  if (task == "classification") return classification_setup(cfg, rank, world);
  return detection_setup(cfg, rank, world);
}

}  // namespace imgtrain::tasks
