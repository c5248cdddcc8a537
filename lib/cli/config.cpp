#include "cli/config.h"

#include "cli/detectron2.h"
#include "core/error.h"
#include "core/log.h"
#include "core/registry.h"

#include <cxxopts.hpp>
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <cstring>
#include <iostream>
#include <set>
#include <variant>

namespace imgtrain::cli {
namespace {

using Field = std::variant<int64_t Config::*, double Config::*, std::string Config::*, bool Config::*,
                           std::vector<double> Config::*, std::optional<int64_t> Config::*,
                           std::optional<double> Config::*>;

enum : unsigned { TRAIN = 1, VALIDATE = 2, BOTH = 3, BENCH = 4, ALL = 7 };

struct Flag {
  const char* name;   // long name, dashes (the YAML key is the same with underscores)
  const char* alias;  // "" or one alias: a short letter, "-vb", or another long name
  Field field;
  const char* help;
  unsigned cmds = TRAIN;
  std::vector<std::string> choices = {};
  // Extra range check: returns "" when fine, else what would be accepted.
  std::string (*check)(double) = nullptr;
  size_t nargs = 1;  // for list flags: exact count, 0 = one or more
  bool range = false;      // a list that is a 'low high' range
  bool may_be_empty = false;  // a list that may be left empty (the default is then used)
  const char* implicit = nullptr;  // a value that may be left out: the flag alone means this
};

std::string positive(double v) { return v > 0 ? "" : "a positive number"; }
std::string jitter_scale(double v) { return v > 0 && v <= 16 ? "" : "a number in (0, 16]"; }
std::string non_negative(double v) { return v >= 0 ? "" : "a number >= 0"; }
std::string probability(double v) { return v >= 0 && v <= 1 ? "" : "a number in [0, 1]"; }
// above 1: the resized image is smaller than the crop, which pads it (timm / torchvision CenterCrop)
std::string crop_range(double v) { return v >= 0.05 && v <= 2 ? "" : "a number in [0.05, 2]"; }
std::string smoothing_range(double v) { return v >= 0 && v < 1 ? "" : "a number in [0, 1)"; }
// Limits that keep a typo from becoming an allocation of terabytes or a hundred thousand threads;
// each is far beyond what a real run uses.
std::string image_side(double v) { return v >= 1 && v <= 8192 ? "" : "an integer in [1, 8192]"; }
std::string class_count(double v) { return v >= 1 && v <= 1e6 ? "" : "an integer in [1, 1000000]"; }
std::string channel_count(double v) { return v == 1 || v == 3 ? "" : "1 (grayscale) or 3 (RGB)"; }
std::string thread_count(double v) { return v >= 0 && v <= 512 ? "" : "an integer in [0, 512]"; }
std::string epoch_count(double v) { return v >= 1 && v <= 1e6 ? "" : "an integer in [1, 1000000]"; }
std::string epoch_index(double v) { return v >= 0 && v < 1e6 ? "" : "an integer in [0, 999999]"; }
std::string batch_count(double v) { return v >= 1 && v <= 65536 ? "" : "an integer in [1, 65536]"; }
std::string update_count(double v) { return v >= 0 && v <= 1e9 ? "" : "an integer in [0, 1000000000]"; }

const std::vector<Flag>& flags() {
  static const std::vector<Flag> f = {
      // model
      {"model", "", &Config::model, "Name of the model (see `imgtrain models`)", ALL},
      {"pretrained", "", &Config::pretrained,
       "Start from timm's pretrained weights in the Hugging Face cache (offline; --model name.tag picks a tag)", BOTH},
      {"pretrained-path", "", &Config::pretrained_path,
       "Start from the weights in this safetensors file (benchmark: a detector's, to time given weights)", ALL},
      {"initial-checkpoint", "", &Config::initial_checkpoint, "Load this checkpoint's weights before training"},
      {"resume", "", &Config::resume, "Resume model, optimizer and schedule from this checkpoint"},
      {"no-resume-opt", "", &Config::no_resume_opt, "Do not restore optimizer state when resuming"},
      {"checkpoint", "", &Config::checkpoint, "Checkpoint to validate", VALIDATE},
      {"use-ema", "", &Config::use_ema, "Validate the EMA weights of the checkpoint", VALIDATE},
      {"num-classes", "", &Config::num_classes, "Number of label classes (default: from the dataset)", ALL, {},
       class_count},
      {"img-size", "", &Config::img_size, "Image size (default: the model's)", ALL, {}, image_side},
      {"gp", "", &Config::gp, "Global pool type: avg, max, avgmax, catavgmax (ViT: token, avg); model default if unset",
       ALL, {"", "avg", "max", "avgmax", "catavgmax", "token"}},
      {"in-chans", "", &Config::in_chans, "Image input channels (default: 3; 1 for grayscale)", ALL, {}, channel_count},
      {"crop-pct", "", &Config::crop_pct, "Eval center crop fraction (default: the model's)", BOTH | BENCH, {}, crop_range},
      {"interpolation", "", &Config::interpolation, "Eval interpolation (default: the model's)", BOTH | BENCH,
       {"", "nearest", "bilinear", "bicubic", "box", "hamming", "lanczos"}},
      {"crop-mode", "", &Config::crop_mode, "Eval crop: center, squash or border (default: the model's)", BOTH | BENCH,
       {"", "center", "squash", "border"}},
      {"fast-decode", "", &Config::fast_decode,
       "Eval: decode large JPEGs at 1/2, 1/4 or 1/8 scale before the resize (faster; pixels differ from timm's)",
       BOTH | BENCH},
      {"batch-size", "b", &Config::batch_size, "Input batch size per process", ALL, {}, batch_count},
      {"validation-batch-size", "-vb", &Config::validation_batch_size,
       "Validation batch size (default: --batch-size)", TRAIN, {}, batch_count},
      {"device", "", &Config::device, "Device: auto (cuda when available), cpu, cuda, cuda:N", ALL},
      {"amp", "", &Config::amp, "Mixed precision: autocast to --amp-dtype (with a loss scaler for float16)", ALL},
      {"amp-dtype", "", &Config::amp_dtype, "Autocast dtype", ALL, {"float16", "bfloat16"}},
      {"amp-opt-level", "", &Config::amp_opt_level, "apex-style level: O0 = fp32, O1 = autocast (as --amp), O2 = half weights with float32 master weights "
       "(BatchNorm kept in float32)", TRAIN,
       {"", "O0", "O1", "O2"}},
      {"loss-scale", "", &Config::loss_scale, "Static loss scale for float16 (default: dynamic scaling)", TRAIN, {},
       positive},
      // optimizer
      {"opt", "", &Config::opt, "Optimizer", TRAIN | BENCH,
       {"sgd", "nesterov", "momentum", "adam", "adamw", "rmsproptf", "lamb", "lambc", "lars", "larc", "nlars", "nlarc",
        "fusedsgd", "fusedadam", "fusedadamw"}},
      {"opt-impl", "", &Config::opt_impl,
       "How SGD and Adam(W) step: auto = ATen's fused SGD kernel (bitwise the loop on the CPU), Adam(W) looped on "
       "the CPU and multi-tensor on CUDA, as torch.optim; fused = ATen's fused kernels (within a rounding); foreach; "
       "loop = per-parameter loops",
       TRAIN | BENCH, {"auto", "loop", "foreach", "fused"}},
      {"layer-decay", "", &Config::layer_decay, "Layer-wise learning rate decay (timm's param_groups_layer_decay)",
       TRAIN, {}, positive},
      {"opt-eps", "", &Config::opt_eps, "Optimizer epsilon (default: the optimizer's)", TRAIN, {}, positive},
      {"opt-betas", "", &Config::opt_betas, "Optimizer betas (two numbers; default: the optimizer's)", TRAIN, {},
       probability, 2, false, true},
      {"clip-grad", "", &Config::clip_grad, "Clip gradients at this norm or value (default: no clipping)", TRAIN, {},
       positive},
      {"clip-mode", "", &Config::clip_mode, "Gradient clipping mode", TRAIN, {"norm", "value", "agc"}},
      {"grad-accum-steps", "accumulation-steps", &Config::grad_accum_steps,
       "Micro-batches accumulated per optimizer update", TRAIN, {}, positive},
      {"momentum", "", &Config::momentum, "Optimizer momentum", TRAIN, {}, non_negative},
      {"weight-decay", "", &Config::weight_decay, "Weight decay (none on biases and 1-D parameters)", TRAIN, {},
       non_negative},
      // schedule
      {"sched", "", &Config::sched, "LR scheduler", TRAIN, {"cosine", "tanh", "step", "multistep", "plateau", "poly"}},
      {"sched-on-updates", "", &Config::sched_on_updates, "Step the LR schedule per optimizer update, not per epoch"},
      {"lr-cycle-mul", "", &Config::lr_cycle_mul, "Cycle length multiplier (cosine, tanh, poly)", TRAIN, {}, positive},
      {"lr-cycle-decay", "", &Config::lr_cycle_decay, "LR decay per cycle (cosine, tanh, poly)", TRAIN, {},
       non_negative},
      {"lr-cycle-limit", "", &Config::lr_cycle_limit, "Number of cycles (cosine, tanh, poly)", TRAIN, {}, positive},
      {"lr-k-decay", "", &Config::lr_k_decay, "k-decay exponent (cosine, poly)", TRAIN, {}, positive},
      {"patience-epochs", "", &Config::patience_epochs, "Epochs without improvement before a plateau decay", TRAIN,
       {}, non_negative},
      {"lr", "", &Config::lr, "Learning rate (default: --lr-base scaled by the global batch size)", TRAIN, {},
       positive},
      {"lr-base", "", &Config::lr_base, "Base learning rate at --lr-base-size", TRAIN, {}, positive},
      {"lr-base-size", "", &Config::lr_base_size, "Batch size of --lr-base", TRAIN, {}, positive},
      {"lr-base-scale", "", &Config::lr_base_scale, "Scaling of --lr-base ('' = sqrt for ada*, else linear)", TRAIN,
       {"", "linear", "sqrt"}},
      {"warmup-lr", "", &Config::warmup_lr, "Warmup learning rate", TRAIN, {}, non_negative},
      {"min-lr", "", &Config::min_lr, "Lower lr bound for cyclic schedulers", TRAIN, {}, non_negative},
      {"epochs", "", &Config::epochs, "Number of epochs to train", TRAIN, {}, epoch_count},
      {"start-epoch", "", &Config::start_epoch, "Manual epoch number (useful on restarts)", TRAIN, {}, epoch_index},
      {"decay-epochs", "", &Config::decay_epochs, "Epoch interval to decay LR (step)", TRAIN, {}, positive},
      {"decay-milestones", "", &Config::decay_milestones, "Epochs at which to decay LR (multistep)", TRAIN, {},
       non_negative, 0},
      {"warmup-epochs", "", &Config::warmup_epochs, "Epochs to warm up LR", TRAIN, {}, non_negative},
      {"warmup-prefix", "", &Config::warmup_prefix, "Do not count warmup epochs in the decay schedule"},
      {"cooldown-epochs", "", &Config::cooldown_epochs, "Epochs at min_lr after a cyclic schedule ends", TRAIN, {},
       non_negative},
      {"decay-rate", "dr", &Config::decay_rate, "LR decay rate (step)", TRAIN, {}, positive},
      {"lr-steps", "", &Config::lr_steps,
       "torchvision's milestones: from each of these epochs (updates with --max-iter) the lr is multiplied by "
       "--lr-gamma (torch's MultiStepLR; implies --sched multistep)",
       TRAIN, {}, non_negative, 0, false, true},
      {"lr-gamma", "", &Config::lr_gamma, "Factor of each --lr-steps decay (default: --decay-rate)", TRAIN, {},
       positive},
      {"warmup-iters", "", &Config::warmup_iters,
       "Warm the lr up over this many optimizer updates (instead of --warmup-epochs; the lr is then stepped per update)",
       TRAIN, {}, non_negative},
      {"warmup-factor", "", &Config::warmup_factor, "The warmup starts at --lr times this (instead of --warmup-lr)",
       TRAIN, {}, probability},
      {"max-iter", "", &Config::max_iter,
       "Train this many optimizer updates (Detectron2's SOLVER.MAX_ITER; instead of --epochs); every schedule length "
       "then counts updates",
       TRAIN, {}, positive},
      {"ims-per-batch", "", &Config::ims_per_batch,
       "Batch size summed over all processes (Detectron2's SOLVER.IMS_PER_BATCH; instead of --batch-size)", TRAIN, {},
       positive},
      // augmentation
      {"no-aug", "", &Config::no_aug, "Disable all training augmentation"},
      {"scale", "", &Config::scale, "Random resize scale range (two numbers)", TRAIN | BENCH, {}, positive, 2, true},
      {"ratio", "", &Config::ratio, "Random resize aspect ratio range (two numbers)", TRAIN | BENCH, {}, positive, 2, true},
      {"hflip", "", &Config::hflip, "Horizontal flip probability", TRAIN | BENCH, {}, probability},
      {"vflip", "", &Config::vflip, "Vertical flip probability", TRAIN, {}, probability},
      {"aa", "", &Config::aa,
       "Augmentation policy: RandAugment 'rand-m9-mstd0.5-inc1', AutoAugment 'v0' / 'original', AugMix "
       "'augmix-m5-w3' (timm's strings)", TRAIN},
      {"color-jitter", "", &Config::color_jitter, "Colour jitter factor (when --aa is unset)", TRAIN, {},
       non_negative},
      {"reprob", "", &Config::reprob, "Random erasing probability", TRAIN, {}, probability},
      {"remode", "", &Config::remode, "Random erasing mode", TRAIN, {"const", "rand", "pixel"}},
      {"recount", "", &Config::recount, "Random erasing count", TRAIN, {}, positive},
      {"train-interpolation", "", &Config::train_interpolation, "Training interpolation", TRAIN | BENCH,
       {"random", "nearest", "bilinear", "bicubic", "box", "hamming", "lanczos"}},
      {"smoothing", "", &Config::smoothing, "Label smoothing", TRAIN, {}, smoothing_range},
      {"mixup", "", &Config::mixup, "Mixup alpha (mixup on when > 0)", TRAIN, {}, non_negative},
      {"cutmix", "", &Config::cutmix, "CutMix alpha (cutmix on when > 0)", TRAIN, {}, non_negative},
      {"cutmix-minmax", "", &Config::cutmix_minmax, "CutMix box size range as image fractions (overrides alpha)",
       TRAIN, {}, probability, 2, true, true},
      {"mixup-prob", "", &Config::mixup_prob, "Probability of mixing a batch (or element)", TRAIN, {}, probability},
      {"mixup-switch-prob", "", &Config::mixup_switch_prob, "Probability of CutMix when both are on", TRAIN, {},
       probability},
      {"mixup-mode", "", &Config::mixup_mode, "Mix per batch, pair or element", TRAIN, {"batch", "pair", "elem"}},
      {"mixup-off-epoch", "", &Config::mixup_off_epoch, "Turn mixup off from this epoch (0: never)", TRAIN, {},
       non_negative},
      {"bce-loss", "", &Config::bce_loss, "Binary cross entropy instead of softmax cross entropy"},
      {"bce-target-thresh", "", &Config::bce_target_thresh, "Binarise BCE targets at this threshold", TRAIN, {},
       probability},
      {"bce-sum", "", &Config::bce_sum, "Sum the BCE loss over classes"},
      {"drop", "", &Config::drop, "Dropout rate before the classifier", TRAIN, {}, probability},
      {"bn-momentum", "", &Config::bn_momentum, "BatchNorm momentum override (every BatchNorm of the model)", TRAIN,
       {}, probability},
      {"bn-eps", "", &Config::bn_eps, "BatchNorm epsilon override (every BatchNorm of the model)", TRAIN, {}, positive},
      {"drop-path", "", &Config::drop_path, "Drop path (stochastic depth) rate", TRAIN, {}, probability},
      // EMA
      {"model-ema", "", &Config::model_ema, "Keep an exponential moving average of the weights (ModelEmaV3)"},
      {"model-ema-force-cpu", "", &Config::model_ema_force_cpu, "Keep the EMA on the CPU (not validated)"},
      {"model-ema-decay", "", &Config::model_ema_decay, "EMA decay", TRAIN, {}, probability},
      {"model-ema-warmup", "", &Config::model_ema_warmup, "Warm the EMA decay up"},
      // data
      {"data-dir", "", &Config::data_dir, "Path to the dataset root", BOTH | BENCH},
      {"dataset", "", &Config::dataset,
       "Dataset type: '' (ImageFolder), fashion-mnist, or coco (DIR/{split}2017 + DIR/annotations/instances_{split}2017.json)",
       BOTH | BENCH, {"", "fashion-mnist", "coco"}},
      {"input-key", "", &Config::input_key,
       "ImageFolder: the file extensions read, ';'-separated (default: timm's .png;.jpg;.jpeg)", BOTH | BENCH},
      {"class-map", "", &Config::class_map,
       "ImageFolder: a .txt file of class names, one a line (its line number the index); other folders are skipped",
       BOTH},
      {"mean", "", &Config::mean, "Normalisation mean, one value or one per channel (default: the model's)", BOTH, {},
       nullptr, 0, false, true},
      {"std", "", &Config::std_dev, "Normalisation std, one value or one per channel (default: the model's)", BOTH, {},
       positive, 0, false, true},
      {"train-split", "", &Config::train_split, "Training split folder", TRAIN | BENCH},
      {"val-split", "", &Config::val_split, "Validation split folder", TRAIN},
      {"split", "", &Config::split, "Split to validate", VALIDATE},
      {"workers", "j", &Config::workers, "Loader threads", BOTH | BENCH, {}, thread_count},
      {"max-image-pixels", "", &Config::max_image_pixels,
       "Images with more pixels are skipped as decompression bombs (PIL's limit; 0: no limit)", BOTH | BENCH, {},
       non_negative},
      {"pin-mem", "", &Config::pin_mem,
       "Pin host memory of batches so copies to the GPU overlap compute (default on CUDA; --pin-mem=false turns it off)",
       BOTH},
      // misc
      {"seed", "", &Config::seed, "Random seed", TRAIN, {}, non_negative},
      {"log-interval", "", &Config::log_interval, "Batches between log lines", BOTH, {}, positive},
      {"checkpoint-hist", "", &Config::checkpoint_hist, "Number of checkpoints to keep", TRAIN, {}, positive},
      {"output", "", &Config::output, "Output folder root (default: ./output/train)", TRAIN},
      {"experiment", "", &Config::experiment, "Name of the run's folder under --output", TRAIN},
      {"log-tensorboard", "", &Config::log_tensorboard,
       "Write TensorBoard event files to DIR (the flag alone: the run's folder)", TRAIN, {}, nullptr, 1, false, false,
       "true"},
      {"recovery-interval", "", &Config::recovery_interval,
       "Write a recovery checkpoint every N updates (resumable mid-epoch; 0: off)", TRAIN, {}, update_count},
      {"eval-metric", "", &Config::eval_metric,
       "Metric that picks the best checkpoint: one the task's evaluator reports (classification: top1, top5, loss)",
       TRAIN},
      // validate / benchmark
      {"results-file", "", &Config::results_file, "Also write the result row to this file", VALIDATE | BENCH},
      {"results-format", "", &Config::results_format, "Format of --results-file", VALIDATE | BENCH,
       {"csv", "json"}},
      {"use-train-size", "", &Config::use_train_size, "Use the model's train input size, not its test size",
       VALIDATE | BENCH},
      {"bench", "", &Config::bench,
       "What to benchmark (data / data-eval: the training / eval input pipeline alone)", BENCH,
       {"inference", "train", "both", "data", "data-eval"}},
      {"num-warm-iter", "", &Config::num_warm_iter, "Warm-up iterations", BENCH, {}, non_negative},
      {"cuda-graph", "", &Config::cuda_graph,
       "Capture the benchmarked step in a CUDA graph after warm-up and replay it (torch.compile's reduce-overhead)",
       BENCH},
      {"fuse-bn", "", &Config::fuse_bn,
       "Fuse each conv block's BatchNorm with what surrounds it (float32, no autocast). Inference: folded into the "
       "convolution before it; on the CPU the bias, residual add and activation run as oneDNN post-ops. Training "
       "(CPU): batch statistics, normalisation, residual add and activation in one kernel each way; ConvNeXt's "
       "LayerNorm, MLP, layer scale and residual on tiles of pixels in its first stages; ViT's attention as imgtrain's "
       "kernels (also in inference). Default: on for benchmark inference, and for CPU float32 training of the ResNet, "
       "EfficientNet and MobileNetV3 families (with channels-last), ConvNeXt and ViT (results then differ from timm's "
       "by float rounding); off for validate and otherwise. "
       "--no-fuse-bn (or --fuse-bn=false) turns it off",
       TRAIN | VALIDATE | BENCH},
      {"profile", "", &Config::profile,
       "Print where the timed steps go: forward / backward / optimizer and the ops with the most self time "
       "(host time of each op call; on CUDA that is launch time, use Nsight for kernels)",
       BENCH},
      {"num-bench-iter", "", &Config::num_bench_iter, "Benchmark iterations", BENCH, {}, positive},
      {"channels-last", "", &Config::channels_last,
       "Channels-last (NHWC) memory layout for weights and inputs. Default: on for CPU float32 training of the "
       "ResNet, EfficientNet and MobileNetV3 families (measured faster, docs/performance.md), off otherwise; "
       "--no-channels-last (or --channels-last=false) turns it off",
       ALL},
      {"tf32", "", &Config::tf32, "CUDA: float32 matmuls and convolutions in TF32 (Ampere and newer)", ALL},
      // distributed
      // detection (torchvision's references/detection/train.py names)
      {"task", "", &Config::task, "The task (default: the model's): classification or detection", BOTH,
       {"", "classification", "detection"}},
      {"aspect-ratio-group-factor", "", &Config::aspect_ratio_group_factor,
       "Batch images of similar aspect ratio: 2k+2 groups (torchvision's GroupedBatchSampler); -1: off", TRAIN},
      {"trainable-backbone-layers", "", &Config::trainable_backbone_layers,
       "Backbone layers trained, 0-5 from layer4 down (default: 3 from backbone weights, else all); benchmark: "
       "time the fine-tuning configuration (FrozenBatchNorm2d, the other layers frozen)",
       TRAIN | BENCH, {}, non_negative},
      {"rpn-score-thresh", "", &Config::rpn_score_thresh, "Minimum objectness of an RPN proposal", BOTH, {},
       probability},
      {"data-augmentation", "", &Config::data_augmentation,
       "Detection training augmentation: hflip; multiscale (shorter side drawn from 480..800 by 32, and hflip); "
       "lsj (large-scale jitter: resize by --lsj-scale, crop or pad to --lsj-size, and hflip)",
       TRAIN, {"hflip", "multiscale", "lsj"}},
      {"lsj-size", "", &Config::lsj_size,
       "Detection, --data-augmentation lsj: the square crop's side (torchvision's 1024)", TRAIN, {}, image_side},
      {"lsj-scale", "", &Config::lsj_scale,
       "Detection, --data-augmentation lsj: the range of the jitter's scale (two numbers)", TRAIN, {}, jitter_scale, 2,
       true},
      {"two-bucket-grouping", "", &Config::two_bucket_grouping,
       "Detection: batch landscape images apart from the rest (Detectron2's aspect-ratio grouping) instead of "
       "--aspect-ratio-group-factor",
       TRAIN},
      {"min-size-test", "", &Config::min_size_test, "Detection: shorter side in evaluation (default: the last --min-size)",
       BOTH, {}, positive},
      {"min-size", "", &Config::min_size,
       "Detection: shorter side(s) of the model's resize; training draws one per image, evaluation takes the last",
       BOTH, {}, positive, 0},
      {"max-size", "", &Config::max_size, "Detection: longest side limit of the model's resize", BOTH, {}, positive},
      {"rpn-pre-nms-top-n-train", "", &Config::rpn_pre_nms_top_n_train,
       "RPN proposals kept per level before NMS, training", TRAIN, {}, positive},
      {"rpn-pre-nms-top-n-test", "", &Config::rpn_pre_nms_top_n_test,
       "RPN proposals kept per level before NMS, evaluation", BOTH, {}, positive},
      {"rpn-post-nms-top-n-train", "", &Config::rpn_post_nms_top_n_train,
       "RPN proposals kept per image after NMS, training (Detectron2: 1000)", TRAIN, {}, positive},
      {"rpn-post-nms-top-n-test", "", &Config::rpn_post_nms_top_n_test,
       "RPN proposals kept per image after NMS, evaluation", BOTH, {}, positive},
      {"rpn-nms-thresh", "", &Config::rpn_nms_thresh, "RPN NMS IoU threshold", BOTH, {}, probability},
      {"rpn-batch-size-per-image", "", &Config::rpn_batch_size_per_image, "Anchors sampled per image for the RPN loss",
       TRAIN, {}, positive},
      {"box-batch-size-per-image", "", &Config::box_batch_size_per_image,
       "RoIs sampled per image for the box (and mask) losses", TRAIN, {}, positive},
      {"box-score-thresh", "", &Config::box_score_thresh, "Minimum score of a detection", BOTH, {}, probability},
      {"box-nms-thresh", "", &Config::box_nms_thresh, "Per-class NMS IoU threshold of detections", BOTH, {},
       probability},
      {"box-detections-per-img", "", &Config::box_detections_per_img, "Detections kept per image", BOTH, {},
       positive},
      {"box-sampling-ratio", "", &Config::box_sampling_ratio,
       "RoIAlign samples per bin side (0: adaptive, Detectron2's ROIAlignV2)", BOTH, {}, non_negative},
      {"roi-canonical-size", "", &Config::roi_canonical_size,
       "MultiScaleRoIAlign's level mapper: a box of this side is pooled from level 4 (stride 16), one half its side "
       "from level 3 (torchvision's and Detectron2's 224)",
       BOTH | BENCH, {}, positive},
      {"mask-rois-per-image", "", &Config::mask_rois_per_image,
       "Mask R-CNN training: the mask head runs on at most this many of an image's positive RoIs, drawn at random "
       "(0: all of them, as torchvision and Detectron2)",
       TRAIN | BENCH, {}, non_negative},
      {"roi-align-v2", "", &Config::roi_align_v2, "RoIAlign with aligned=True (Detectron2's ROIAlignV2)", BOTH},
      {"mask-convention", "", &Config::mask_convention,
       "Mask R-CNN: how the 28x28 mask maps onto its box in training targets and pasting: torchvision's (targets "
       "by roi_align aligned=False, paste_masks_in_image), detectron2's (aligned targets binarised at 0.5, "
       "grid_sample paste) or aligned (Detectron2's, targets kept as fractions)",
       BOTH, {"torchvision", "detectron2", "aligned"}},
      {"box-loss", "", &Config::box_loss, "Box regression loss of the RoI head", TRAIN, {"smooth_l1", "l1"}},
      {"rpn-box-loss", "", &Config::rpn_box_loss, "Box regression loss of the RPN", TRAIN, {"smooth_l1", "l1"}},
      {"fpn-channels", "", &Config::fpn_channels,
       "Detection: channels of the FPN levels, the RPN head and the RoI features (Detectron2's MODEL.FPN.OUT_CHANNELS)",
       BOTH | BENCH, {}, positive},
      {"box-head-dim", "", &Config::box_head_dim,
       "Detection: the box head's representation size (Detectron2's MODEL.ROI_BOX_HEAD.FC_DIM)", BOTH | BENCH, {},
       positive},
      {"mask-head-dim", "", &Config::mask_head_dim,
       "Mask R-CNN: channels of the mask head's convolutions (Detectron2's MODEL.ROI_MASK_HEAD.CONV_DIM)",
       BOTH | BENCH, {}, positive},
      {"mask-head-convs", "", &Config::mask_head_convs,
       "Mask R-CNN: number of the mask head's 3x3 convolutions (Detectron2's MODEL.ROI_MASK_HEAD.NUM_CONV)",
       BOTH | BENCH, {}, non_negative},
      {"nproc-per-node", "num-gpus", &Config::nproc_per_node,
       "Launch this many worker processes on this node (torchrun's contract; 0: run in this process)", TRAIN | BENCH, {},
       non_negative},
      {"nnodes", "num-machines", &Config::nnodes, "Number of nodes (with --nproc-per-node)", TRAIN | BENCH, {}, positive},
      {"node-rank", "machine-rank", &Config::node_rank, "This node's index (with --nproc-per-node)", TRAIN | BENCH, {},
       non_negative},
      {"master-addr", "", &Config::master_addr, "Address of node 0 (with --nproc-per-node)", TRAIN | BENCH},
      {"master-port", "", &Config::master_port, "Rendezvous port on node 0 (0: a free port, single node)", TRAIN | BENCH, {},
       non_negative},
      {"dist-url", "", &Config::dist_url,
       "Node 0's rendezvous as tcp://HOST:PORT (Detectron2's; sets --master-addr and --master-port; auto: a free port)",
       TRAIN | BENCH},
      {"rdzv-id", "", &Config::rdzv_id, "Job id every node gives (default: node 0's launcher picks one, the others read it)",
       TRAIN | BENCH},
      {"rdzv-timeout", "", &Config::rdzv_timeout,
       "Seconds the nodes' launchers, and then the processes, wait for each other to join",
       TRAIN | BENCH, {}, positive},
      {"dist-backend", "", &Config::dist_backend, "Collective backend (auto: nccl on CUDA, gloo on CPU)", TRAIN | BENCH,
       {"auto", "gloo", "nccl"}},
      {"dist-timeout", "", &Config::dist_timeout, "Seconds a collective may wait for its peers", TRAIN | BENCH, {}, positive},
      {"bucket-cap-mb", "", &Config::bucket_cap_mb, "Gradient all-reduce bucket size in MiB (DDP's)", TRAIN | BENCH, {},
       positive},
      {"sync-bn", "", &Config::sync_bn, "Synchronised BatchNorm across processes (torch SyncBatchNorm)", TRAIN},
      {"dist-bn", "", &Config::dist_bn, "BatchNorm statistics across processes after each epoch", TRAIN,
       {"reduce", "broadcast", ""}},
      {"aug-repeats", "", &Config::aug_repeats, "Repeated augmentation: copies of each sample per epoch (0: off)",
       TRAIN, {}, non_negative},
      {"no-ddp-bb", "", &Config::no_ddp_bb, "Do not broadcast buffers from rank 0 before each forward"},
      {"local-rank", "local_rank", &Config::local_rank, "Ignored (torch.distributed.launch's); LOCAL_RANK rules",
       TRAIN, {}, non_negative},
  };
  return f;
}

std::string key_of(const std::string& name) {
  std::string k = name;
  std::replace(k.begin(), k.end(), '-', '_');
  return k;
}

bool parse_bool(const std::string& s, bool& out) {
  if (s == "true" || s == "True" || s == "1" || s == "yes") return out = true, true;
  if (s == "false" || s == "False" || s == "0" || s == "no") return out = false, true;
  return false;
}

bool parse_int(const std::string& s, int64_t& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno || *end) return false;
  out = v;
  return true;
}

bool parse_float(const std::string& s, double& out) {
  if (s.empty()) return false;
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (*end || !std::isfinite(v)) return false;
  out = v;
  return true;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t p = s.find(',', start);
    if (p == std::string::npos) p = s.size();
    out.push_back(s.substr(start, p - start));
    start = p + 1;
  }
  return out;
}

