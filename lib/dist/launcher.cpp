#include "dist/launcher.h"

#include "core/error.h"
#include "core/log.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

extern char** environ;

namespace imgtrain::dist {
namespace {

// The one piece of process-wide state outside the registry and the logger: a signal handler can
// only talk to the program through a lock-free flag.
std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) { g_stop_signal.store(sig); }

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

// Environment of worker `local_rank`: ours with torchrun's variables set (or replaced).
std::vector<std::string> worker_env(const LaunchOptions& o, int64_t local_rank, int64_t port, const std::string& run_id) {
  static const char* kOwned[] = {"RANK",        "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                 "ROLE_RANK",   "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                                 "TORCHELASTIC_USE_AGENT_STORE"};
  std::vector<std::string> env;
  bool has_omp = false;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    const std::string k = kv.substr(0, kv.find('='));
    if (std::find(std::begin(kOwned), std::end(kOwned), k) != std::end(kOwned)) continue;
    if (k == "OMP_NUM_THREADS") has_omp = true;
    env.push_back(kv);
  }
  const int64_t world = o.nproc_per_node * o.nnodes, rank = o.node_rank * o.nproc_per_node + local_rank;
  env.push_back(fmt::format("RANK={}", rank));
  env.push_back(fmt::format("LOCAL_RANK={}", local_rank));
  env.push_back(fmt::format("WORLD_SIZE={}", world));
  env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", o.nproc_per_node));
  env.push_back(fmt::format("GROUP_RANK={}", o.node_rank));
  env.push_back(fmt::format("ROLE_RANK={}", rank));
  env.push_back(fmt::format("ROLE_WORLD_SIZE={}", world));
  env.push_back(fmt::format("MASTER_ADDR={}", o.master_addr));
  env.push_back(fmt::format("MASTER_PORT={}", port));
  env.push_back(fmt::format("TORCHELASTIC_RUN_ID={}", run_id));
  env.push_back("TORCHELASTIC_RESTART_COUNT=0");
  env.push_back("TORCHELASTIC_MAX_RESTARTS=0");
  env.push_back("TORCHELASTIC_USE_AGENT_STORE=True");
  if (!has_omp && o.nproc_per_node > 1) env.push_back("OMP_NUM_THREADS=1");  // as torchrun
  return env;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

}  // namespace

bool launched_worker() {
  if (std::getenv("RANK") || std::getenv("LOCAL_RANK")) return true;
  const char* n = std::getenv("SLURM_NTASKS");
  return std::getenv("SLURM_PROCID") && n && std::atoi(n) > 1;
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int stop_signal() { return g_stop_signal.load(); }

int launch(const LaunchOptions& o, const std::vector<std::string>& argv) {
  if (o.nproc_per_node < 1) throw UserError(fmt::format("--nproc-per-node {}: expected at least 1", o.nproc_per_node));
  if (o.node_rank >= o.nnodes)
    throw UserError(fmt::format("--node-rank {}: expected below --nnodes {}", o.node_rank, o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw UserError("--nnodes > 1 needs --master-port (and --master-addr, node 0's address) on every node");
  if (o.master_port < 0 || o.master_port > 65535)
    throw UserError(fmt::format("--master-port {}: expected a port (1..65535)", o.master_port));
  // Node 0's launcher hosts the store (torchrun's agent store); workers everywhere are clients.
  c10::intrusive_ptr<c10d::TCPStore> store;
  int64_t port = o.master_port;
  const std::string run_id = random_run_id();
  if (o.node_rank == 0) {
    c10d::TCPStoreOptions so;
    so.port = uint16_t(port);
    so.isServer = true;
    so.waitWorkers = false;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
    } catch (const std::exception& e) {
      std::string w = e.what();
      throw UserError(fmt::format("--master-port {}: cannot host the rendezvous store ({})", o.master_port,
                                  w.substr(0, w.find('\n'))));
    }
    port = store->getPort();
  }
  log::info("Launching {} worker(s) on node {} of {} (world size {}), rendezvous {}:{}", o.nproc_per_node,
            o.node_rank, o.nnodes, o.nproc_per_node * o.nnodes, o.master_addr, port);

  // Everything exec needs is built before fork: the child only calls async-signal-safe functions.
  std::vector<std::string> args = argv;
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) throw std::runtime_error("launcher: cannot find the imgtrain executable (/proc/self/exe)");
  exe[n] = 0;
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv[0] = exe;
  cargv.push_back(nullptr);
  std::vector<std::vector<std::string>> envs;
  std::vector<std::vector<char*>> cenvs;
  for (int64_t i = 0; i < o.nproc_per_node; ++i) envs.push_back(worker_env(o, i, port, run_id));
  for (auto& e : envs) {
    cenvs.emplace_back();
    for (auto& kv : e) cenvs.back().push_back(kv.data());
    cenvs.back().push_back(nullptr);
  }

  install_stop_handlers();
  std::vector<pid_t> pids;
  for (int64_t i = 0; i < o.nproc_per_node; ++i) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(fmt::format("launcher: fork failed ({})", std::strerror(errno)));
    if (pid == 0) {
      setpgid(0, 0);  // its own process group: signals reach the worker and anything it starts
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      execve(exe, cargv.data(), cenvs[size_t(i)].data());
      _exit(127);
    }
    setpgid(pid, pid);
    pids.push_back(pid);
  }
  const int64_t rank0 = o.node_rank * o.nproc_per_node;
  std::vector<bool> done(pids.size(), false);
  size_t running = pids.size();
  int exit_code = 0, forwarded = 0;
  auto signal_all = [&](int sig) {
    for (size_t i = 0; i < pids.size(); ++i)
      if (!done[i]) kill(-pids[i], sig);
  };
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    if (int sig = stop_signal(); sig && !forwarded) {
      log::info("launcher: received signal {}; forwarding it to the workers", sig);
      signal_all(sig);
      forwarded = sig;
      exit_code = 128 + sig;
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      log::warn("launcher: workers still running 30 s after the stop request; killing them");
      signal_all(SIGKILL);
      deadline = std::chrono::steady_clock::time_point::max();
    }
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    auto it = std::find(pids.begin(), pids.end(), pid);
    if (it == pids.end()) continue;
    const size_t i = size_t(it - pids.begin());
    done[i] = true;
    --running;
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && exit_code == 0 && !forwarded) {
      exit_code = 1;
      std::fprintf(stderr, "imgtrain launcher: worker rank %lld (local rank %zu, pid %d) %s; stopping the other workers\n",
                   (long long)(rank0 + int64_t(i)), i, int(pid), describe_status(status).c_str());
      signal_all(SIGTERM);
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    }
  }
  return exit_code;
}

}  // namespace imgtrain::dist
