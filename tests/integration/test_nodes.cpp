// Multi-node jobs through the real binary: two "nodes" on this machine, each its own launcher
// (imgtrain's --nnodes, torchrun's c10d rendezvous, a SLURM environment), and two hosts in network
// namespaces joined by a veth pair. Label `dist`.
#include "integration/fixtures.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <regex>

using namespace imgtrain;

namespace {

const std::string kBin = std::string("env OMP_NUM_THREADS=1 ") + IMGTRAIN_BIN;
const std::string kTorchrun = std::string(IMGTRAIN_SOURCE_DIR) + "/.venv/bin/torchrun";

// The model. and optim. tensors of two checkpoints are bitwise equal (how many were compared).
int64_t count_identical(const std::string& a, const std::string& b) {
  auto x = io::load_safetensors(a), y = io::load_safetensors(b);
  int64_t n = 0;
  for (auto& [k, t] : x.tensors) {
    if (k.rfind("model.", 0) != 0 && k.rfind("optim.", 0) != 0) continue;
    const at::Tensor* u = y.find(k);
    INFO(k);
    REQUIRE(u != nullptr);
    REQUIRE(at::equal(t, *u));
    ++n;
  }
  return n;
}

// Shell text running two commands at once (the two nodes), each with its output in its own log
// and its exit code appended to it as "exit=N"; `timeout` bounds a hang.
std::string two_nodes(const std::string& cmd0, const std::string& log0, const std::string& cmd1,
                      const std::string& log1, int timeout_s = 300) {
  const std::string t = "timeout " + std::to_string(timeout_s) + " ";
  return "(" + t + cmd0 + " > " + log0 + " 2>&1; echo exit=$? >> " + log0 + ") & (" + t + cmd1 + " > " + log1 +
         " 2>&1; echo exit=$? >> " + log1 + ") & wait";
}

// Runs the two nodes' commands (two_nodes) and returns their logs; both must have exited 0.
std::pair<std::string, std::string> train_on_two_nodes(const std::string& cmd0, const std::string& log0,
                                                       const std::string& cmd1, const std::string& log1) {
  test::run(two_nodes(cmd0, log0, cmd1, log1));
  std::pair<std::string, std::string> logs{test::read_file(log0), test::read_file(log1)};
  INFO(logs.first << "\n----\n" << logs.second);
  REQUIRE_THAT(logs.first, Catch::Contains("exit=0"));
  REQUIRE_THAT(logs.second, Catch::Contains("exit=0"));
  return logs;
}

std::string run_id_of(const std::string& log) {
  std::smatch m;
  static const std::regex re("run id ([0-9a-zA-Z_-]+)");
  return std::regex_search(log, m, re) ? m[1].str() : "";
}

// One thread per process everywhere (the self-launcher sets it for several workers per node, the
// others do not): float reductions then run in the same order, and weights can be compared bitwise.
std::string common_args(const std::string& data, const std::string& out) {
  return " train --data-dir " + data +
         " --model resnet18 --img-size 28 --in-chans 1 -b 8 --lr 0.05 --warmup-epochs 0 --epochs 1 --device cpu -j 1"
         " --output " + out;
}

}  // namespace

