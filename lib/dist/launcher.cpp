#include "dist/launcher.h"

#include "core/error.h"
#include "core/log.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/prctl.h>
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
std::atomic<bool> g_exit_until_work{false}, g_work_started{false};
std::atomic<bool> g_our_launcher{false};  // this process is a worker of imgtrain's own launcher

void on_stop_signal(int sig, siginfo_t* info, void*) {
  g_stop_signal.store(sig);
  if (g_exit_until_work.load() && !g_work_started.load()) {
    // sent by imgtrain's launcher that started this worker (a sibling failed, or it forwards a stop
    // it has already said): its line tells why, this one would mislead
    if (g_our_launcher.load() && info && info->si_code == SI_USER && info->si_pid == getppid()) _exit(128 + sig);
    static const char msg[] = "imgtrain: stopped by a signal before the first update (nothing to save)\n";
    if (write(STDERR_FILENO, msg, sizeof msg - 1) < 0) {}
    _exit(128 + sig);
  }
}

using Clock = std::chrono::steady_clock;

// Ends the launcher when asked to stop while it waits for the other nodes (no worker runs yet).
void exit_if_stopped(const char* what) {
  if (int sig = g_stop_signal.load()) {
    log::info("launcher: received signal {} while {}; exiting", sig, what);
    std::exit(128 + sig);
  }
}

const std::string kLaunchKeys = "imgtrain/launch/";

// Whether something accepts TCP connections at host:port within timeout_ms (probed with a plain
// socket: c10d's client prints a stack trace for every failed attempt). "" when it does, else why not.
std::string probe(const std::string& host, int64_t port, int timeout_ms) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0 || !res)
    return fmt::format("cannot resolve {}: {}", host, gai_strerror(rc));
  std::string why = "no answer";
  for (addrinfo* a = res; a; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc < 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = poll(&p, 1, timeout_ms) == 1 ? 0 : -1;
      int err = 0;
      socklen_t len = sizeof err;
      if (rc == 0 && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0)) {
        rc = -1;
        errno = err;
      } else if (rc != 0) {
        errno = ETIMEDOUT;
      }
    }
    why = rc == 0 ? "" : std::strerror(errno);
    close(fd);
    if (rc == 0) break;
  }
  freeaddrinfo(res);
  return why;
}

