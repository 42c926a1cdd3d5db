// The ddprun supervisor: starts the local workers, relays their output line by line, watches them,
// and stops all of them when one fails or when ddprun is asked to stop.
//
//   LaunchOptions options = *parse_command_line(args, std::cout);
//   return run_workers(options);  // ddprun's exit code
//
// How it works: one event loop (poll) over every worker's stdout and stderr pipe plus a signalfd
// for SIGCHLD, SIGINT, SIGTERM and SIGHUP; no thread per worker. Each worker leads its own process
// session and group (setsid: the kernel's autogroup scheduler then gives it a session's share of
// the CPU, as torchrun's workers get), so stopping a worker stops whatever it started; ddprun is
// also a child subreaper, so processes that escape their group are reparented to ddprun and
// stopped too. Workers get PR_SET_PDEATHSIG=SIGKILL (ddprun forks from the calling thread, which
// must live as long as the job: the main thread), so none outlives a ddprun killed outright.
// Worker exit is judged by waitpid, output by the pipes: a worker that closes its stdout keeps
// being supervised.
//
// Blame: the rank named when a job fails is the cause, not merely the first reaped: a death by a
// signal other than SIGABRT/SIGPIPE beats an exit code (a rank whose peer died exits with an
// error, and may be reaped first); see docs/ddprun.md.
//
// Restarts (--max-restarts K): the local workers are started again after a failure; with
// --nnodes > 1 every node's ddprun restarts together through restart rounds in a store that node
// 0's ddprun serves on --agent-port (restart_round.h, docs/ddprun.md "Whole-job restarts").
// Elastic jobs (--nnodes MIN:MAX) run rounds whose members agent 0 decides (round_membership.h):
// a node that leaves fails the round, one that arrives moves the job to the next round without
// costing a restart, and each round's workers get that round's ranks and world size.
//
// Once a worker exited with 0, the others get options.timeout (DDP_TIMEOUT) to exit too; one still
// running then is named and stopped as a failed rank (a stopped process gets SIGCONT after each
// request to stop, so that its handler runs).
//
// Exit codes: 0 when every worker exited with 0; 1 when a worker failed (after --max-restarts
// restarts), was still running DDP_TIMEOUT after another finished, or could not be started;
// 128+N when ddprun received signal N (130 for SIGINT).
//
// run_workers blocks SIGCHLD/SIGINT/SIGTERM/SIGHUP and ignores SIGPIPE in the calling process
// (workers get the original settings back), so call it from the main thread of a process that
// runs nothing else, once. It throws ddp::Error when the kernel refuses a pipe, fork or signalfd,
// or when no free port can be had for --master-port 0, and ddp::Error when the restart-round
// store fails (a node missing at the join deadline, node 0's ddprun gone); the workers are
// killed first.
#pragma once

#include <string>

#include "ddprun/launch_options.h"

namespace ddp::ddprun {

// Exit code when a worker failed or could not be started.
inline constexpr int kWorkerFailedExitCode = 1;

int run_workers(const LaunchOptions& options);

// How a process ended, from a waitpid status: "exited with code 3",
// "was killed by signal 9 (Killed)".
std::string describe_wait_status(int wait_status);

}  // namespace ddp::ddprun
