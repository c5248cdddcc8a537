#include "dist/env.h"

#include "core/error.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fmt/format.h>

namespace imgtrain::dist {
namespace {

int64_t int_var(const GetEnv& getenv, const char* name, int64_t dflt, int64_t min_value) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  if (errno || *end || x < min_value)
    throw UserError(fmt::format("environment variable {}='{}': expected an integer >= {}", name, v, min_value));
  return x;
}

std::string str_var(const GetEnv& getenv, const char* name, const std::string& dflt) {
  const char* v = getenv(name);
  return v && *v ? std::string(v) : dflt;
}

// SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE ("2(x3),1": two tasks on each of the first three
// nodes, one on the fourth): the count of node `node`; 0 when the value says nothing about it.
int64_t slurm_tasks_on_node(const std::string& v, int64_t node) {
  int64_t first = 0;
  size_t i = 0;
  while (i < v.size()) {
    size_t end = v.find(',', i);
    if (end == std::string::npos) end = v.size();
    const std::string item = v.substr(i, end - i);
    int64_t n = 0, reps = 1;
    if (std::sscanf(item.c_str(), "%ld(x%ld)", &n, &reps) < 1 || n < 1 || reps < 1) return 0;
    if (node < first + reps) return n;
    first += reps;
    i = end + 1;
  }
  return 0;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first item at bracket depth 0: "gpu[003-005,9],login1" -> "gpu[003-005,9]".
  size_t depth = 0, end = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    else if (nodelist[end] == ']' && depth) --depth;
    else if (nodelist[end] == ',' && depth == 0) break;
  }
  // Each bracket group gives its first host's digits as written (zero padding included):
  // "rack[2-3]-n[01-04]" -> "rack2-n01".
  std::string item = nodelist.substr(0, end), host;
  for (size_t i = 0; i < item.size();) {
    const size_t open = item.find('[', i), close = open == std::string::npos ? open : item.find(']', open);
    if (close == std::string::npos) {
      host += item.substr(i);
      break;
    }
    const std::string ranges = item.substr(open + 1, close - open - 1);
    host += item.substr(i, open - i) + ranges.substr(0, ranges.find_first_of(",-"));
    i = close + 1;
  }
  return host;
}

DistEnv read_env(const GetEnv& getenv) {
  DistEnv e;
  const bool torchrun = getenv("RANK") || getenv("WORLD_SIZE");
  const bool slurm = !torchrun && getenv("SLURM_PROCID") && int_var(getenv, "SLURM_NTASKS", 1, 1) > 1;
  if (torchrun) {
    e.launcher = "torchrun";
    e.rank = int_var(getenv, "RANK", 0, 0);
    e.world_size = int_var(getenv, "WORLD_SIZE", 1, 1);
    e.local_rank = int_var(getenv, "LOCAL_RANK", 0, 0);
    e.local_world_size = int_var(getenv, "LOCAL_WORLD_SIZE", 1, 1);
    e.group_rank = int_var(getenv, "GROUP_RANK", 0, 0);
    e.run_id = str_var(getenv, "TORCHELASTIC_RUN_ID", "none");
    e.restart_count = int_var(getenv, "TORCHELASTIC_RESTART_COUNT", 0, 0);
    e.use_agent_store = str_var(getenv, "TORCHELASTIC_USE_AGENT_STORE", "False") == "True";
  } else if (slurm) {
    e.launcher = "slurm";
    e.rank = int_var(getenv, "SLURM_PROCID", 0, 0);
    e.world_size = int_var(getenv, "SLURM_NTASKS", 1, 1);
    e.local_rank = int_var(getenv, "SLURM_LOCALID", 0, 0);
    e.group_rank = int_var(getenv, "SLURM_NODEID", 0, 0);
    const std::string per_node = str_var(getenv, "SLURM_TASKS_PER_NODE", str_var(getenv, "SLURM_NTASKS_PER_NODE", ""));
    e.local_world_size = std::max<int64_t>(1, slurm_tasks_on_node(per_node, e.group_rank));
    e.run_id = str_var(getenv, "SLURM_JOB_ID", "none");
  } else {
    return e;
  }
  if (e.rank >= e.world_size)
    throw UserError(fmt::format("environment: rank {} is not below the world size {}", e.rank, e.world_size));
  if (e.local_rank >= e.local_world_size && e.launcher == "torchrun")
    throw UserError(fmt::format("environment: LOCAL_RANK {} is not below LOCAL_WORLD_SIZE {}", e.local_rank,
                                e.local_world_size));
  if (e.world_size > 1) {
    // Under SLURM without MASTER_ADDR / MASTER_PORT (as Detectron2 and Lightning): the first host of
    // the job's node list, and a port derived from the job id so every task of the job agrees.
    const std::string nodelist = e.launcher == "slurm" ? str_var(getenv, "SLURM_JOB_NODELIST", "") : "";
    const char* addr = getenv("MASTER_ADDR");
    if (addr && *addr) e.master_addr = addr;
    else if (!nodelist.empty()) e.master_addr = first_slurm_host(nodelist);
    else
      throw UserError(fmt::format("environment: {} set a world of {} processes but MASTER_ADDR is not set{}",
                                  e.launcher, e.world_size, e.launcher == "slurm" ? " (nor SLURM_JOB_NODELIST)" : ""));
    const bool port_set = getenv("MASTER_PORT") && *getenv("MASTER_PORT");
    const std::string job = str_var(getenv, "SLURM_JOB_ID", "");
    if (!port_set && (e.launcher != "slurm" || job.empty()))
      throw UserError(fmt::format("environment: {} set a world of {} processes but MASTER_PORT is not set",
                                  e.launcher, e.world_size));
    if (port_set) {
      e.master_port = int_var(getenv, "MASTER_PORT", 29500, 1);
    } else {
      const int64_t id = int_var(getenv, "SLURM_JOB_ID", 0, 0);
      e.master_port = 15000 + id % 10000;  // Lightning's rule: the job id's last four digits + 15000
    }
    if (e.master_port > 65535)
      throw UserError(fmt::format("environment variable MASTER_PORT='{}': expected a port (1..65535)",
                                  e.master_port));
  }
  return e;
}

DistEnv read_env() {
  return read_env([](const char* n) -> const char* { return std::getenv(n); });
}

std::string store_prefix(const DistEnv& e) {
  return fmt::format("imgtrain/{}/attempt_{}/", e.run_id, e.restart_count);
}

}  // namespace imgtrain::dist
