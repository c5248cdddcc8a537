// The worker's place in a data-parallel job, read from the environment the way torchrun, timm
// and SLURM define it. Every launcher (torchrun --no-python, imgtrain's own --nproc-per-node,
// distributed_train.sh, srun) hands a worker the same contract; this is the one reader of it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace imgtrain::dist {

struct DistEnv {
  int64_t rank = 0, world_size = 1;
  int64_t local_rank = 0, local_world_size = 1;
  int64_t group_rank = 0;  // the node's index (torchrun's GROUP_RANK)
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  std::string run_id = "none";  // TORCHELASTIC_RUN_ID
  int64_t restart_count = 0;    // TORCHELASTIC_RESTART_COUNT
  bool use_agent_store = false; // TORCHELASTIC_USE_AGENT_STORE: the launcher hosts the TCPStore
  std::string launcher = "none";  // "torchrun" (RANK/WORLD_SIZE), "slurm", or "none"
  bool distributed() const { return world_size > 1; }
};

using GetEnv = std::function<const char*(const char*)>;

// torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_*), else SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_TASKS_PER_NODE, SLURM_NODEID; MASTER_ADDR / MASTER_PORT when set, else the first host of
// SLURM_JOB_NODELIST and 15000 + the last four digits of SLURM_JOB_ID), else a
// single process. A malformed or inconsistent value is a UserError naming the variable.
DistEnv read_env(const GetEnv& getenv);
DistEnv read_env();

// The first host of a SLURM node list ("gpu[003-005],login1" -> "gpu003").
std::string first_slurm_host(const std::string& nodelist);

// The key prefix of this attempt in the rendezvous store: a restarted group (torchrun
// --max-restarts) never reads the keys of an earlier attempt.
std::string store_prefix(const DistEnv& e);

}  // namespace imgtrain::dist