std::string integer_expectation(const Flag& f) {
  std::string what = f.check ? f.check(-1) : "an integer";
  auto p = what.find("number");
  if (p != std::string::npos) what.replace(p, 6, "integer");
  p = what.find("a integer");
  return p == std::string::npos ? what : what.replace(p, 9, "an integer");
}

// Sets one flag from its text form. `where` is "--flag" or "key 'k' in FILE" for the message.
void assign(Config& c, const Flag& f, const std::string& value, const std::string& where) {
  auto bad = [&](const std::string& accepted) {
    throw UserError(fmt::format("{} '{}': expected {}", where, value, accepted));
  };
  auto checked = [&](double v) {
    if (f.check) {
      auto msg = f.check(v);
      if (!msg.empty()) bad(msg);
    }
  };
  std::visit(
      [&](auto member) {
        using T = std::decay_t<decltype(c.*member)>;
        if constexpr (std::is_same_v<T, std::string>) {
          if (!f.choices.empty() && std::find(f.choices.begin(), f.choices.end(), value) == f.choices.end()) {
            std::string list;
            for (auto& ch : f.choices) list += (list.empty() ? "" : ", ") + (ch.empty() ? "''" : ch);
            bad("one of " + list);
          }
          c.*member = value;
        } else if constexpr (std::is_same_v<T, bool>) {
          bool b;
          if (!parse_bool(value, b)) bad("true or false");
          c.*member = b;
        } else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, std::optional<int64_t>>) {
          int64_t v;
          if (!parse_int(value, v)) bad(integer_expectation(f));
          if (f.check && !f.check(double(v)).empty()) bad(integer_expectation(f));
          c.*member = v;
        } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::optional<double>>) {
          double v;
          if (!parse_float(value, v)) bad(f.check ? f.check(-1) : "a number");
          checked(v);
          c.*member = v;
        } else {
          std::vector<double> vs;
          const std::string count = f.nargs ? fmt::format("{} numbers", f.nargs) : "one or more numbers";
          if (value.empty() && f.may_be_empty) {
            c.*member = vs;
            return;
          }
          for (auto& part : split_list(value)) {
            double v;
            if (!parse_float(part, v)) bad(count);
            checked(v);
            vs.push_back(v);
          }
          if (f.nargs ? vs.size() != f.nargs : vs.empty()) bad(count);
          if (f.range && vs[0] > vs[1]) bad("a range 'low high' with low <= high");
          c.*member = vs;
        }
      },
      f.field);
}

