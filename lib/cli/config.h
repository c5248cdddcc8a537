// Flag schema with timm's names, the YAML config merge (-c: the file sets defaults, the command
// line overrides) and validation into a plain Config struct. Errors are UserErrors naming the
// flag or key, the value and what is accepted.
#pragma once
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace imgtrain::cli {

// UserError "unknown flag '--x' for <command> (did you mean --y?)" for the first argument that is
// neither one of the `known` long flags nor one of the `short_flags` letters (-b, -j, ...); values
// such as -1 or -.5 are not flags.
void refuse_unknown_flags(const std::vector<std::string>& args, const std::vector<std::string>& known,
                          const std::string& short_flags, const std::string& command);

struct Config {
  // model
  std::string model = "resnet50";
  bool pretrained = false;
  std::string pretrained_path;
  std::string initial_checkpoint;
  std::string resume;
  bool no_resume_opt = false;
  std::optional<int64_t> num_classes;
  std::optional<int64_t> img_size;
  std::optional<int64_t> in_chans;
  std::string gp;  // global pool type, "" = the model's default
  std::optional<double> crop_pct;
  std::string interpolation;
  std::string crop_mode;     // "" = the model's (timm: center)
  std::vector<double> mean, std_dev;  // --mean / --std: normalisation overrides (empty: the model's)
  bool fast_decode = false;  // eval JPEGs through the DCT-domain downscale (not timm's pixels)
  int64_t batch_size = 128;
  std::optional<int64_t> validation_batch_size;
  std::string device = "auto";
  bool amp = false;
  std::string amp_dtype = "float16";
  std::string amp_opt_level;  // apex names: O0 (off), O1 (autocast); '' = from --amp
  std::optional<double> loss_scale;
  std::string checkpoint;  // validate
  bool use_ema = false;    // validate
  // optimizer
  std::string opt = "sgd";
  std::string opt_impl = "auto";
  double momentum = 0.9;
  double weight_decay = 2e-5;
  std::optional<double> opt_eps;
  std::optional<double> layer_decay;
  std::optional<double> bn_momentum, bn_eps;
  int64_t recovery_interval = 0;
  std::vector<double> opt_betas;  // empty: the optimizer's defaults
  std::optional<double> clip_grad;
  std::string clip_mode = "norm";
  int64_t grad_accum_steps = 1;
  // schedule
  std::string sched = "cosine";
  std::optional<double> lr;
  double lr_base = 0.1;
  int64_t lr_base_size = 256;
  std::string lr_base_scale;
  double warmup_lr = 1e-5;
  double min_lr = 0.0;
  int64_t epochs = 300;
  std::optional<int64_t> start_epoch;
  double decay_epochs = 90;
  int64_t patience_epochs = 10;
  bool sched_on_updates = false;
  double lr_cycle_mul = 1.0;
  double lr_cycle_decay = 0.5;
  int64_t lr_cycle_limit = 1;
  double lr_k_decay = 1.0;
  std::vector<double> decay_milestones{90, 180, 270};
  int64_t warmup_epochs = 5;
  bool warmup_prefix = false;
  int64_t cooldown_epochs = 0;
  double decay_rate = 0.1;
  // torchvision's / Detectron2's schedule names
  std::vector<double> lr_steps;          // torch MultiStepLR milestones (epochs, or updates with max_iter)
  std::optional<double> lr_gamma;       // their factor (= --decay-rate)
  std::optional<int64_t> warmup_iters;   // warmup length in optimizer updates
  std::optional<double> warmup_factor;   // warmup starts at lr * this (instead of --warmup-lr)
  std::optional<int64_t> max_iter;       // train this many updates; schedule lengths count updates
  std::optional<int64_t> ims_per_batch;  // Detectron2's SOLVER.IMS_PER_BATCH: batch summed over processes
  // augmentation / regularisation
  bool no_aug = false;
  std::vector<double> scale{0.08, 1.0};
  std::vector<double> ratio{3.0 / 4.0, 4.0 / 3.0};
  double hflip = 0.5;
  double vflip = 0.0;
  std::string aa;             // --aa policy string ('' = none)
  double color_jitter = 0.4;  // used when --aa is unset (or a '3a' policy)
  double reprob = 0.0;
  std::string remode = "pixel";
  int64_t recount = 1;
  std::string train_interpolation = "random";
  double smoothing = 0.1;
  double mixup = 0.0;
  double cutmix = 0.0;
  std::vector<double> cutmix_minmax;  // empty: unset
  double mixup_prob = 1.0;
  double mixup_switch_prob = 0.5;
  std::string mixup_mode = "batch";
  int64_t mixup_off_epoch = 0;
  bool bce_loss = false;
  std::optional<double> bce_target_thresh;
  bool bce_sum = false;
  double drop = 0.0;
  std::optional<double> drop_path;
  // EMA
  bool model_ema = false;
  bool model_ema_force_cpu = false;
  double model_ema_decay = 0.9998;
  bool model_ema_warmup = false;
  // data
  std::string data_dir;
  std::string dataset;
  std::string train_split = "train";
  std::string input_key;  // timm --input-key: an ImageFolder's extensions, ";"-separated
  std::string class_map;  // timm --class-map: a .txt of class names, one a line
  std::string val_split = "validation";
  std::string split = "validation";  // validate
  int64_t workers = 4;
  int64_t max_image_pixels = 2 * 89478485;  // PIL's decompression-bomb limit (2 x Image.MAX_IMAGE_PIXELS)
  bool pin_mem = false;
  // Batches in pinned memory: on CUDA unless --pin-mem=false was given (timm's prefetcher overlaps
  // the copy with compute, which needs pinned memory); never elsewhere.
  bool pinned_batches(bool cuda) const { return cuda && (pin_mem || !was_given("pin-mem")); }
  // misc
  int64_t seed = 42;
  int64_t log_interval = 50;
  int64_t checkpoint_hist = 10;
  std::string output;
  std::string experiment;
  // --log-tensorboard [DIR]: "" off, "true" (the flag alone) the run's folder, else DIR
  std::string log_tensorboard;
  std::string eval_metric = "top1";
  std::string config_file;
  // validate / benchmark
  std::string results_file;
  std::string results_format = "csv";
  bool use_train_size = false;
  std::string bench = "both";
  bool profile = false;
  bool cuda_graph = false;
  bool fuse_bn = false;  // benchmark inference: on unless --fuse-bn=false; else off unless given (fuse_bn_on)
  int64_t num_warm_iter = 10;
  int64_t num_bench_iter = 40;
  bool channels_last = false;
  bool tf32 = false;  // CUDA: TF32 for float32 matmuls (cuBLAS) and convolutions (cuDNN)
  // distributed
  int64_t nproc_per_node = 0;  // > 0: launch this many workers (imgtrain's torchrun)
  int64_t nnodes = 1;
  int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;  // 0: a free port (single node)
  std::string dist_url;     // Detectron2's --dist-url tcp://host:port (sets master_addr / master_port)
  std::string rdzv_id;      // the job's id all nodes agree on ("": node 0's launcher picks one)
  int64_t rdzv_timeout = 600;  // seconds the nodes' launchers wait for each other (torchrun's join timeout)
  std::string dist_backend = "auto";
  int64_t dist_timeout = 1800;  // seconds
  double bucket_cap_mb = 25.0;
  bool sync_bn = false;
  std::string dist_bn = "reduce";
  double aug_repeats = 0.0;
  bool no_ddp_bb = false;
  int64_t local_rank = 0;  // accepted for timm compatibility; the environment's LOCAL_RANK rules
  // detection (torchvision's references/detection flags)
  std::string task;  // "" = the model's task; classification | detection must match it
  int64_t aspect_ratio_group_factor = 3;
  bool two_bucket_grouping = false;  // Detectron2's AspectRatioGroupedDataset: landscape / the rest
  std::optional<int64_t> trainable_backbone_layers;
  double rpn_score_thresh = 0.0;
  std::string data_augmentation = "hflip";
  int64_t lsj_size = 1024;                 // --data-augmentation lsj: ScaleJitter / FixedSizeCrop side
  std::vector<double> lsj_scale{0.1, 2.0};  // and ScaleJitter's scale range
  std::vector<double> min_size{800};
  std::optional<double> min_size_test;  // evaluation's shorter side ("" = the last --min-size)
  double max_size = 1333;
  // torchvision's FasterRCNN keyword arguments (Detectron2's MODEL.RPN.* / MODEL.ROI_HEADS.* keys)
  int64_t rpn_pre_nms_top_n_train = 2000, rpn_pre_nms_top_n_test = 1000;
  int64_t rpn_post_nms_top_n_train = 2000, rpn_post_nms_top_n_test = 1000;
  double rpn_nms_thresh = 0.7;
  int64_t rpn_batch_size_per_image = 256;
  int64_t box_batch_size_per_image = 512;
  double box_score_thresh = 0.05, box_nms_thresh = 0.5;
  int64_t box_detections_per_img = 100;
  int64_t box_sampling_ratio = 2;
  double roi_canonical_size = 224;
  int64_t mask_rois_per_image = 0;
  bool roi_align_v2 = false;
  std::string mask_convention = "torchvision";
  std::string box_loss = "smooth_l1";
  std::string rpn_box_loss = "smooth_l1";
  // widths of the detector (torchvision's 256 / 1024 / 256 / 4)
  int64_t fpn_channels = 256, box_head_dim = 1024, mask_head_dim = 256, mask_head_convs = 4;

  // The flags (long names) the command line or the -c file set, for checks that a flag given
  // where it has no effect is an error rather than silently ignored.
  std::set<std::string> given;
  bool was_given(const std::string& flag) const { return given.count(flag) > 0; }
  // --model on the command line or in the -c file, even at its default value (validate takes the
  // checkpoint's model only when neither names one).
  bool model_named() const { return model != Config{}.model || was_given("model") || in_file.count("model") > 0; }
  // --fuse-bn as given, else `default_on`.
  bool fuse_bn_on(bool default_on) const { return was_given("fuse-bn") ? fuse_bn : default_on; }
  // --channels-last as given, else `default_on`.
  bool channels_last_on(bool default_on) const { return was_given("channels-last") ? channels_last : default_on; }
  std::set<std::string> in_file;  // the flags the -c file names, at any value
};

enum class Command { Train, Validate, Benchmark };

// Parses args (without the program and subcommand names). Returns nullopt when --help was given
// (the help text has been printed). Throws UserError on any bad input.
std::optional<Config> parse(Command cmd, const std::vector<std::string>& args);

// Flags that belong to one task (mixup, label smoothing, RandAugment, ... are classification's):
// UserError when one was given for a model of another `task` ("detection").
void check_flags_for_task(const Config& c, const std::string& task, const std::string& model);

// timm's args.yaml: every flag of `cmd` as `key: value`, readable back with -c.
std::string to_yaml(Command cmd, const Config& c);

}  // namespace imgtrain::cli
