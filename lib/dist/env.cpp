#include "dist/env.h"

#include "core/error.h"

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

}  // namespace

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
    e.local_world_size = int_var(getenv, "SLURM_NTASKS_PER_NODE", 1, 1);
    e.group_rank = int_var(getenv, "SLURM_NODEID", 0, 0);
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
    const char* addr = getenv("MASTER_ADDR");
    if (!addr || !*addr)
      throw UserError(fmt::format("environment: {} set a world of {} processes but MASTER_ADDR is not set",
                                  e.launcher, e.world_size));
    e.master_addr = addr;
    if (!getenv("MASTER_PORT") || !*getenv("MASTER_PORT"))
      throw UserError(fmt::format("environment: {} set a world of {} processes but MASTER_PORT is not set",
                                  e.launcher, e.world_size));
    e.master_port = int_var(getenv, "MASTER_PORT", 29500, 1);
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