TEST_CASE("every launch form of a 2-node job trains the weights of a single-node job of the same world", "[dist]") {
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("nodes");
  const std::string args = common_args(data, out.path.string());
  auto ref = test::run(kBin + args + " --nproc-per-node 2 --experiment ref");
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  const std::string ref_ckpt = out / "ref/last.safetensors";

  SECTION("two imgtrain launchers, timm's flags on node 0 and Detectron2's names on node 1") {
    const int port = test::free_port();
    const std::string l0 = out / "n0.log", l1 = out / "n1.log";
    const auto [a, b] = train_on_two_nodes(kBin + args + " --experiment self --nproc-per-node 1 --nnodes 2 --node-rank 0 --master-addr "
                                          "127.0.0.1 --master-port " + std::to_string(port),
                        l0,
                        kBin + args + " --experiment self --num-gpus 1 --num-machines 2 --machine-rank 1 --dist-url "
                                      "tcp://127.0.0.1:" + std::to_string(port),
                        l1);
    INFO(a << "\n----\n" << b);
    CHECK_THAT(a, Catch::Contains("Launching 1 worker(s) on node 0 of 2 (world size 2)"));
    CHECK_THAT(b, Catch::Contains("Launching 1 worker(s) on node 1 of 2 (world size 2)"));
    CHECK(!run_id_of(a).empty());
    CHECK(run_id_of(a) == run_id_of(b));  // node 1 took node 0's id
    CHECK(count_identical(out / "self/last.safetensors", ref_ckpt) > 100);
  }
  SECTION("torchrun's c10d rendezvous on two nodes") {
    const std::string rdzv = " --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" +
                             std::to_string(test::free_port()) + " --rdzv-id job7 --no-python ";
    const std::string l0 = out / "t0.log", l1 = out / "t1.log";
    const auto [a, b] = train_on_two_nodes(kTorchrun + rdzv + kBin + args + " --experiment c10d", l0,
                        kTorchrun + rdzv + kBin + args + " --experiment c10d", l1);
    INFO(a << "\n----\n" << b);
    CHECK(count_identical(out / "c10d/last.safetensors", ref_ckpt) > 100);
  }
  SECTION("a SLURM environment of 2 nodes x 1 task, the master from SLURM_JOB_NODELIST and the job id") {
    // The port is 15000 + the job id's last four digits: a job id whose port is free now.
    int job = 1230000 + (::getpid() % 9000);
    while (test::bind_port(15000 + job % 10000) == 0) ++job;
    auto task = [&](int r) {
      return fmt::format("env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE -u LOCAL_RANK SLURM_PROCID={0} "
                         "SLURM_NTASKS=2 SLURM_LOCALID=0 SLURM_NODEID={0} SLURM_JOB_ID={1} "
                         "SLURM_JOB_NODELIST='localhost,node-[2-9]' SLURM_TASKS_PER_NODE='1(x2)' ",
                         r, job);
    };
    const std::string l0 = out / "s0.log", l1 = out / "s1.log";
    const auto [a, b] = train_on_two_nodes(task(0) + kBin + args + " --experiment slurm", l0, task(1) + kBin + args + " --experiment slurm",
                        l1);
    INFO(a << "\n----\n" << b);
    CHECK_THAT(a, Catch::Contains("Process 0, total 2"));
    CHECK(count_identical(out / "slurm/last.safetensors", ref_ckpt) > 100);
  }
}

TEST_CASE("two launchers with 2 processes each equal one node with 4", "[dist]") {
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("nodes4");
  const std::string args = common_args(data, out.path.string());
  auto ref = test::run(kBin + args + " --nproc-per-node 4 --experiment ref");
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  const std::string node = args + " --experiment two --nproc-per-node 2 --nnodes 2 --rdzv-id demo --master-port " +
                           std::to_string(test::free_port()) + " --node-rank ";
  const std::string l0 = out / "n0.log", l1 = out / "n1.log";
  const auto [a, b] = train_on_two_nodes(kBin + node + "0", l0, kBin + node + "1", l1);
  INFO(a << "\n----\n" << b);
  CHECK(run_id_of(a) == "demo");
  CHECK(run_id_of(b) == "demo");
  CHECK(count_identical(out / "two/last.safetensors", out / "ref/last.safetensors") > 100);
}

