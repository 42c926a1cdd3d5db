// The environment each ddprun worker starts with: torchrun's contract, so a program written for
// torchrun (or for ddp::init_process_group) runs under ddprun unchanged.
//
//   Environment env = current_environment();
//   apply_worker_variables(env, options, {.local_rank = 1, .restart_count = 0, .master_port = p,
//                                         .cpu_count = usable_cpu_count()});
//
// Pure functions over values: any thread may call them. They throw nothing of their own.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/launch_options.h"
#include "ddprun/round_membership.h"

namespace ddp::ddprun {

using Environment = std::map<std::string, std::string>;

struct WorkerSlot {
  int local_rank = 0;
  int restart_count = 0;
  int master_port = 0;  // the resolved port (never 0)
  int cpu_count = 1;    // CPUs this node may use, shared by its local workers
  // The attempt's --log-dir folder: the workers' DDP_DUMP_DIR unless set ("" = no --log-dir).
  std::string dump_dir;
  // An elastic round's place of this node (round_membership.h); std::nullopt: the static job's
  // (--node-rank of --nnodes, nproc_per_node each).
  std::optional<RoundPlacement> placement;
};

// The variables of this process (environ), as a map.
Environment current_environment();

// Sets the worker variables in `env`, replacing any value inherited from ddprun's own environment
// (a RANK left over in the shell must not leak into a worker), except OMP_NUM_THREADS and
// DDP_DUMP_DIR, which are only set when absent so that a user's choice wins.
void apply_worker_variables(Environment& env, const LaunchOptions& options, const WorkerSlot& slot);

// "KEY=VALUE" strings, for execve.
std::vector<std::string> to_envp_strings(const Environment& env);

}  // namespace ddp::ddprun