void clear_optional(Config& c, const Flag& f) {
  std::visit(
      [&](auto member) {
        using T = std::decay_t<decltype(c.*member)>;
        if constexpr (std::is_same_v<T, std::optional<int64_t>> || std::is_same_v<T, std::optional<double>>)
          c.*member = std::nullopt;
      },
      f.field);
}

// timm train.py's options and defaults (generated): a timm args.yaml may name options imgtrain
// does not implement; they are accepted while they hold timm's default.
const std::vector<std::pair<const char*, const char*>>& timm_train_defaults() {
  static const std::vector<std::pair<const char*, const char*>> t = {
#include "cli/timm_train_defaults.inc"
  };
  return t;
}

// A YAML value on one line (lists and mappings in flow style), for one-line messages.
std::string one_line(const YAML::Node& v) {
  YAML::Emitter e;
  e.SetSeqFormat(YAML::Flow);
  e.SetMapFormat(YAML::Flow);
  e << v;
  std::string s = e.c_str();
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

bool same_value(const YAML::Node& a, const YAML::Node& b) {
  if (a.IsNull() || b.IsNull()) return a.IsNull() && b.IsNull();
  if (a.IsSequence() || b.IsSequence()) {
    if (!a.IsSequence() || !b.IsSequence() || a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!same_value(a[i], b[i])) return false;
    return true;
  }
  if (a.IsMap() || b.IsMap()) {
    if (!a.IsMap() || !b.IsMap() || a.size() != b.size()) return false;
    for (auto kv : a)
      if (!b[kv.first.as<std::string>()] || !same_value(kv.second, b[kv.first.as<std::string>()])) return false;
    return true;
  }
  if (!a.IsScalar() || !b.IsScalar()) return false;
  const std::string x = a.as<std::string>(), y = b.as<std::string>();
  if (x == y) return true;
  double dx, dy;
  if (parse_float(x, dx) && parse_float(y, dy)) return dx == dy || std::abs(dx - dy) <= 1e-12 * std::abs(dy);
  bool bx, by;
  if (parse_bool(x, bx) && parse_bool(y, by)) return bx == by;
  return false;
}

unsigned command_bit(Command cmd) {
  return cmd == Command::Train ? TRAIN : cmd == Command::Validate ? VALIDATE : BENCH;
}

bool same_field(const Config& a, const Config& b, const Flag& f) {
  return std::visit([&](auto member) { return a.*member == b.*member; }, f.field);
}

void apply_yaml(Config& c, Command cmd, const std::string& path) {
  const YAML::Node root = load_yaml_file(path, "--config");
  if (root.IsNull()) {
    log::warn("--config '{}' holds no settings (an empty file)", path);
    return;
  }
  if (!root.IsMap()) throw UserError(fmt::format("--config '{}': expected a mapping of flag names to values", path));
  const unsigned bit = command_bit(cmd);
  if (is_detectron2_config(root)) {
    std::vector<std::string> warnings;
    for (auto& s : detectron2_settings(path, root, warnings)) {
      const Flag* flag = nullptr;
      for (auto& f : flags())
        if (s.flag == f.name && (f.cmds & bit)) flag = &f;
      if (!flag) continue;  // a training setting, read by `validate` or `benchmark`
      const std::string where = s.key.rfind("default ", 0) == 0
                                    ? fmt::format("Detectron2's {} (the default under {})", s.key.substr(8), path)
                                    : fmt::format("key '{}' in {}", s.key, path);
      assign(c, *flag, s.value, where);
      if (!same_field(c, Config{}, *flag)) c.given.insert(flag->name);
      else c.given.erase(flag->name);
    }
    for (auto& w : warnings) log::warn("{}", w);
    return;
  }
  {  // a key given twice (also as batch-size and batch_size): PyYAML keeps the last silently
    std::set<std::string> seen;
    for (auto it : root)
      if (const std::string key = key_of(it.first.as<std::string>()); !seen.insert(key).second)
        throw UserError(fmt::format("--config '{}': key '{}' appears more than once; give it once", path, key));
  }
  for (auto it : root) {
    std::string key = key_of(it.first.as<std::string>());
    const Flag* flag = nullptr;
    for (auto& f : flags())
      if (key_of(f.name) == key && (f.cmds & bit)) flag = &f;
    if (!flag) {
      if (cmd == Command::Train) {
        const auto& timm = timm_train_defaults();
        auto t = std::find_if(timm.begin(), timm.end(), [&](auto& e) { return key == e.first; });
        if (t != timm.end()) {
          if (same_value(it.second, YAML::Load(t->second))) continue;  // timm's default: nothing to do
          throw UserError(fmt::format("--config '{}': key '{}' is a timm option imgtrain does not implement yet; "
                                      "only its default ({}) is accepted, not {}",
                                      path, key, t->second, one_line(it.second)));
        }
      }
      std::vector<std::string> keys;
      for (auto& f : flags())
        if (f.cmds & bit) keys.push_back(key_of(f.name));
      if (cmd == Command::Train)
        for (auto& [k, d] : timm_train_defaults()) keys.push_back(k);
      throw UserError(fmt::format("--config '{}': unknown key '{}' (did you mean '{}'?)", path, key,
                                  closest_names(key, keys, 1).at(0)));
    }
    const YAML::Node& v = it.second;
    std::string where = fmt::format("key '{}' in {}", key, path);
    if (v.IsNull()) {
      clear_optional(c, *flag);
    } else if (v.IsSequence()) {
      std::string joined;
      for (auto e : v) {
        if (!e.IsScalar()) throw UserError(fmt::format("{}: expected a list of values, not of lists or mappings", where));
        joined += (joined.empty() ? "" : ",") + e.as<std::string>();
      }
      assign(c, *flag, joined, where);
    } else if (v.IsScalar()) {
      assign(c, *flag, v.as<std::string>(), where);
    } else {
      throw UserError(fmt::format("{}: expected a value or a list", where));
    }
    // A file (an args.yaml written by imgtrain names every flag) sets a flag only where it
    // departs from the default; `in_file` keeps that the file named it (a detection model's own
    // defaults, the 320 MobileNetV3 detector's sizes, give way to a file's value too).
    if (!same_field(c, Config{}, *flag)) c.given.insert(flag->name);
    c.in_file.insert(flag->name);
  }
}

// Flags that have no effect in the combination given are errors, not silently ignored.
void check_effective(Command cmd, const Config& c) {
  auto refuse = [&](const std::vector<const char*>& flags, const std::string& why) {
    for (auto* f : flags)
      if (c.was_given(f)) throw UserError(fmt::format("--{} has no effect {}", f, why));
  };
  const bool data_bench = c.bench == "data" || c.bench == "data-eval";
  if (cmd == Command::Benchmark && data_bench)
    refuse({"model", "device", "amp", "amp-dtype", "channels-last", "num-classes", "gp", "opt", "opt-impl", "profile", "cuda-graph",
            "fuse-bn", "nproc-per-node"},
           fmt::format("with --bench {} (it measures the input pipeline alone, on the CPU)", c.bench));
  if (c.fuse_bn && c.amp_opt_level == "O2")
    refuse({"fuse-bn"}, "with --amp-opt-level O2 (its weights are half precision; the fused kernels run in float32)");
  if (c.fuse_bn && (c.amp_opt_level == "O1" || (c.amp && c.amp_opt_level != "O0")))
    refuse({"fuse-bn"}, "with --amp (the folded convolutions run in float32; autocast picks the kernels)");
  if (cmd == Command::Benchmark && c.bench == "data")
    refuse({"crop-pct", "interpolation", "crop-mode", "fast-decode"},
           "with --bench data (the training pipeline; --bench data-eval measures the eval one)");
  if (cmd == Command::Benchmark && c.bench == "data-eval")
    refuse({"scale", "ratio", "hflip", "train-interpolation"},
           "with --bench data-eval (the eval pipeline; --bench data measures the training one)");
  if (cmd == Command::Benchmark && !data_bench)
    refuse({"data-dir", "dataset", "train-split", "workers", "scale", "ratio", "hflip", "train-interpolation",
            "crop-pct", "interpolation", "crop-mode", "fast-decode"},
           fmt::format("with --bench {} (synthetic inputs; the data flags belong to --bench data)", c.bench));
  if (c.nproc_per_node == 0)
    refuse({"nnodes", "node-rank", "master-addr", "master-port", "dist-url", "rdzv-id"},
           "without --nproc-per-node N (under torchrun or SLURM the launcher sets them)");
  if (cmd == Command::Validate && !c.checkpoint.empty())
    refuse({"pretrained", "pretrained-path"}, "with --checkpoint (the checkpoint's weights are validated)");
}

// torchvision's and Detectron2's schedule flags next to timm's: a pair that names the same thing
// is refused unless both agree; what follows from them (--sched multistep) is set here, the rest
// (units, the warmup start, the per-process batch) by the adapters that know the world size.
void reset_flag(Config& c, const std::string& name) {
  for (auto& f : flags())
    if (name == f.name) std::visit([&](auto member) { c.*member = Config{}.*member; }, f.field);
  c.given.erase(name);
}

void check_schedule(Config& c, const std::set<std::string>& on_cli) {
  // Two flags that set the same thing: the command line's wins over the -c file's counterpart
  // (a Detectron2 file sets --ims-per-batch; `-b 2` on the command line replaces it).
  auto one_of = [&](const char* a, const char* b, const std::string& what, bool cli_wins = true) {
    if (!c.was_given(a) || !c.was_given(b)) return;
    if (cli_wins && on_cli.count(a) && !on_cli.count(b)) return reset_flag(c, b);
    if (cli_wins && on_cli.count(b) && !on_cli.count(a)) return reset_flag(c, a);
    auto name = [&](const char* f) {
      return fmt::format("--{}{}", f, on_cli.count(a) == on_cli.count(b) || on_cli.count(f) ? "" : " (from -c's file)");
    };
    throw UserError(fmt::format("{} and {} both set {}; give one of them", name(a), name(b), what));
  };
  if (on_cli.count("sched") && c.sched != "multistep" && c.was_given("lr-steps") && !on_cli.count("lr-steps"))
    reset_flag(c, "lr-steps");  // the command line's schedule replaces the file's milestones
  one_of("lr-steps", "decay-milestones", "the decay points");
  one_of("warmup-iters", "warmup-epochs", "the warmup length");
  one_of("warmup-factor", "warmup-lr", "where the warmup starts");
  // not overridden one for the other: with --max-iter the file's milestones count updates
  one_of("max-iter", "epochs", "the training length", false);
  one_of("ims-per-batch", "batch-size", "the batch size");
  if (c.was_given("lr-gamma") && c.was_given("decay-rate") && *c.lr_gamma != c.decay_rate) one_of("lr-gamma", "decay-rate", "the decay factor");
  if (c.max_iter) {
    const std::map<std::string, bool> zero = {{"warmup-epochs", c.warmup_epochs == 0},  // 0 epochs is 0 updates
                                              {"cooldown-epochs", c.cooldown_epochs == 0}};
    for (const char* f : {"warmup-epochs", "decay-epochs", "cooldown-epochs", "warmup-prefix", "start-epoch"})
      if (c.was_given(f) && !(zero.count(f) && zero.at(f)))
        throw UserError(fmt::format("--{} counts epochs; with --max-iter every schedule length counts updates "
                                    "(--warmup-iters, --lr-steps)",
                                    f));
    if (c.sched == "plateau" || c.sched == "step")
      throw UserError(fmt::format("--sched {} counts epochs; with --max-iter use multistep (--lr-steps), cosine, tanh "
                                  "or poly",
                                  c.sched));
    if (c.ims_per_batch && c.nproc_per_node > 0 && *c.ims_per_batch % (c.nproc_per_node * c.nnodes))
      throw UserError(fmt::format("--ims-per-batch {}: not a multiple of the {} processes", *c.ims_per_batch,
                                  c.nproc_per_node * c.nnodes));
    for (double m : c.lr_steps)
      if (m >= double(*c.max_iter))
        log::warn("--lr-steps {} is not below --max-iter {}: that decay never happens", m, *c.max_iter);
    if (c.lr_cycle_limit != 1 || c.lr_cycle_mul != 1.0)
      throw UserError("--lr-cycle-limit / --lr-cycle-mul: with --max-iter the schedule is one cycle of --max-iter updates");
  }
  if ((c.max_iter || c.warmup_iters) && c.sched == "plateau")
    throw UserError("--sched plateau steps per epoch; --warmup-iters and --max-iter need a schedule stepped per update");
  if (!c.lr_steps.empty()) {
    if (c.was_given("sched") && c.sched != "multistep")
      throw UserError(fmt::format("--lr-steps are multistep milestones, but --sched is {}", c.sched));
    c.sched = "multistep";
  }
}

// --dist-url tcp://HOST:PORT (Detectron2's launch) is --master-addr HOST --master-port PORT.
void apply_dist_url(Config& c) {
  if (c.was_given("master-addr") || c.was_given("master-port"))
    throw UserError("--dist-url and --master-addr / --master-port name the same thing; give one of them");
  const std::string& u = c.dist_url;
  if (u == "auto") return;  // Detectron2: a free port on this machine (single node)
  const std::string bad = fmt::format("--dist-url '{}': expected tcp://HOST:PORT or auto", u);
  if (u.rfind("tcp://", 0) != 0) throw UserError(bad);
  const std::string hp = u.substr(6);
  const size_t colon = hp.rfind(':');
  int64_t port = 0;
  if (colon == std::string::npos || colon == 0 || !parse_int(hp.substr(colon + 1), port) || port < 1 || port > 65535)
    throw UserError(bad);
  std::string host = hp.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);  // [v6]
  c.master_addr = host;
  c.master_port = port;
}

}  // namespace