TEST_CASE("a rendezvous that cannot complete ends in one line and a stop request ends the wait", "[dist]") {
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("rdzv");
  const std::string args = common_args(data, out.path.string()) + " --experiment r --nproc-per-node 1 --nnodes 2";
  const std::string port = std::to_string(test::free_port());
  // Node 1 never starts: node 0 names it. Node 0 never starts: node 1 names the address.
  auto alone0 = test::run("timeout 60 " + kBin + args + " --node-rank 0 --master-port " + port + " --rdzv-timeout 2");
  INFO(alone0.output);
  CHECK(alone0.code == 2);
  CHECK_THAT(alone0.output, Catch::Contains("node(s) 1 of 2 did not join the rendezvous at 127.0.0.1:" + port +
                                            " within 2 s (--rdzv-timeout)"));
  auto alone1 = test::run("timeout 60 " + kBin + args + " --node-rank 1 --master-port " + port + " --rdzv-timeout 2");
  INFO(alone1.output);
  CHECK(alone1.code == 2);
  CHECK_THAT(alone1.output, Catch::Contains("node 1: no rendezvous at 127.0.0.1:" + port + " after 2 s"));
  CHECK_THAT(alone1.output, !Catch::Contains("Exception raised"));  // no c10d stack traces
  // Nodes that disagree: another --nnodes, the same --node-rank twice, another job's --rdzv-id.
  const std::string node0 = "timeout 60 " + kBin + args + " --node-rank 0 --master-port " + port +
                            " --rdzv-timeout 20 > " + (out / "n0.log") + " 2>&1 & P=$!; sleep 1; ";
  auto wrong = test::run(node0 + "timeout 30 " + kBin + common_args(data, out.path.string()) +
                         " --experiment r --nproc-per-node 1 --nnodes 3 --node-rank 1 --master-port " + port +
                         "; echo exit=$?; timeout 30 " + kBin + args + " --node-rank 0 --master-port " + port +
                         " --rdzv-timeout 5; kill -TERM $P; wait $P; echo node0-exit=$?");
  INFO(wrong.output);
  CHECK_THAT(wrong.output, Catch::Contains("node 1: --nnodes 3 but node 0 at 127.0.0.1:" + port +
                                           " started with --nnodes 2"));
  CHECK_THAT(wrong.output, Catch::Contains("exit=2"));
  // The second node 0 cannot host the store on the port the first one holds.
  CHECK_THAT(wrong.output, Catch::Contains("cannot host the rendezvous store"));
  // SIGTERM while waiting for the other nodes: the launcher ends at once with 128 + 15.
  CHECK_THAT(wrong.output, Catch::Contains("node0-exit=143"));
  CHECK_THAT(test::read_file(out / "n0.log"), Catch::Contains("received signal 15 while waiting for the other nodes"));
  auto other = test::run(node0 + "timeout 30 " + kBin + args + " --node-rank 1 --master-port " + port +
                         " --rdzv-id other; echo exit=$?; kill -TERM $P; wait $P");
  INFO(other.output);
  CHECK_THAT(other.output, Catch::Contains("node 1: --rdzv-id other but the job at 127.0.0.1:" + port + " is "));
  // Three nodes, two of them started as node 1.
  const std::string three = "timeout 30 " + kBin + common_args(data, out.path.string()) +
                            " --experiment r --nproc-per-node 1 --nnodes 3 --rdzv-timeout 20 --master-port " + port;
  auto dup = test::run(three + " --node-rank 0 > /dev/null 2>&1 & P=$!; sleep 1; " + three +
                       " --node-rank 1 > /dev/null 2>&1 & Q=$!; sleep 2; " + three +
                       " --node-rank 1; kill -TERM $P $Q; wait");
  INFO(dup.output);
  CHECK_THAT(dup.output, Catch::Contains("node 1: another node already joined the rendezvous at 127.0.0.1:" + port +
                                         " as node 1"));
}

TEST_CASE("a worker whose peers never come names them after --rdzv-timeout and ends at once on SIGTERM", "[dist]") {
  // Rank 0 of a world of 2 (torchrun's or srun's variables) whose rank 1 never starts.
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("stop-early");
  const std::string port = std::to_string(test::free_port());
  const std::string env = "RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port;
  auto timed = test::run(env + " timeout 60 " + kBin + common_args(data, out.path.string()) +
                         " --experiment w --rdzv-timeout 2");
  INFO(timed.output);
  CHECK(timed.code == 2);
  CHECK_THAT(timed.output, Catch::Contains("rank 0: rank(s) 1 of 2 did not join at 127.0.0.1:" + port));
  const std::string log = out / "w.log";
  auto r = test::run(env + " timeout 60 " + kBin + common_args(data, out.path.string()) + " --experiment w > " + log +
                     " 2>&1 & P=$!; for i in $(seq 300); do grep -q 'Waiting for rank' " + log +
                     " && break; sleep 0.1; done; kill -TERM $P; wait $P; echo exit=$?");
  const std::string text = test::read_file(log);
  INFO(r.output << text);
  CHECK_THAT(text, Catch::Contains("Waiting for rank(s) 1 of 2 to join at 127.0.0.1:" + port));
  CHECK_THAT(r.output, Catch::Contains("exit=143"));
  CHECK_THAT(text, Catch::Contains("stopped by a signal before the first update"));
}

