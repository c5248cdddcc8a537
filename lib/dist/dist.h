// Data-parallel training on c10d: the process group of a job (Gloo on CPUs, NCCL on GPUs), the
// gradient synchroniser (c10d's Reducer: bucketed all-reduce launched from gradient-ready hooks
// while backward still runs), SyncBatchNorm, the collectives the trainer needs (metric averages,
// BatchNorm statistics, stop agreement) and naming a peer that vanished.
#pragma once
#include "core/batch_norm.h"
#include "dist/env.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace imgtrain::dist {

// A collective failed because a peer is gone (killed, crashed, unreachable). The message names
// the rank when it can tell. The binary prints it in one line and exits non-zero.
class PeerLost : public std::runtime_error {
 public:
  explicit PeerLost(const std::string& msg) : std::runtime_error(msg) {}
};

struct InitOptions {
  std::string backend = "auto";  // auto: nccl for CUDA devices, gloo otherwise
  std::chrono::seconds timeout{1800};
  std::chrono::seconds join_timeout{600};  // for every rank to arrive (then one line naming the absent)
  c10::Device device = c10::kCPU;
};

class Context;

// Gradient synchronisation for one model (torch DDP's reducer). Per micro-step:
// before_forward(sync), forward, after_forward(sync), backward. With sync = false the step's
// gradients stay local and accumulate (no_sync); the next synced backward reduces the sum.
class GradSync {
 public:
  virtual ~GradSync() = default;
  virtual void before_forward(bool sync) = 0;
  virtual void after_forward(bool sync) = 0;
  virtual int64_t num_buckets() const = 0;
};

class Context {
 public:
  // Joins the job's process group (store per DistEnv: the launcher's when use_agent_store, else
  // hosted by rank 0 at MASTER_ADDR:MASTER_PORT; keys under store_prefix(env)).
  static std::shared_ptr<Context> init(const DistEnv& env, const InitOptions& o);
  virtual ~Context() = default;

  int64_t rank() const { return env_.rank; }
  int64_t world() const { return env_.world_size; }
  int64_t local_rank() const { return env_.local_rank; }
  const DistEnv& env() const { return env_; }
  const std::string& backend() const { return backend_; }

  // Collectives of the trainer (each counted in own_collectives()).
  virtual void all_reduce_sum_(at::Tensor& t) = 0;
  virtual void broadcast_(std::vector<at::Tensor> ts, int64_t root = 0) = 0;  // coalesced
  virtual at::Tensor all_gather(const at::Tensor& t) = 0;                      // [world, ...t.shape]
  virtual void barrier() = 0;
  // All-reduces the process group ran (the reducer's included), and those of the trainer's
  // own calls above (metrics, BatchNorm statistics, SyncBN, stop agreement).
  virtual int64_t allreduce_calls() const = 0;
  int64_t own_allreduce_calls() const { return own_allreduce_; }

  // Parameters and buffers from rank 0, checked for identical shapes first (DDP's start).
  virtual void broadcast_model(torch::nn::Module& m) = 0;
  // DDP's reducer over m's parameters (in registration order), buckets of bucket_cap_mb;
  // broadcast_buffers: rank 0's buffers before each synchronised forward (DDP's default).
  virtual std::unique_ptr<GradSync> grad_sync(torch::nn::Module& m, double bucket_cap_mb,
                                              bool broadcast_buffers) = 0;
  // --sync-bn: every imgtrain::BatchNorm2d of m gathers its statistics over the ranks.
  virtual void convert_sync_batchnorm(torch::nn::Module& m) = 0;
  // timm's distribute_bn: running_mean / running_var averaged (reduce) or taken from rank 0.
  void distribute_bn(torch::nn::Module& m, bool reduce);
  // Mean of each value over the ranks.
  std::vector<double> mean(const std::vector<double>& v);
  // True when any rank's flag is set.
  bool any(bool flag);
  // any(), one call late where waiting for its answer would stall a GPU: on a CUDA device the
  // flag is reduced on the device and read back without a host synchronisation, and the answer
  // returned is that of the previous call (false on the first); every rank gets the same answer
  // from the same call. Elsewhere (Gloo on the CPU: no queue to stall) it is any(flag) itself.
  // reset_lagged() drops a pending answer (at an epoch's start; the epoch's end checks any()).
  virtual bool any_lagged(bool flag) { return any(flag); }
  virtual void reset_lagged() {}
  // Every rank's bytes, in rank order (sizes first, then one padded all-gather).
  std::vector<std::string> all_gather_bytes(const std::string& mine);

  // Wraps a failed collective's error: the ranks that stopped answering, from their heartbeats
  // in the store (every rank writes one each second).
  // nullopt when every rank still runs (the error is something else).
  virtual std::optional<PeerLost> explain(const std::exception& e) = 0;

 protected:
  DistEnv env_;
  std::string backend_;
  int64_t own_allreduce_ = 0;
};

}  // namespace imgtrain::dist
