// c10d glue: store, process group, DDP's reducer, SyncBatchNorm, trainer collectives.
// The torch wheel compiles c10d with Gloo (and NCCL in CUDA builds); its headers show those
// classes only when told (torch's CMake config already tells Gloo to its users).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#if defined(IMGTRAIN_WITH_CUDA) && !defined(USE_C10D_NCCL)
#define USE_C10D_NCCL
#endif
#include "dist/dist.h"

#include <cstring>

#include "core/error.h"
#include "core/log.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef IMGTRAIN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/torch.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <fmt/ranges.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace imgtrain::dist {
namespace {

using Ms = std::chrono::milliseconds;

int64_t now_ms() {
  return std::chrono::duration_cast<Ms>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The job's process group, counting what it runs: the tests check that accumulation micro-steps
// do not all-reduce, and the trainer reports the counts.
class CountingGroup : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;
  std::atomic<int64_t> allreduces{0}, others{0};
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions& o = c10d::AllreduceOptions()) override {
    ++allreduces;
    return c10d::ProcessGroup::allreduce(t, o);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t,
                                           const c10d::BroadcastOptions& o = c10d::BroadcastOptions()) override {
    ++others;
    return c10d::ProcessGroup::broadcast(t, o);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions& o = c10d::AllgatherOptions()) override {
    ++others;
    return c10d::ProcessGroup::allgather(out, in, o);
  }
};