namespace {

// Two network namespaces joined by a veth pair, 198.18.0.1 and 198.18.0.2 (the benchmarking range:
// the addresses exist only inside the namespaces, no traffic leaves them). Removed on destruction.
struct TwoHosts {
  std::string a, b, why_not;
  TwoHosts() {
    const std::string tag = std::to_string(::getpid() % 100000);
    a = "imgtrain-a" + tag;
    b = "imgtrain-b" + tag;
    auto r = test::run("set -e; ip netns add " + a + "; ip netns add " + b + "; ip link add va" + tag +
                       " type veth peer name vb" + tag + "; ip link set va" + tag + " netns " + a + "; ip link set vb" +
                       tag + " netns " + b + "; ip -n " + a + " addr add 198.18.0.1/30 dev va" + tag + "; ip -n " + b +
                       " addr add 198.18.0.2/30 dev vb" + tag + "; for n in " + a + " " + b +
                       "; do ip -n $n link set lo up; done; ip -n " + a + " link set va" + tag + " up; ip -n " + b +
                       " link set vb" + tag + " up");
    if (r.code != 0) why_not = r.output.substr(0, r.output.find('\n'));
  }
  ~TwoHosts() { remove(); }
  void remove() {
    if (!a.empty()) test::run("ip netns del " + a + "; ip netns del " + b);
    a.clear();
  }
  std::string on_a(const std::string& cmd) const { return "ip netns exec " + a + " " + cmd; }
  std::string on_b(const std::string& cmd) const { return "ip netns exec " + b + " " + cmd; }
};

}  // namespace

TEST_CASE("two hosts in network namespaces: the job trains and losing node 1 stops node 0 naming the rank",
          "[netns]") {
  TwoHosts hosts;
  if (!hosts.why_not.empty()) {
    // ctest reports the test as skipped (SKIP_RETURN_CODE 77) with this line, not as passed.
    std::cout << "SKIP: cannot make network namespaces here (needs root and iproute2): " << hosts.why_not << std::endl;
    hosts.remove();
    std::_Exit(77);
  }
  auto data = test::fmnist_folder(64, 32);
  test::TempDir out("netns");
  const std::string args = common_args(data, out.path.string()) +
                           " --nproc-per-node 1 --nnodes 2 --master-addr 198.18.0.1 --master-port 29500";
  auto ref = test::run(kBin + common_args(data, out.path.string()) + " --nproc-per-node 2 --experiment ref");
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  {
    const std::string l0 = out / "a.log", l1 = out / "b.log";
    const auto [a, b] = train_on_two_nodes(hosts.on_a(kBin + args + " --experiment hosts --node-rank 0"), l0,
                        hosts.on_b(kBin + args + " --experiment hosts --node-rank 1"), l1);
    INFO(a << "\n----\n" << b);
    CHECK(count_identical(out / "hosts/last.safetensors", out / "ref/last.safetensors") > 100);
  }
  {
    // Node 1's launcher killed outright (a lost host): its worker goes with it, node 0's worker
    // names rank 1 and its launcher exits non-zero.
    auto big = test::fmnist_folder();
    const std::string long_args = " train --data-dir " + big +
                                  " --model resnet18 --img-size 28 --in-chans 1 -b 25 --epochs 3 --device cpu -j 1"
                                  " --log-interval 1 --dist-timeout 60 --output " + out.path.string() +
                                  " --nproc-per-node 1 --nnodes 2 --master-addr 198.18.0.1 --master-port 29501"
                                  " --experiment lost";
    const std::string l0 = out / "la.log", l1 = out / "lb.log";
    auto r = test::run("(timeout 300 " + hosts.on_a(kBin + long_args + " --node-rank 0") + " > " + l0 +
                       " 2>&1; echo exit=$? >> " + l0 + ") & " + hosts.on_b(kBin + long_args + " --node-rank 1") +
                       " > " + l1 + " 2>&1 & P=$!; for i in $(seq 1200); do grep -q 'Train: 0 \\[   2/' " + l0 +
                       " && break; sleep 0.1; done; kill -9 $P; wait");
    const std::string a = test::read_file(l0);
    INFO(r.output << a);
    CHECK_THAT(a, Catch::Contains("Train: 0 [   2/"));
    CHECK_THAT(a, Catch::Contains("rank 0: rank 1 stopped"));
    CHECK_THAT(a, Catch::Contains("worker rank 0 (local rank 0"));
    CHECK_THAT(a, Catch::Contains("exit=1"));
  }
}