void refuse_unknown_flags(const std::vector<std::string>& args, const std::vector<std::string>& known,
                          const std::string& short_flags, const std::string& command) {
  for (auto& a : args) {
    if (a.size() < 2 || a[0] != '-' || std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.') continue;
    std::string flag = a.rfind("--", 0) == 0 ? a.substr(2, a.find('=') == std::string::npos ? std::string::npos
                                                                                             : a.find('=') - 2)
                                               : std::string();
    if (a.rfind("--", 0) != 0) {  // short (possibly with the value attached)
      if (short_flags.find(a[1]) != std::string::npos) continue;
      flag = a.substr(1);
    }
    if (std::find(known.begin(), known.end(), flag) != known.end()) continue;
    // a suggestion only where it is near (a typo: at most a third of its letters off); a timm
    // option imgtrain lacks is said to be one; else the command's help
    // (timm's --input-size is imgtrain's --img-size: half its letters off)
    const std::string head = flag.substr(0, 64);
    const auto best = closest_names(head, known, 1);
    const size_t distance = best.empty() ? SIZE_MAX : edit_distance(head, best[0], 64);
    std::string hint = fmt::format("see {} --help", command);
    const auto& timm = timm_train_defaults();
    if (!best.empty() && distance <= std::max<size_t>(2, best[0].size() / 3))
      hint = fmt::format("did you mean --{}?", best[0]);
    else if (std::any_of(timm.begin(), timm.end(), [&](auto& e) { return key_of(flag) == e.first; }))
      hint = !best.empty() && distance <= best[0].size() / 2
                 ? fmt::format("a timm option imgtrain does not implement; the nearest of its own: --{}", best[0])
                 : fmt::format("a timm option imgtrain does not implement; see {} --help", command);
    throw UserError(fmt::format("unknown flag '{}' for {} ({})", a.substr(0, a.find('=')), command, hint));
  }
}

namespace {
const char* command_name(Command cmd) {
  return cmd == Command::Train ? "imgtrain train" : cmd == Command::Validate ? "imgtrain validate" : "imgtrain benchmark";
}

// The command's cxxopts parser: 400 flags whose names cxxopts checks with regular expressions, so
// it is built once per command (a config fuzzer calls parse millions of times).
std::unique_ptr<cxxopts::Options> make_options(Command cmd) {
  const unsigned bit = command_bit(cmd);
  auto made = std::make_unique<cxxopts::Options>(
      command_name(cmd), cmd == Command::Train      ? "Train an image classification model (timm train.py flags)"
                         : cmd == Command::Validate ? "Validate a checkpoint (timm validate.py flags)"
                                                    : "Benchmark a model on synthetic data (timm benchmark.py flags)");
  cxxopts::Options& opts = *made;
  opts.add_options()("c,config", "YAML file of flag defaults (timm args.yaml keys)", cxxopts::value<std::string>())(
      "h,help", "Show this help");
  for (auto& f : flags()) {
    if (!(f.cmds & bit)) continue;
    std::string spec = f.name;
    if (std::strlen(f.alias) == 1) spec = std::string(f.alias) + "," + spec;
    auto v = cxxopts::value<std::string>();
    if (std::holds_alternative<bool Config::*>(f.field)) v->implicit_value("true");
    if (f.implicit) v->implicit_value(f.implicit);
    std::string help = f.help;
    if (std::strlen(f.alias) > 1)  // long and two-letter aliases are rewritten before cxxopts sees them
      help += fmt::format(" (alias: {}{})", f.alias[0] == '-' ? "" : "--", f.alias);
    if (!f.choices.empty()) {
      std::string list;
      for (auto& ch : f.choices) list += (list.empty() ? "" : "|") + (ch.empty() ? "''" : ch);
      help += " [" + list + "]";
    }
    opts.add_options()(spec, help, v);
  }
  return made;
}
}  // namespace

std::optional<Config> parse(Command cmd, const std::vector<std::string>& in_args) {
  const unsigned bit = command_bit(cmd);
  const char* name = command_name(cmd);
  static std::mutex options_mu;
  static std::unique_ptr<cxxopts::Options> options[3];
  std::unique_lock<std::mutex> options_lock(options_mu);
  auto& slot = options[cmd == Command::Train ? 0 : cmd == Command::Validate ? 1 : 2];
  if (!slot) slot = make_options(cmd);
  cxxopts::Options& opts = *slot;

  // timm's argparse takes `--scale 0.08 1.0` and two-letter short flags like -vb; cxxopts takes
  // neither, so rewrite them to `--scale=0.08,1.0` and `--validation-batch-size` first.
  std::vector<std::string> args;
  for (size_t i = 0; i < in_args.size(); ++i) {
    std::string a = in_args[i];
    // --no-X for a boolean flag --X (argparse's BooleanOptionalAction): --X=false
    if (a.rfind("--no-", 0) == 0) {
      const bool valued = a.find('=') != std::string::npos;
      const std::string base = a.substr(5, valued ? a.find('=') - 5 : std::string::npos);
      bool own = false;  // --no-aug and the like are flags of their own
      const Flag* neg = nullptr;
      for (auto& f : flags()) {
        if (!(f.cmds & bit)) continue;
        if ("no-" + base == f.name) own = true;
        if (base == f.name && std::holds_alternative<bool Config::*>(f.field)) neg = &f;
      }
      if (!own && neg && valued)
        throw UserError(fmt::format("'{}': --no-{} takes no value (--{}=true or --{}=false says either)", a, base,
                                    base, base));
      if (!own && neg) a = std::string("--") + neg->name + "=false";
    }
    for (auto& f : flags()) {
      if (!(f.cmds & bit)) continue;
      std::string alias = f.alias;
      if (alias.size() > 1 && (a == alias || a == "--" + alias)) a = std::string("--") + f.name;
      if (alias.size() > 1 && a.rfind(alias + "=", 0) == 0) a = std::string("--") + f.name + a.substr(alias.size());
    }
    for (auto& f : flags()) {
      // an optional value (argparse's nargs='?'): `--log-tensorboard DIR` as `--log-tensorboard=DIR`
      if (f.implicit && (f.cmds & bit) && a == std::string("--") + f.name && i + 1 < in_args.size() &&
          !in_args[i + 1].empty() && in_args[i + 1][0] != '-')
        a += "=" + in_args[++i];
      if (f.nargs != 1 && (f.cmds & bit) && a == std::string("--") + f.name) {
        auto is_value = [](const std::string& t) {
          return !t.empty() && (t[0] != '-' || (t.size() > 1 && (std::isdigit((unsigned char)t[1]) || t[1] == '.')));
        };
        std::string joined;
        size_t k = 0;
        for (; (f.nargs == 0 || k < f.nargs) && i + 1 < in_args.size() && is_value(in_args[i + 1]); ++k)
          joined += (k ? "," : "") + in_args[++i];
        a += "=" + joined;
      }
    }
    args.push_back(a);
  }
  // Unknown flags: say which, and the closest known one (cxxopts' own message is less useful).
  std::vector<std::string> known{"config", "help"};
  for (auto& f : flags())
    if (f.cmds & bit) known.push_back(f.name);
  refuse_unknown_flags(args, known, "bjch", name);
  std::vector<char*> argv{const_cast<char*>(name)};
  for (auto& a : args) argv.push_back(a.data());

  cxxopts::ParseResult r;
  try {
    r = opts.parse(int(argv.size()), argv.data());
  } catch (const cxxopts::exceptions::exception& e) {
    throw UserError(fmt::format("{}: {}", name, e.what()));
  }
  if (r.count("help")) {
    std::cout << opts.help() << std::endl;
    return std::nullopt;
  }
  options_lock.unlock();
  if (!r.unmatched().empty())
    throw UserError(fmt::format("{}: unexpected argument '{}' (flags start with --)", name, r.unmatched()[0]));

  Config c;
  if (cmd != Command::Train) c.batch_size = 256;  // validate.py's and benchmark.py's default
  if (r.count("config")) {
    c.config_file = r["config"].as<std::string>();
    apply_yaml(c, cmd, c.config_file);
  }
  std::set<std::string> on_cli;
  for (auto& f : flags()) {
    if (!(f.cmds & bit) || !r.count(f.name)) continue;
    std::string where = std::string("--") + f.name;
    assign(c, f, r[f.name].as<std::string>(), where);
    c.given.insert(f.name);
    on_cli.insert(f.name);
  }
  check_effective(cmd, c);
  if (cmd == Command::Train) check_schedule(c, on_cli);
  if (c.pretrained_path.find("://") != std::string::npos)
    throw UserError(fmt::format("--pretrained-path '{}': imgtrain reads local files (safetensors or torch.save); "
                                "Detectron2's model-zoo .pkl weights are not torchvision's ResNet: give torchvision's "
                                "weights for the backbone with --pretrained-path FILE",
                                c.pretrained_path));
  if (c.was_given("dist-url")) apply_dist_url(c);
  if (c.device != "auto" && c.device != "cpu" && c.device != "cuda" && c.device.rfind("cuda:", 0) != 0)
    throw UserError(fmt::format("--device '{}': expected auto, cpu, cuda or cuda:N", c.device));
  if (c.device.rfind("cuda:", 0) == 0) {
    int64_t idx;
    if (!parse_int(c.device.substr(5), idx) || idx < 0)
      throw UserError(fmt::format("--device '{}': expected auto, cpu, cuda or cuda:N", c.device));
  }
  return c;
}

void check_flags_for_task(const Config& c, const std::string& task, const std::string& model) {
  // What only the classification task reads: its losses, batch mixing and image-level augmentations.
  static const char* const classification_only[] = {
      "smoothing",  "bce-loss",    "bce-target-thresh", "bce-sum",        "mixup",      "cutmix",
      "cutmix-minmax", "mixup-prob", "mixup-switch-prob", "mixup-mode", "mixup-off-epoch", "aa",
      "color-jitter", "reprob",     "remode",            "recount",        "scale",      "ratio",
      "vflip",      "train-interpolation", "crop-pct",  "gp",             "drop",       "aug-repeats",
      "crop-mode",  "fast-decode",  "interpolation"};
  static const char* const detection_only[] = {
      "aspect-ratio-group-factor", "trainable-backbone-layers", "rpn-score-thresh", "data-augmentation", "min-size",
      "max-size", "rpn-pre-nms-top-n-train", "rpn-pre-nms-top-n-test", "rpn-post-nms-top-n-train",
      "rpn-post-nms-top-n-test", "rpn-nms-thresh", "rpn-batch-size-per-image", "box-batch-size-per-image",
      "box-score-thresh", "box-nms-thresh", "box-detections-per-img", "box-sampling-ratio", "roi-align-v2", "box-loss",
      "rpn-box-loss", "two-bucket-grouping", "min-size-test", "fpn-channels", "box-head-dim", "mask-head-dim",
      "mask-head-convs", "lsj-size", "lsj-scale", "mask-convention", "mask-rois-per-image", "roi-canonical-size"};
  if (!c.task.empty() && c.task != task)
    throw UserError(fmt::format("--task {}: --model {} is a {} model", c.task, model, task));
  if (task == "classification") {
    for (const char* f : detection_only)
      if (c.was_given(f))
        throw UserError(fmt::format("--{} applies to detection models only; --model {} is a classification model", f,
                                    model));
    return;
  }
  for (const char* f : classification_only)
    if (c.was_given(f))
      throw UserError(fmt::format("--{} applies to classification models only; --model {} is a {} model", f, model,
                                  task));
  // (a -c file's value counts only where it departs from the default: every args.yaml names both)
  if (c.data_augmentation != "lsj")
    for (const char* f : {"lsj-size", "lsj-scale"})
      if (c.was_given(f))
        throw UserError(fmt::format("--{} applies with --data-augmentation lsj only (it is {})", f,
                                    c.data_augmentation));
}

std::string to_yaml(Command cmd, const Config& c) {
  const unsigned bit = command_bit(cmd);
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (auto& f : flags()) {
    if (!(f.cmds & bit)) continue;
    out << YAML::Key << key_of(f.name) << YAML::Value;
    std::visit(
        [&](auto member) {
          using T = std::decay_t<decltype(c.*member)>;
          const T& v = c.*member;
          if constexpr (std::is_same_v<T, std::vector<double>>) {
            out << YAML::Flow << YAML::BeginSeq;
            for (double d : v) out << fmt::format("{}", d);
            out << YAML::EndSeq;
          } else if constexpr (std::is_same_v<T, std::optional<int64_t>>) {
            if (v) out << *v; else out << YAML::Null;
          } else if constexpr (std::is_same_v<T, std::optional<double>>) {
            if (v) out << fmt::format("{}", *v); else out << YAML::Null;
          } else if constexpr (std::is_same_v<T, double>) {
            out << fmt::format("{}", v);
          } else if constexpr (std::is_same_v<T, std::string>) {
            out << YAML::DoubleQuoted << v;
          } else {
            out << v;
          }
        },
        f.field);
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace imgtrain::cli
