// The `mpi` backend: ddp::ProcessGroup over MPI (OpenMPI 4.1), for jobs launched with mpirun/srun.
//
// Collectives map onto MPI's collectives on private duplicates of MPI_COMM_WORLD: allreduce and
// barrier onto blocking MPI_Allreduce calls watched by a per-group watchdog (with
// abort_on_failure, the default), the others onto non-blocking ones (MPI_Ibcast, ...) polled
// with MPI_Test against the call's deadline (docs/mpi.md). As with the ring backend, every call
// returns a Work at once and the operations of a group run one at a time, in issue order, on the
// group's worker thread (or on a thread waiting in Work::wait, see work.h). float16/bfloat16
// reductions use user-defined MPI operations over the engine's reduction kernels (reduced in
// float32, rounded to nearest even). Any thread may call any method (new_group: see
// process_group.h).
//
//   auto pg = ddp::make_mpi_process_group();              // under mpirun -np N ./train
//   pg->allreduce(grads.data(), grads.size(), ddp::DType::kFloat32, ddp::ReduceOp::kAvg)->wait();
//
// make_mpi_process_group initialises MPI (MPI_Init_thread, MPI_THREAD_MULTIPLE) when the program
// has not, and then finalises it at process exit; a program that initialised MPI itself must ask
// for MPI_THREAD_MULTIPLE (or SERIALIZED: ddp then serialises its own MPI calls) and finalise it.
// It blocks until every rank has called it (bounded by the timeout). Call it from one thread.
//
// Errors: ConfigError for bad arguments, a program built without MPI (DDP_HAVE_MPI undefined),
// an MPI initialised with too little thread support, or counts above INT_MAX elements per call
// (MPI counts are int). A call that fails inside MPI, misses its deadline, or that the ranks
// issued differently (another op, count, dtype, root or reduce op, or a rank that skipped it: each
// collective's fingerprint is compared across ranks alongside it, and the message names every
// call) poisons the group. By default (MpiOptions::abort_on_failure) the rank then prints the
// error and ends the whole job with MPI_Abort, since MPI cannot tell its peers otherwise; with it
// off, Work::wait throws the CommError, every pending and later call fails at once with it, and the
// peers learn it when their own calls stall. MPI cannot cancel a collective: after a failure the
// abandoned request stays posted, and MPI may still write its receive buffer if the late peers
// arrive, so keep those buffers alive or end the process.
//
// Failing fast (docs/mpi.md): once MPI is up, a rank that calls std::terminate (an uncaught
// exception, in any thread) or exits with a non-zero status before MPI_Finalize ends every rank
// of the job with MPI_Abort, printing its rank and the reason.
//
// Timeout precedence (first that applies): CallOptions::timeout of the call; MpiOptions::timeout
// when non-zero; the DDP_TIMEOUT environment variable (seconds, may be fractional); 300 s.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct MpiOptions {
  // 0 = DDP_TIMEOUT if set, else kDefaultTimeout (300 s). See the precedence above.
  std::chrono::milliseconds timeout{0};
  // Names the group in error messages; subgroups are named "<name>/sub<k>".
  std::string group_name = "default";
  // On the first failure of the group (see above), MPI_Abort the whole job after printing the
  // error, rather than throw it to this rank only (its peers would wait for their deadlines).
  bool abort_on_failure = true;
  // A call still running after this long looks for notices from its peers (a peer that failed, or
  // left the group without issuing this call) and fails at once naming them. Subgroups inherit
  // all options.
  std::chrono::milliseconds stall_check_after{1000};
};

// A group of every process of MPI_COMM_WORLD (rank and size are MPI's).
std::shared_ptr<ProcessGroup> make_mpi_process_group(MpiOptions options = {});

// Whether this build of ddp has the mpi backend (false: make_mpi_process_group throws).
bool mpi_backend_available();

}  // namespace ddp
#pragma GCC visibility pop
