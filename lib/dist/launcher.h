// imgtrain's own launcher (`train --nproc-per-node N`, distributed_train.sh): torchrun's worker
// contract without Python. It hosts the rendezvous store for node 0, starts N copies of this
// binary with RANK / LOCAL_RANK / WORLD_SIZE / ... set, forwards SIGINT and SIGTERM to them, and
// on the first worker failure stops the others and names the failed rank.
// Also the stop request every process honours: SIGINT / SIGTERM set a flag that the trainer reads
// between updates (it writes a recovery checkpoint and exits).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace imgtrain::dist {

struct LaunchOptions {
  int64_t nproc_per_node = 1;
  int64_t nnodes = 1;
  int64_t node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 0;  // 0: a free port (single node only)
  std::string rdzv_id;         // "": node 0's launcher picks one and the other nodes read it
  int64_t rdzv_timeout_s = 600;  // how long the nodes' launchers wait for each other
};

// Runs `argv` (argv[0] is replaced by this executable) as the node's workers; returns the exit
// code for the launcher: 0 when every worker succeeded, else non-zero.
int launch(const LaunchOptions& o, const std::vector<std::string>& argv);

// True when this process was started by a launcher (torchrun, ours, SLURM with several tasks).
bool launched_worker();

// SIGINT / SIGTERM handlers that record the signal instead of killing the process. With
// exit_until_work = true (a training worker) the process still ends at once, with 128 + signal,
// until mark_work_started(): before its first update a worker has nothing to save, and it may be
// blocked joining the group or in a first collective whose peers never come.
void install_stop_handlers(bool exit_until_work = false);
void mark_work_started();
// The signal that asked this process to stop, or 0.
int stop_signal();

}  // namespace imgtrain::dist
