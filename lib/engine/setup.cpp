#include "engine/setup.h"

#include "core/error.h"
#include "core/log.h"
#include "data/normalize.h"
#include "model_zoo/registry.h"

#include <fmt/ranges.h>
#include <torch/torch.h>

#ifdef IMGTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace imgtrain::engine {

namespace {
torch::Device cuda_run_settings(const torch::Device& dev, bool tf32) {
  if (!dev.is_cuda()) return dev;
  make_current(dev);
  at::globalContext().setBenchmarkCuDNN(true);
  if (tf32) {
    at::globalContext().setAllowTF32CuBLAS(true);
    at::globalContext().setAllowTF32CuDNN(true);
  }
  return dev;
}
}  // namespace

torch::Device resolve_device(const std::string& d, bool tf32) {
  if (d == "auto")
    return cuda_run_settings(
        torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU), tf32);
  if (d == "cpu") return torch::kCPU;
  if (!torch::cuda::is_available())
    throw UserError(fmt::format("--device '{}': no CUDA device is available here (use --device cpu)", d));
  int idx = d == "cuda" ? 0 : std::stoi(d.substr(5));
  if (idx >= int(torch::cuda::device_count()))
    throw UserError(fmt::format("--device '{}': only {} CUDA device(s) present", d, torch::cuda::device_count()));
  return cuda_run_settings(torch::Device(torch::kCUDA, c10::DeviceIndex(idx)), tf32);
}

int64_t local_cuda_index(int64_t local_rank, int64_t device_count, bool visible_devices_narrowed) {
  if (local_rank < device_count) return local_rank;
  if (device_count == 1 && visible_devices_narrowed) return 0;  // one device per task
  throw UserError(fmt::format("LOCAL_RANK {}: only {} CUDA device(s) visible on this host{}", local_rank,
                              device_count,
                              visible_devices_narrowed ? "" : " (one device per process: set CUDA_VISIBLE_DEVICES)"));
}

void make_current(const torch::Device& device) {
#ifdef IMGTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::set_device(device.index() < 0 ? 0 : device.index());
#else
  (void)device;
#endif
}

Amp resolve_amp(bool amp, const std::string& amp_dtype, const std::string& opt_level) {
  Amp a;
  a.o2 = opt_level == "O2";
  a.enabled = opt_level == "O1" || (amp && opt_level != "O0" && !a.o2);
  a.dtype = amp_dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  return a;
}

void warn_cpu_float16(const Amp& amp, torch::Device device) {
  if (device.is_cpu() && (amp.enabled || amp.o2) && amp.dtype == at::kHalf)
    log::warn("--amp in float16 on the CPU: torch has few float16 CPU kernels, so this runs far slower than "
              "float32 (resnet50 training measured ~20x slower); --amp-dtype bfloat16 is the CPU's mixed precision");
}

std::string precision_name(const Amp& amp) {
  if (!amp.enabled && !amp.o2) return "float32";
  return amp.dtype == at::kBFloat16 ? "amp_bfloat16" : "amp";
}

namespace {
bool cpu_float32(torch::Device device, const Amp& amp) { return device.is_cpu() && !amp.enabled && !amp.o2; }
}  // namespace

bool nhwc_fused_training_default(const std::string& model, torch::Device device, const Amp& amp) {
  return cpu_float32(device, amp) && model_zoo::cpu_training_nhwc_fused(model);
}

bool fused_training_default(const std::string& model, torch::Device device, const Amp& amp) {
  return cpu_float32(device, amp) && model_zoo::cpu_training_fused(model);
}

void to_channels_last(torch::nn::Module& m) {
  torch::NoGradGuard ng;
  for (auto& p : m.parameters())
    if (p.dim() == 4) p.set_data(channels_last_weight(p));
}

at::Tensor channels_last_weight(const at::Tensor& w) {
  auto c = w.contiguous(at::MemoryFormat::ChannelsLast);
  if (c.size(1) != 1 || c.suggest_memory_format() == at::MemoryFormat::ChannelsLast) return c;
  // [O, 1, kh, kw]: NCHW strides are channels-last too (the same bytes), and contiguous() keeps
  // them, but torch reads them as NCHW; fresh channels-last strides say which it is
  return at::empty(c.sizes(), c.options().memory_format(at::MemoryFormat::ChannelsLast)).copy_(c);
}

void apply_bn_args(torch::nn::Module& m, std::optional<double> momentum, std::optional<double> eps) {
  if (!momentum && !eps) return;
  for (auto& mod : m.modules(/*include_self=*/false))
    if (auto* bn = mod->as<torch::nn::BatchNorm2dImpl>()) {
      if (momentum) bn->options.momentum(*momentum);
      if (eps) bn->options.eps(*eps);
    }
}