// The local address the kernel routes to `host` by (a UDP connect sends nothing); "" if none.
std::string local_address_towards(const std::string& host, int64_t port) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) return "";
  std::string out;
  for (addrinfo* a = res; a && out.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 && getsockname(fd, (sockaddr*)&local, &len) == 0) {
      const void* addr = local.ss_family == AF_INET ? (const void*)&((sockaddr_in*)&local)->sin_addr
                                                    : (const void*)&((sockaddr_in6*)&local)->sin6_addr;
      if (inet_ntop(local.ss_family, addr, buf, sizeof buf)) out = buf;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

// Gloo's interface: GLOO_SOCKET_IFNAME when set (as torch), else the address that routes to the
// master, which on a host with several interfaces is the one its peers can reach (the hostname's
// address, Gloo's default, may be another network's or 127.0.1.1).
std::shared_ptr<::gloo::transport::Device> gloo_device(const DistEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  const std::string local = local_address_towards(env.master_addr, env.master_port);
  if (!local.empty()) return c10d::ProcessGroupGloo::createDeviceForHostname(local);
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// DDP's reducer, set up as torch.nn.parallel.DistributedDataParallel does with its defaults:
// one bucket for the first iteration, rebuilt in gradient-ready order into bucket_cap buckets
// (the first one 1 MiB) before the second; buffers broadcast from rank 0 before every forward
// that follows a synchronised one (broadcast_buffers=True, timm's default unless --no-ddp-bb).
class ReducerSync : public GradSync {
 public:
  ReducerSync(c10::intrusive_ptr<c10d::ProcessGroup> pg, torch::nn::Module& m, double cap_mb, bool broadcast_buffers)
      : pg_(std::move(pg)) {
    std::vector<at::Tensor> params;
    std::unordered_map<size_t, std::string> names;
    for (auto& p : m.named_parameters()) {
      if (!p.value().requires_grad()) continue;
      names[params.size()] = p.key();
      params.push_back(p.value());
    }
    if (broadcast_buffers) buffers_ = m.buffers();
    auto buckets = std::get<0>(c10d::compute_bucket_assignment_by_size(params, {size_t(INT64_MAX)}));
    std::reverse(buckets.begin(), buckets.end());
    const int64_t cap = int64_t(cap_mb * 1024 * 1024);
    const bool default_cap = cap_mb == 25.0;
    reducer_ = std::make_shared<c10d::Reducer>(params, buckets, pg_, std::vector<bool>(params.size(), false), cap,
                                               /*find_unused_parameters=*/false, /*gradient_as_bucket_view=*/true,
                                               names, default_cap ? int64_t(1024 * 1024) : cap,
                                               /*skip_all_reduce_unused_params=*/false,
                                               /*use_python_reducer=*/false, std::vector<int64_t>{});
    num_buckets_ = int64_t(buckets.size());
  }
  void before_forward(bool sync) override {
    if (sync) reducer_->prepare_for_forward();
    if (reducer_->rebuild_buckets()) num_buckets_ = int64_t(reducer_->get_grad_buckets(false).size());
    if (buffers_sync_ && !buffers_.empty()) {
      torch::NoGradGuard ng;
      c10d::broadcast_coalesced(pg_, buffers_, 250u << 20, 0);
    }
  }
  void after_forward(bool sync) override {
    if (sync) reducer_->prepare_for_backward({});
    buffers_sync_ = sync;
  }
  int64_t num_buckets() const override { return num_buckets_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<c10d::Reducer> reducer_;
  std::vector<at::Tensor> buffers_;
  bool buffers_sync_ = true;
  int64_t num_buckets_ = 0;
};

// torch.nn.SyncBatchNorm's training step on any device: per-rank mean and biased variance, all
// gathered with the counts and combined exactly (no E[x^2] - E[x]^2 cancellation); in backward,
// the sums of dy and dy * (x - mean) all-reduced so that the input gradient is the one of the
// whole global batch. Weight and bias gradients stay local; the reducer averages them.
class SyncBatchNorm : public SyncBatchNormHook {
 public:
  explicit SyncBatchNorm(Context* ctx) : ctx_(ctx) {}
  at::Tensor forward(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x) override;

 private:
  Context* ctx_;
};

struct SyncBatchNormFn : torch::autograd::Function<SyncBatchNormFn> {
  // total_count: a 0-dim tensor on the input's device (no host read of the gathered counts).
  static at::Tensor forward(torch::autograd::AutogradContext* ac, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& invstd,
                            const at::Tensor& total_count, int64_t ctx_ptr) {
    const std::vector<int64_t> shape{1, -1, 1, 1};
    const auto ct = mean.scalar_type();  // float32, or float64 for float64 inputs
    auto xf = x.to(ct);
    auto scale = invstd * weight.to(ct);
    auto shift = bias.to(ct) - mean * scale;
    auto y = (xf * scale.view(shape) + shift.view(shape)).to(x.scalar_type());
    ac->save_for_backward({x, weight, mean, invstd});
    ac->saved_data["count"] = total_count;
    ac->saved_data["ctx"] = ctx_ptr;  // saved_data holds IValues only: the Context as an integer
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ac,
                                                 torch::autograd::variable_list grads) {
    auto saved = ac->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const auto& mean = saved[2];
    const auto& invstd = saved[3];
    auto* ctx = reinterpret_cast<Context*>(ac->saved_data["ctx"].toInt());
    const auto count = ac->saved_data["count"].toTensor();
    const std::vector<int64_t> shape{1, -1, 1, 1};
    const auto ct = mean.scalar_type();
    auto dy = grads[0].to(ct);
    auto xmu = x.to(ct) - mean.view(shape);
    auto sum_dy = dy.sum({0, 2, 3});
    auto sum_dy_xmu = (dy * xmu).sum({0, 2, 3});
    auto grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    auto grad_bias = sum_dy.to(weight.scalar_type());
    auto both = at::cat({sum_dy, sum_dy_xmu});
    ctx->all_reduce_sum_(both);
    const int64_t c = mean.size(0);
    const auto n = count.to(ct);
    auto mean_dy = both.narrow(0, 0, c) / n, mean_dy_xmu = both.narrow(0, c, c) / n;
    auto gx = (dy - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) *
              (invstd * weight.to(ct)).view(shape);
    return {gx.to(x.scalar_type()), grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor SyncBatchNorm::forward(torch::nn::BatchNorm2dImpl& bn, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 4, "SyncBatchNorm: expected a 4-D input");
  const int64_t c = x.size(1);
  at::Tensor mean, invstd, total;
  const auto ct = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  {
    torch::NoGradGuard ng;
    auto xf = x.detach().to(ct);
    auto [var, m] = at::var_mean(xf, {0, 2, 3}, /*correction=*/0, /*keepdim=*/false);
    const double n = double(x.size(0) * x.size(2) * x.size(3));
    auto local = at::cat({m, var, at::full({1}, n, m.options())}).to(at::kDouble);
    auto all = ctx_->all_gather(local).to(x.device());  // [W, 2C + 1]
    // The total count stays a device tensor: no host synchronisation per layer on a GPU.
    auto counts = all.select(1, 2 * c);
    total = counts.sum();
    auto means = all.narrow(1, 0, c), vars = all.narrow(1, c, c);
    auto w = (counts / total).unsqueeze(1);
    auto gmean = (means * w).sum(0);
    auto gvar = ((vars + (means - gmean).pow(2)) * w).sum(0);
    mean = gmean.to(ct);
    invstd = (gvar + bn.options.eps()).rsqrt().to(ct);
    if (bn.options.track_running_stats() && bn.running_mean.defined()) {
      const double mom = bn.options.momentum().value_or(0.1);
      auto unbiased = gvar * (total / (total - 1.0).clamp_min(1.0));
      bn.running_mean.mul_(1 - mom).add_(gmean.to(bn.running_mean.scalar_type()), mom);
      bn.running_var.mul_(1 - mom).add_(unbiased.to(bn.running_var.scalar_type()), mom);
      bn.num_batches_tracked.add_(1);
    }
  }
  at::Tensor weight = bn.weight.defined() ? bn.weight : at::ones({c}, x.options().dtype(ct));
  at::Tensor bias = bn.bias.defined() ? bn.bias : at::zeros({c}, x.options().dtype(ct));
  return SyncBatchNormFn::apply(x, weight, bias, mean, invstd, total,
                                int64_t(reinterpret_cast<intptr_t>(ctx_)));
}

class C10dContext : public Context {
 public:
  C10dContext(const DistEnv& env, const InitOptions& o) {
    env_ = env;
    device_ = o.device;
    backend_ = o.backend == "auto" ? (o.device.is_cuda() ? "nccl" : "gloo") : o.backend;
    if (backend_ == "nccl" && !o.device.is_cuda())
      throw UserError("--dist-backend nccl needs --device cuda (use gloo on CPUs)");
    const auto timeout = std::chrono::duration_cast<Ms>(o.timeout);
    c10d::TCPStoreOptions so;
    so.port = uint16_t(env.master_port);
    so.isServer = !env.use_agent_store && env.rank == 0;
    so.numWorkers = size_t(env.world_size);
    so.waitWorkers = false;
    so.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> base;
    try {
      base = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
      c10d::TCPStoreOptions ho = so;  // a second connection for the heartbeat thread
      ho.isServer = false;
      heartbeat_store_ = c10::make_intrusive<c10d::PrefixStore>(
          store_prefix(env), c10::make_intrusive<c10d::TCPStore>(env.master_addr, ho));
    } catch (const std::exception& e) {
      throw UserError(fmt::format("rank {}: cannot reach the rendezvous store at {}:{} ({})", env.rank,
                                  env.master_addr, env.master_port, first_line(e.what())));
    }
    store_ = c10::make_intrusive<c10d::PrefixStore>(store_prefix(env), base);
    server_ = so.isServer ? base : c10::intrusive_ptr<c10d::Store>();
    wait_for_ranks(o.join_timeout);
    start_heartbeat();
    pg_ = c10::make_intrusive<CountingGroup>(store_, int(env.rank), int(env.world_size));
    if (backend_ == "gloo") {
      auto go = c10d::ProcessGroupGloo::Options::create(timeout);
      go->devices.push_back(gloo_device(env));
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo/", store_), int(env.rank), int(env.world_size), go);
      pg_->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
      if (o.device.is_cuda()) pg_->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
      pg_->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    } else if (backend_ == "nccl") {
#ifdef IMGTRAIN_WITH_CUDA
      c10::cuda::set_device(o.device.index());
      auto no = c10d::ProcessGroupNCCL::Options::create();
      no->timeout = timeout;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl/", store_), int(env.rank), int(env.world_size), no);
      pg_->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      pg_->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
      throw UserError("--dist-backend nccl: this build has no CUDA support");
#endif
    } else {
      throw UserError(fmt::format("--dist-backend '{}': expected auto, gloo or nccl", backend_));
    }
  }
  ~C10dContext() override {
    {
      std::lock_guard<std::mutex> lk(hb_mu_);
      hb_stop_ = true;
    }
    hb_cv_.notify_all();
    if (hb_thread_.joinable()) hb_thread_.join();
  }

  void all_reduce_sum_(at::Tensor& t) override {
    ++own_allreduce_;
    auto dev = on_device(t);
    std::vector<at::Tensor> v{dev};
    pg_->allreduce(v)->wait();
    if (!dev.is_same(t)) t.copy_(dev);
  }
  void broadcast_(std::vector<at::Tensor> ts, int64_t root) override {
    torch::NoGradGuard ng;
    c10d::broadcast_coalesced(pg_, ts, 250u << 20, int(root));
  }
  at::Tensor all_gather(const at::Tensor& t) override {
    std::vector<at::Tensor> in{on_device(t).contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int64_t r = 0; r < env_.world_size; ++r) out[0].push_back(at::empty_like(in[0]));
    pg_->allgather(out, in)->wait();
    return at::stack(out[0]).to(t.device());
  }
  void barrier() override {
    pg_->barrier()->wait();
  }
  int64_t allreduce_calls() const override { return pg_->allreduces; }

  void broadcast_model(torch::nn::Module& m) override {
    torch::NoGradGuard ng;
    auto params = m.parameters();
    c10d::verify_params_across_processes(pg_, params, std::nullopt);
    auto states = params;
    for (auto& b : m.buffers()) states.push_back(b);
    broadcast_(states, 0);
  }
  std::unique_ptr<GradSync> grad_sync(torch::nn::Module& m, double cap_mb, bool broadcast_buffers) override {
    return std::make_unique<ReducerSync>(pg_, m, cap_mb, broadcast_buffers);
  }
  void convert_sync_batchnorm(torch::nn::Module& m) override {
    auto hook = std::make_shared<SyncBatchNorm>(this);
    int n = 0;
    for (auto& mod : m.modules(/*include_self=*/true))
      if (auto* bn = dynamic_cast<imgtrain::BatchNorm2dImpl*>(mod.get())) {
        bn->sync = hook;
        ++n;
      }
    if (n == 0) log::warn("--sync-bn: the model has no BatchNorm layers; nothing to synchronise");
    else log::info("Converted model to use Synchronized BatchNorm ({} layers).", n);
  }

  std::optional<PeerLost> explain(const std::exception& e) override {
    // Heartbeats advance once a second; a rank whose value stands still for 3 s is gone.
    auto read = [&]() {
      std::vector<int64_t> v(size_t(env_.world_size), -1);
      for (int64_t r = 0; r < env_.world_size; ++r) {
        const std::string key = fmt::format("hb/{}", r);
        if (!heartbeat_store_->check({key})) continue;
        auto bytes = heartbeat_store_->get(key);
        v[size_t(r)] = std::stoll(std::string(bytes.begin(), bytes.end()));
      }
      return v;
    };
    const std::string what = first_line(e.what());
    try {
      auto before = read();
      std::this_thread::sleep_for(std::chrono::milliseconds(3200));
      auto after = read();
      std::vector<std::string> gone;
      for (int64_t r = 0; r < env_.world_size; ++r)
        if (r != env_.rank && after[size_t(r)] == before[size_t(r)]) gone.push_back(std::to_string(r));
      if (!gone.empty())
        return PeerLost(fmt::format("rank {}: rank {} stopped (no heartbeat for 3 s) during a collective; giving up "
                                    "({})",
                                    env_.rank, fmt::join(gone, ", "), what));
      return std::nullopt;
    } catch (const std::exception&) {
      const std::string host = env_.use_agent_store ? "the launcher, which hosts the store," : "rank 0, which hosts the store,";
      return PeerLost(fmt::format("rank {}: a collective failed and {} is unreachable ({})", env_.rank, host, what));
    }
  }

 private:
  static std::string first_line(const std::string& s) {
    auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }
  // Every rank registers in the store and waits for the others, so that a rank that never comes
  // (a task that failed to start, a node on another job's id) is named within the join timeout
  // instead of leaving the group's own connect to wait --dist-timeout in silence.
  void wait_for_ranks(std::chrono::seconds join_timeout) {
    store_->set(fmt::format("joined/{}", env_.rank), "1");
    const auto start = std::chrono::steady_clock::now();
    bool said = false;
    std::vector<std::string> keys;
    for (int64_t r = 0; r < env_.world_size; ++r) keys.push_back(fmt::format("joined/{}", r));
    while (true) {
      std::vector<std::string> missing;
      for (int64_t r = 0; r < env_.world_size; ++r)
        if (!store_->check({keys[size_t(r)]})) missing.push_back(std::to_string(r));
      if (missing.empty()) return;
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > join_timeout)
        throw UserError(fmt::format("rank {}: rank(s) {} of {} did not join at {}:{} (run {}) within {} s "
                                    "(--rdzv-timeout)",
                                    env_.rank, fmt::join(missing, ", "), env_.world_size, env_.master_addr,
                                    env_.master_port, env_.run_id, join_timeout.count()));
      if (!said && waited > std::chrono::seconds(5) && env_.rank == 0) {
        log::info("Waiting for rank(s) {} of {} to join at {}:{} (up to {} s)", fmt::join(missing, ", "),
                  env_.world_size, env_.master_addr, env_.master_port, join_timeout.count());
        said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  at::Tensor on_device(const at::Tensor& t) const {
    return backend_ == "nccl" && !t.is_cuda() ? t.to(device_) : t;
  }

 public:
  bool any_lagged(bool flag) override {
    if (!device_.is_cuda()) return any(flag);
    c10::impl::VirtualGuardImpl impl(device_.type());
    bool previous = false;
    if (lag_event_) {
      lag_event_->synchronize();  // the previous call's copy: queued an update ago, normally done
      previous = lag_host_.data_ptr<double>()[0] > 0;
    }
    ++own_allreduce_;
    auto t = at::full({1}, flag ? 1.0 : 0.0, at::TensorOptions().dtype(at::kDouble).device(device_));
    std::vector<at::Tensor> v{t};
    pg_->allreduce(v)->wait();  // the current stream waits for NCCL's; the host does not
    if (!lag_host_.defined()) lag_host_ = at::empty({1}, at::TensorOptions().dtype(at::kDouble).pinned_memory(true));
    lag_host_.copy_(t, /*non_blocking=*/true);
    if (!lag_event_) lag_event_.emplace(device_.type());
    lag_event_->record(impl.getStream(device_));
    return previous;
  }
  void reset_lagged() override {
    if (lag_event_) lag_event_->synchronize();
    lag_event_.reset();
  }

 private:
  std::optional<c10::Event> lag_event_;
  at::Tensor lag_host_;
  void start_heartbeat() {
    hb_thread_ = std::thread([this] {
      std::unique_lock<std::mutex> lk(hb_mu_);
      const std::string key = fmt::format("hb/{}", env_.rank);
      int64_t beat = 0;
      while (!hb_stop_) {
        try {
          heartbeat_store_->set(key, std::to_string(++beat));
        } catch (const std::exception&) {
          return;  // the store is gone; collectives will say so
        }
        hb_cv_.wait_for(lk, std::chrono::seconds(1));
      }
    });
  }

  c10::Device device_ = c10::kCPU;
  c10::intrusive_ptr<c10d::Store> store_, server_, heartbeat_store_;
  c10::intrusive_ptr<CountingGroup> pg_;
  std::thread hb_thread_;
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;
};

}  // namespace

std::shared_ptr<Context> Context::init(const DistEnv& env, const InitOptions& o) {
  return std::make_shared<C10dContext>(env, o);
}

void Context::distribute_bn(torch::nn::Module& m, bool reduce) {
  torch::NoGradGuard ng;
  std::vector<at::Tensor> stats;
  for (auto& b : m.named_buffers())
    if (b.key().find("running_mean") != std::string::npos || b.key().find("running_var") != std::string::npos)
      stats.push_back(b.value());
  if (stats.empty()) return;
  if (!reduce) {
    broadcast_(stats, 0);
    return;
  }
  std::vector<at::Tensor> flat_in;
  for (auto& s : stats) flat_in.push_back(s.reshape(-1));
  auto flat = at::cat(flat_in);
  all_reduce_sum_(flat);
  flat.div_(double(world()));
  int64_t off = 0;
  for (auto& s : stats) {
    s.copy_(flat.narrow(0, off, s.numel()).view_as(s));
    off += s.numel();
  }
}

std::vector<double> Context::mean(const std::vector<double>& v) {
  auto t = at::tensor(v, at::kDouble);
  all_reduce_sum_(t);
  t.div_(double(world()));
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

std::vector<std::string> Context::all_gather_bytes(const std::string& mine) {
  const auto sizes = all_gather(at::full({1}, int64_t(mine.size()), at::kLong));
  int64_t longest = 0;
  for (int64_t r = 0; r < world(); ++r) longest = std::max(longest, sizes[r].item<int64_t>());
  auto buf = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), mine.data(), mine.size());
  const auto all = all_gather(buf).contiguous();
  std::vector<std::string> out;
  for (int64_t r = 0; r < world(); ++r)
    out.emplace_back(reinterpret_cast<const char*>(all[r].data_ptr<uint8_t>()), size_t(sizes[r].item<int64_t>()));
  return out;
}

bool Context::any(bool flag) {
  auto t = at::full({1}, flag ? 1.0 : 0.0, at::kDouble);
  all_reduce_sum_(t);
  return t.item<double>() > 0;
}

}  // namespace imgtrain::dist
