// LaunchOptions: what `ddprun` was asked to do, parsed and checked before anything is started.
//
//   std::optional<LaunchOptions> options = parse_command_line(args, std::cout);
//   if (!options) return 0;  // --help was printed
//
// parse_command_line follows torchrun's option names (both --nproc-per-node and --nproc_per_node
// spellings are accepted). Everything from PROGRAM on is passed to the workers untouched. Plain
// functions without shared state: any thread may call them.
//
// Errors: UsageError (a ConfigError) whose message names the option or program that was wrong;
// ddprun prints it on one line and exits with kUsageExitCode.
#pragma once

#include <chrono>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "ddprun/log_dir.h"
#include "ddprun/output_routing.h"

namespace ddp::ddprun {

// Exit code for bad command lines (the shell convention for usage errors).
inline constexpr int kUsageExitCode = 2;

class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

struct LaunchOptions {
  int nproc_per_node = 1;
  // --nnodes N or MIN:MAX: nnodes is MAX (the node count of a static job), min_nnodes MIN.
  int nnodes = 1;
  int min_nnodes = 1;
  // Static jobs: this node's index. Elastic jobs (min_nnodes < nnodes): 0 for the agent that
  // serves the rendezvous (--node-rank 0), -1 for every other (its rank is assigned per round).
  int node_rank = 0;
  // --rdzv-last-call: an elastic round closes this long after its last newcomer once
  // min_nnodes agents are in (round_membership.h, restart_round.h).
  std::chrono::milliseconds rdzv_last_call{3000};
  std::string master_addr = "127.0.0.1";
  // 0 means "pick a free port" (also what --standalone asks for); see resolve_master_port.
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  // Port on --master-addr of the store that node 0's ddprun serves to every node's ddprun to
  // restart the whole job together (restart_round.h); used with --nnodes > 1 and
  // --max-restarts > 0. 0 = --master-port + 1.
  int agent_port = 0;
  // --agent-listen-addr: where node 0's ddprun listens for the restart rounds; unset: as the
  // workers' store (DDP_STORE_LISTEN_ADDR, else --master-addr's interface), see
  // agent_listen_host in launcher.cc.
  std::optional<std::string> agent_listen_addr;
  // Add the variables of env_tuning.h to the workers' environment (--no-env-tuning: don't).
  bool env_tuning = true;
  // Put "[rank] " in front of each line on the console (--no-prefix: pass the bytes through as
  // written, still in whole lines, so machine-readable output survives).
  bool prefix_output = true;
  // --log-dir: the workers' output files (disabled when not given); see log_dir.h.
  LogDir log_dir;
  // --redirects, --tee, --local-ranks-filter: which streams reach the console (one entry per
  // local rank); see output_routing.h.
  OutputRouting output;
  // --rdzv-id: the job's run id (TORCHELASTIC_RUN_ID, and the folder under --log-dir).
  std::string run_id = "none";
  // DDP_TIMEOUT (checked by the library's own parser, ddp::resolve_timeout), else
  // kDefaultTimeout: how long the restart rounds wait for nodes to join, and how long the other
  // workers may still run once one exited with 0 (docs/ddprun.md, "Exit codes").
  std::chrono::milliseconds timeout = kDefaultTimeout;
  // How long stopping workers get between SIGTERM (or the forwarded signal) and SIGKILL.
  std::chrono::milliseconds grace_period{5000};
  // --secret-file: absolute path of a file holding the job's secret (checked when parsed). The
  // workers get DDP_SECRET_FILE=<this path>, never the secret itself, on no command line and in
  // no environment (docs/security.md); "" = the workers inherit ddprun's DDP_SECRET(_FILE).
  std::string secret_file;
  std::string program;            // as the user wrote it; becomes the workers' argv[0]
  std::string program_path;       // where it was found (PATH lookup done), used for exec
  std::vector<std::string> args;  // the workers' argv[1..]

  // Nodes may join and leave between rounds (--nnodes MIN:MAX with MIN < MAX).
  bool elastic() const { return min_nnodes != nnodes; }
  // This ddprun serves the restart rounds' store (node 0 of a static job, --node-rank 0 of an
  // elastic one).
  bool serves_rounds() const { return node_rank == 0; }
  // A static job's world (an elastic job's comes from each round, round_membership.h).
  int world_size() const { return nnodes * nproc_per_node; }
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
};

// Parses ddprun's arguments (without argv[0]). Returns std::nullopt after printing help to
// `help_out`. Resolves the program on PATH. Throws UsageError.
std::optional<LaunchOptions> parse_command_line(const std::vector<std::string>& args,
                                                std::ostream& help_out);

// Finds `program` the way execvp would: a name containing '/' is used as is, any other name is
// looked up in `path_env` (PATH). Throws UsageError when it is missing or not an executable file.
std::string resolve_program(const std::string& program, const char* path_env);

// Number of CPUs this process may run on (its affinity mask), at least 1.
int usable_cpu_count();

}  // namespace ddp::ddprun
