// LaunchEnvironment: who this process is in the job, as its launcher described it.
//
// Reads the variables of whichever launcher started the process, in this order of precedence:
//   1. explicit values in LaunchOptions (always win, field by field);
//   2. ddprun / torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
//   3. OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE;
//   4. SLURM's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE or
//      SLURM_TASKS_PER_NODE, SLURM_NNODES.
// With none of them set, the process is a job of one (rank 0 of 1, any free port).
// MASTER_ADDR/MASTER_PORT come from the environment under every launcher; when a one-node job
// leaves them unset, 127.0.0.1 and 29500 are used. A multi-node mpirun/srun job must export them.
// The job's secret (DDP_SECRET / DDP_SECRET_FILE, see job_secret.h) and the address rank 0's
// store listens on (DDP_STORE_LISTEN_ADDR, default: MASTER_ADDR's interface only) are resolved
// here too, so that nothing below reads the environment.
//
// Throws ConfigError naming the variable and the fix: a missing or non-numeric value, a rank
// outside the world, a world size of 0, a port outside 0..65535, a bad secret (job_secret.h).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct LaunchOptions {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
  // The job's shared secret (wins over DDP_SECRET / DDP_SECRET_FILE); must not be empty.
  std::optional<std::string> secret;
  // Address rank 0's store listens on (wins over DDP_STORE_LISTEN_ADDR): "0.0.0.0" = every IPv4
  // address, "::" = every address. Default: master_addr.
  std::optional<std::string> store_listen_addr;
};

struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  // "" = no secret: the store and the data plane are unauthenticated (trusted network only).
  // Never print it.
  std::string secret;
  // Where rank 0's store listens when asked (options / DDP_STORE_LISTEN_ADDR); unset = the
  // interface of master_addr (rendezvous.h says how).
  std::optional<std::string> store_listen_addr;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT, 0 when not restarted
  std::string launcher;   // "ddprun/torchrun", "mpirun", "srun", "options" or "none"
};

// Looks up one environment variable; std::nullopt when unset. The default reads the process
// environment; tests pass a map.
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;
std::optional<std::string> process_environment(const std::string& name);

LaunchEnvironment resolve_launch_environment(const LaunchOptions& options = {},
                                             const EnvironmentLookup& lookup = process_environment);

}  // namespace ddp
#pragma GCC visibility pop