std::shared_ptr<dist::Context> join_process_group(const std::string& backend, int64_t timeout_s,
                                                  int64_t join_timeout_s, torch::Device& device) {
  const auto denv = dist::read_env();
  log::set_rank(int(denv.rank));
  if (!denv.distributed()) return nullptr;
  if (device.is_cuda()) {  // one device per process: the local rank's (or the one visible)
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    const auto idx = local_cuda_index(denv.local_rank, int64_t(torch::cuda::device_count()), visible && *visible);
    device = torch::Device(torch::kCUDA, c10::DeviceIndex(idx));
    make_current(device);
  }
  dist::InitOptions io;
  io.backend = backend;
  io.timeout = std::chrono::seconds(timeout_s);
  io.join_timeout = std::chrono::seconds(join_timeout_s);
  io.device = device;
  return dist::Context::init(denv, io);
}

DataConfig resolve_data_config(const DataOverrides& o, const ModelDefaults& d) {
  DataConfig dc;
  dc.in_chans = o.in_chans.value_or(3);
  dc.img_size = o.img_size.value_or(d.input_size[2]);
  dc.crop_pct = o.crop_pct.value_or(d.crop_pct);
  dc.interpolation = o.interpolation.empty() ? d.interpolation : o.interpolation;
  dc.crop_mode = o.crop_mode.empty() ? d.crop_mode : o.crop_mode;
  if (dc.in_chans == 3) {
    dc.mean.assign(d.mean.begin(), d.mean.end());
    dc.std.assign(d.std.begin(), d.std.end());
  } else {
    // Single-channel (and other) inputs: the average of the RGB statistics for every channel.
    double m = (d.mean[0] + d.mean[1] + d.mean[2]) / 3, s = (d.std[0] + d.std[1] + d.std[2]) / 3;
    dc.mean.assign(size_t(dc.in_chans), m);
    dc.std.assign(size_t(dc.in_chans), s);
  }
  // timm's --mean / --std (resolve_data_config): one value for every channel, else one per channel
  auto given = [&](const std::vector<double>& v, std::vector<double>& out, const char* flag) {
    if (v.empty()) return;
    if (v.size() == 1) out.assign(size_t(dc.in_chans), v[0]);
    else if (int64_t(v.size()) == dc.in_chans) out = v;
    else
      throw UserError(fmt::format("--{} {}: give one value or one per input channel ({})", flag, fmt::join(v, " "),
                                  dc.in_chans));
  };
  given(o.mean, dc.mean, "mean");
  given(o.std_dev, dc.std, "std");
  return dc;
}

at::Tensor model_input(const at::Tensor& nhwc_u8, torch::Device dev, const std::vector<double>& mean,
                       const std::vector<double>& std, bool channels_last) {
  return data::normalize_nhwc_u8(nhwc_u8.to(dev, /*non_blocking=*/true), mean, std, channels_last);
}

void require_file(const std::string& path, const char* flag) {
  std::error_code ec;
  if (!path.empty() && !fs::is_regular_file(path, ec))
    throw UserError(fmt::format("{} '{}': cannot open the file", flag, path));
}

double round_to(double v, int digits) {
  const double s = std::pow(10.0, digits);
  return std::nearbyint(v * s) / s;
}

void require_writable(const std::string& path, const char* flag) {
  if (path.empty()) return;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UserError(fmt::format("{} '{}': a folder; give a file name", flag, path));
  const bool existed = std::filesystem::exists(path, ec);
  if (!std::ofstream(path, std::ios::app))
    throw UserError(fmt::format("{} '{}': cannot write the file (does its folder exist?)", flag, path));
  if (!existed) std::filesystem::remove(path, ec);
}

void write_results(const std::string& path, const std::string& format, const nlohmann::ordered_json& row) {
  if (path.empty()) return;
  std::ofstream f(path);
  if (format == "json") {
    f << row.dump(4) << "\n";
  } else {
    std::vector<std::string> head, vals;
    for (auto& [k, v] : row.items()) {
      head.push_back(k);
      vals.push_back(v.is_string() ? v.get<std::string>() : v.dump());
    }
    f << fmt::format("{}\n{}\n", fmt::join(head, ","), fmt::join(vals, ","));
  }
  if (!f) throw UserError(fmt::format("--results-file '{}': cannot write", path));
}

}  // namespace imgtrain::engine
