// Setting a run up, the parts every task and command share: the device, mixed precision,
// BatchNorm arguments, channels-last, the process group, the input's data config (timm's
// resolve_data_config) and small helpers for results. Plain arguments: no CLI types here.
#pragma once
#include "core/model.h"
#include "dist/dist.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace imgtrain::engine {

// --device auto|cpu|cuda|cuda:N, checked against what this machine has. For a CUDA device: made
// the current one of the calling thread (before anything allocates on it), cuDNN's autotuner on
// (timm's scripts set cudnn.benchmark = True), and with `tf32` float32 matmuls and convolutions in
// TF32 (torch's default leaves matmuls in full float32).
torch::Device resolve_device(const std::string& device, bool tf32 = false);

// The CUDA device of a data-parallel process: its local rank's, or, where only one device is
// visible to it and the launcher narrowed the visible devices (CUDA_VISIBLE_DEVICES set, e.g.
// SLURM's --gpus-per-task 1), that one whatever its local rank. Throws a UserError otherwise.
int64_t local_cuda_index(int64_t local_rank, int64_t device_count, bool visible_devices_narrowed);

// Makes `device` current for the calling thread when it is a CUDA device (c10::cuda::set_device);
// nothing for the CPU. Loader threads that pin memory call it too.
void make_current(const torch::Device& device);

struct Amp {
  bool enabled = false;  // autocast (O1)
  bool o2 = false;       // apex O2: half weights, float32 masters (MasterWeights)
  at::ScalarType dtype = at::kHalf;
};
// --amp / --amp-dtype (float16|bfloat16) / --amp-opt-level ('', O0, O1, O2).
Amp resolve_amp(bool amp, const std::string& amp_dtype, const std::string& opt_level);
// One warning where float16 autocast runs on the CPU: torch has few float16 CPU kernels, so it is
// far slower than float32 there (recipes with `amp: true` default to float16, as timm's do).
void warn_cpu_float16(const Amp& amp, torch::Device device);
// timm benchmark.py's name for the precision: float32, amp (float16) or amp_bfloat16.
std::string precision_name(const Amp& amp);

// --channels-last: 4-D weights to NHWC memory layout (inputs follow in the training loop).
void to_channels_last(torch::nn::Module& m);
// w in NHWC memory layout with strides torch reads as channels-last: a weight with one input
// channel per group (a 1-channel stem, a depthwise convolution) keeps NCHW strides under
// contiguous(ChannelsLast), the same bytes but read as NCHW, so oneDNN's convolution over a
// 1-channel input wrote NCHW and the layers up to the next convolution ran on it (ATen's NCHW max
// pool is ~10x slower than its channels-last one at [128, 64, 14, 14]).
at::Tensor channels_last_weight(const at::Tensor& w);
// Whether training `model` defaults to channels-last with the fused BatchNorm kernels: on the CPU,
// in float32, for the families measured faster with both (ModelEntry::cpu_training_nhwc_fused).
// train and benchmark --bench train; the flags, given either way, decide over it.
bool nhwc_fused_training_default(const std::string& model, torch::Device device, const Amp& amp);
// Whether training `model` defaults to the fused kernels (--fuse-bn) in whatever layout: the above,
// ConvNeXt and ViT (ModelEntry::cpu_training_fused), on the CPU in float32.
bool fused_training_default(const std::string& model, torch::Device device, const Amp& amp);
// timm's --bn-momentum / --bn-eps, applied to every BatchNorm of any model.
void apply_bn_args(torch::nn::Module& m, std::optional<double> momentum, std::optional<double> eps);

// Joins the job's process group when a launcher started this process (torchrun's / SLURM's
// variables), moving `device` to cuda:LOCAL_RANK; null for a single process. Sets the log rank.
// join_timeout_s bounds the wait for the other processes to arrive (--rdzv-timeout).
std::shared_ptr<dist::Context> join_process_group(const std::string& backend, int64_t timeout_s,
                                                  int64_t join_timeout_s, torch::Device& device);

// What the model's default config and the flags decide about inputs (timm resolve_data_config).
struct DataConfig {
  int64_t in_chans = 3;
  int64_t img_size = 224;
  double crop_pct = 0.875;
  std::string interpolation = "bilinear";
  std::string crop_mode = "center";
  std::vector<double> mean, std;
};
struct DataOverrides {  // the flags; unset = the model's default
  std::optional<int64_t> in_chans, img_size;
  std::optional<double> crop_pct;
  std::string interpolation;
  std::string crop_mode;
  std::vector<double> mean, std_dev;  // one value (every channel) or one per channel
};
// A user error for a --mean / --std whose count is neither 1 nor the channel count.
DataConfig resolve_data_config(const DataOverrides& o, const ModelDefaults& d);

// timm's prefetcher step: a uint8 NHWC batch -> the model's float input on `dev` (normalised,
// channels-last when asked). The one place that does it.
at::Tensor model_input(const at::Tensor& nhwc_u8, torch::Device dev, const std::vector<double>& mean,
                       const std::vector<double>& std, bool channels_last);

// UserError "<flag> '<path>': cannot open the file" unless `path` is empty or a regular file.
void require_file(const std::string& path, const char* flag);
// UserError "<flag> '<path>': ..." unless `path` is empty or a file that can be written (checked
// before the work whose result goes there; a file that did not exist is not left behind).
void require_writable(const std::string& path, const char* flag);
// Python's round(v, digits), as timm rounds its result rows.
double round_to(double v, int digits);
// --results-file: one result row as csv (header + values) or json; nothing when `path` is empty.
void write_results(const std::string& path, const std::string& format, const nlohmann::ordered_json& row);

}  // namespace imgtrain::engine
