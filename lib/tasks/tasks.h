// Picks and sets up the task for a run from the command's config: the model's registry entry
// names its task; the task's datasets, transforms and data config come with it. The one place
// that maps flags to a task's options.
#pragma once
#include "data/dataset.h"
#include "data/transforms.h"
#include "engine/checkpoint.h"
#include "engine/setup.h"
#include "engine/task.h"

#include <memory>

namespace imgtrain::cli {
struct Config;
}

namespace imgtrain::tasks {

struct TaskSetup {
  std::unique_ptr<engine::Task> task;
  std::shared_ptr<data::Dataset> train, eval;
  data::TransformConfig train_transform, eval_transform;
  engine::DataConfig data;
  engine::CheckpointMeta model_meta;  // the model part of what checkpoints record
  // Evaluation sees each image once on one rank (no DistributedSampler padding), as the COCO
  // evaluator's merge needs; classification pads as timm's OrderedDistributedSampler.
  bool sharded_eval = false;
  // validate's batch size where -b is not given (0: validate.py's 256). Detection evaluates one image
  // per process, as torchvision's reference and Detectron2 do: 256 images with 100 detections each
  // and their masks went past 24 GB.
  int64_t validate_batch_size = 0;
};

// For `imgtrain train`: datasets checked against the flags (class counts, batch sizes) before any
// model is built, so that user errors stay one line.
TaskSetup create_train_task(const cli::Config& cfg, int64_t rank, int64_t world);

// A detection model builder's own defaults (the 320 MobileNetV3 detector's sizes and RPN numbers)
// where neither the command line nor the -c file set them; `arch` "" = cfg.model. Other models:
// the config as it is. fit writes args.yaml from this, so it records what the run used.
cli::Config with_model_defaults(const cli::Config& cfg, const std::string& arch = "");

// For `imgtrain validate`: the model described by the flags, completed from the checkpoint's
// metadata (`meta`, null without --checkpoint) as timm's validate.py does from its arguments;
// only the evaluation split and transform are set.
TaskSetup create_validate_task(const cli::Config& cfg, const engine::CheckpointMeta* meta);

// The module a checkpoint's metadata describes, to check its weights against (`imgtrain export`):
// its arch, classes, channels, input size and pooling, and for a detector the widths it was
// trained with (--fpn-channels, --box-head-dim, --mask-head-dim, --mask-head-convs). `what` names
// the checkpoint in errors.
std::shared_ptr<torch::nn::Module> module_from_meta(const engine::CheckpointMeta& m, const std::string& what);

}  // namespace imgtrain::tasks