// Node r > 0 reaches node 0's store, retrying until the deadline (node 0 may start later).
c10::intrusive_ptr<c10d::TCPStore> connect_to_node0(const LaunchOptions& o, Clock::time_point deadline) {
  std::string last;
  while (Clock::now() < deadline) {
    exit_if_stopped("waiting for node 0");
    last = probe(o.master_addr, o.master_port, 1000);
    if (last.empty()) {
      c10d::TCPStoreOptions so;
      so.port = uint16_t(o.master_port);
      so.isServer = false;
      so.waitWorkers = false;
      so.timeout = std::chrono::seconds(30);
      try {
        return c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
      } catch (const std::exception& e) {
        last = e.what();
        last = last.substr(0, last.find('\n'));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  throw UserError(fmt::format("node {}: no rendezvous at {}:{} after {} s (--rdzv-timeout): node 0's launcher is not "
                              "running there, or that address is not reachable from this host ({})",
                              o.node_rank, o.master_addr, o.master_port, o.rdzv_timeout_s, last));
}

// The nodes' launchers meet in node 0's store before any worker starts: node 0 publishes the job's
// run id, every node registers its rank, and all wait until the nodes are complete. The workers'
// keys then live under the one run id, so they find each other.
std::string rendezvous(c10d::Store& store, const LaunchOptions& o, const std::string& my_id, Clock::time_point deadline) {
  const std::string where = fmt::format("{}:{}", o.master_addr, o.master_port);
  std::string run_id = my_id;
  if (o.node_rank == 0) {
    store.set(kLaunchKeys + "nnodes", std::to_string(o.nnodes));
    store.set(kLaunchKeys + "run_id", run_id);
  } else {
    auto bytes = store.get(kLaunchKeys + "run_id");
    run_id.assign(bytes.begin(), bytes.end());
    if (!o.rdzv_id.empty() && o.rdzv_id != run_id)
      throw UserError(fmt::format("node {}: --rdzv-id {} but the job at {} is {} (another job on that port?)",
                                  o.node_rank, o.rdzv_id, where, run_id));
    auto nn = store.get(kLaunchKeys + "nnodes");
    if (std::string(nn.begin(), nn.end()) != std::to_string(o.nnodes))
      throw UserError(fmt::format("node {}: --nnodes {} but node 0 at {} started with --nnodes {}", o.node_rank,
                                  o.nnodes, where, std::string(nn.begin(), nn.end())));
  }
  if (store.add(kLaunchKeys + fmt::format("node/{}", o.node_rank), 1) > 1)
    throw UserError(fmt::format("node {}: another node already joined the rendezvous at {} as node {} (two nodes with "
                                "the same --node-rank, or another job on that port)",
                                o.node_rank, where, o.node_rank));
  store.add(kLaunchKeys + "joined", 1);
  while (store.add(kLaunchKeys + "joined", 0) < o.nnodes) {
    exit_if_stopped("waiting for the other nodes");
    if (Clock::now() > deadline) {
      std::vector<std::string> missing;
      for (int64_t r = 0; r < o.nnodes; ++r)
        if (!store.check({kLaunchKeys + fmt::format("node/{}", r)})) missing.push_back(std::to_string(r));
      throw UserError(fmt::format("node {}: node(s) {} of {} did not join the rendezvous at {} within {} s "
                                  "(--rdzv-timeout); start every node with the same --nnodes, --master-addr and "
                                  "--master-port and its own --node-rank",
                                  o.node_rank, fmt::join(missing, ", "), o.nnodes, where, o.rdzv_timeout_s));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return run_id;
}

std::string random_run_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

// Environment of worker `local_rank`: ours with torchrun's variables set (or replaced).
std::vector<std::string> worker_env(const LaunchOptions& o, int64_t local_rank, int64_t port, const std::string& run_id) {
  static const char* kOwned[] = {"RANK",        "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                 "ROLE_RANK",   "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                                 "TORCHELASTIC_USE_AGENT_STORE", "IMGTRAIN_ERROR_FD"};
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

void install_stop_handlers(bool exit_until_work) {
  g_exit_until_work.store(exit_until_work);
  g_our_launcher.store(std::getenv("IMGTRAIN_ERROR_FD") != nullptr);  // set by launch() for its workers
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

void mark_work_started() { g_work_started.store(true); }

int stop_signal() { return g_stop_signal.load(); }

int launch(const LaunchOptions& o, const std::vector<std::string>& argv) {
  if (o.nproc_per_node < 1) throw UserError(fmt::format("--nproc-per-node {}: expected at least 1", o.nproc_per_node));
  if (o.node_rank >= o.nnodes)
    throw UserError(fmt::format("--node-rank {}: expected below --nnodes {}", o.node_rank, o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw UserError("--nnodes > 1 needs --master-port (and --master-addr, node 0's address) on every node");
  if (o.master_port < 0 || o.master_port > 65535)
    throw UserError(fmt::format("--master-port {}: expected a port (1..65535)", o.master_port));
  if (o.rdzv_timeout_s < 1) throw UserError(fmt::format("--rdzv-timeout {}: expected at least 1", o.rdzv_timeout_s));
  // Node 0's launcher hosts the store (torchrun's agent store); workers everywhere are clients.
  install_stop_handlers();
  const auto join_deadline = Clock::now() + std::chrono::seconds(o.rdzv_timeout_s);
  if (o.nnodes > 1)
    log::info("Node {} of {}: joining the rendezvous at {}:{} (waiting up to {} s for the other nodes)", o.node_rank,
              o.nnodes, o.master_addr, o.master_port, o.rdzv_timeout_s);
  c10::intrusive_ptr<c10d::TCPStore> store;
  int64_t port = o.master_port;
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
  } else {
    store = connect_to_node0(o, join_deadline);
  }
  std::string run_id = o.rdzv_id.empty() ? random_run_id() : o.rdzv_id;
  if (o.nnodes > 1) run_id = rendezvous(*store, o, run_id, join_deadline);
  log::info("Launching {} worker(s) on node {} of {} (world size {}), rendezvous {}:{}, run id {}", o.nproc_per_node,
            o.node_rank, o.nnodes, o.nproc_per_node * o.nnodes, o.master_addr, port, run_id);

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
  // The workers' user errors come back through a pipe (IMGTRAIN_ERROR_FD) rather than their
  // stderr, so that N workers refusing the same input print one line, not N.
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0)
    throw std::runtime_error(fmt::format("launcher: pipe failed ({})", std::strerror(errno)));
  std::vector<std::vector<std::string>> envs;
  std::vector<std::vector<char*>> cenvs;
  for (int64_t i = 0; i < o.nproc_per_node; ++i) {
    envs.push_back(worker_env(o, i, port, run_id));
    envs.back().push_back(fmt::format("IMGTRAIN_ERROR_FD={}", err_pipe[1]));
  }
  for (auto& e : envs) {
    cenvs.emplace_back();
    for (auto& kv : e) cenvs.back().push_back(kv.data());
    cenvs.back().push_back(nullptr);
  }

  std::vector<pid_t> pids;
  const pid_t launcher_pid = getpid();
  for (int64_t i = 0; i < o.nproc_per_node; ++i) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(fmt::format("launcher: fork failed ({})", std::strerror(errno)));
    if (pid == 0) {
      setpgid(0, 0);  // its own process group: signals reach the worker and anything it starts
      // A launcher killed outright takes its workers with it, as a lost host would: the other
      // nodes then see their peers gone instead of a half-alive job.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher_pid) _exit(1);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      fcntl(err_pipe[1], F_SETFD, 0);  // the write end survives exec
      execve(exe, cargv.data(), cenvs[size_t(i)].data());
      _exit(127);
    }
    setpgid(pid, pid);
    pids.push_back(pid);
  }
  close(err_pipe[1]);
  fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
  std::string reported;                 // bytes read from the pipe
  std::string printed;                  // the line on stderr (the first one reported)
  // One line for the whole job: workers that meet the same bad input at once word it for their own
  // shard (e.g. the last of 50 unreadable files each), so only the first line reported is printed.
  auto print_reported = [&] {
    char buf[4096];
    for (ssize_t n; (n = read(err_pipe[0], buf, sizeof buf)) > 0;) reported.append(buf, size_t(n));
    for (size_t nl; (nl = reported.find('\n')) != std::string::npos; reported.erase(0, nl + 1)) {
      if (!printed.empty()) continue;
      printed = reported.substr(0, nl + 1);
      std::fputs(printed.c_str(), stderr);
    }
  };
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
    print_reported();
    if (!ok && exit_code == 0 && !forwarded) {
      // exit code 2 with its line on the pipe: the worker refused the input; that line is the message
      const bool user_error = WIFEXITED(status) && WEXITSTATUS(status) == 2 && !printed.empty();
      // 128 + SIGINT / SIGTERM: a worker that was signalled (any rank may have been: they stop
      // together, rank 0 saving a recovery point): a stop asked for, passed on as the launcher's own
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
      const bool stop_request = code == 128 + SIGINT || code == 128 + SIGTERM;
      exit_code = user_error ? 2 : stop_request ? code : 1;
      if (stop_request)
        std::fprintf(stderr,
                     "imgtrain launcher: worker rank %lld (local rank %zu, pid %d) stopped on a stop request (signal "
                     "%d); stopping the other workers\n",
                     (long long)(rank0 + int64_t(i)), i, int(pid), code - 128);
      else if (!user_error)
        std::fprintf(stderr,
                     "imgtrain launcher: worker rank %lld (local rank %zu, pid %d) %s; stopping the other workers\n",
                     (long long)(rank0 + int64_t(i)), i, int(pid), describe_status(status).c_str());
      signal_all(SIGTERM);
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    }
  }
  print_reported();
  close(err_pipe[0]);
  return exit_code;
}

}  // namespace imgtrain::dist
