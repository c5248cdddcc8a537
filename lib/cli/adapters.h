// Small adapters from the CLI's Config to each component's own options, as timm's
// optimizer_kwargs(args) / scheduler_kwargs(args): components never read Config field by field.
#pragma once
#include "cli/config.h"
#include "core/model.h"
#include "data/loader.h"
#include "data/transforms.h"
#include "optim/optim.h"

namespace imgtrain::cli {

// timm's create_optimizer_v2 arguments at learning rate `lr`.
optim::OptimizerArgs optimizer_options(const Config& cfg, double lr);
// timm's scheduler_kwargs, for a schedule from `lr` with `updates_per_epoch` optimizer updates.
optim::SchedulerArgs scheduler_options(const Config& cfg, double lr, int64_t updates_per_epoch);
// The training loader: shuffled, drop_last, -j threads, --seed, --pin-mem (on CUDA), rank share.
data::LoaderOptions loader_options(const Config& cfg);
// The training input's random geometry (RandomResizedCrop --scale/--ratio, --hflip,
// --train-interpolation), shared by training and `benchmark --bench data`.
data::TransformConfig train_geometry(const Config& cfg, int size, int channels);
// timm's create_model keyword arguments (drop rates, global pool) for a model of these sizes.
ModelArgs model_args(const Config& cfg, int64_t num_classes, int64_t in_chans, int64_t img_size);

}  // namespace imgtrain::cli
