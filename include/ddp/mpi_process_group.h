// The `mpi` backend: ddp::ProcessGroup over MPI (OpenMPI 4.1), for jobs launched with mpirun/srun.
//
// Collectives map onto MPI's non-blocking collectives (MPI_Iallreduce, MPI_Ibcast, ...) on a
// private duplicate of MPI_COMM_WORLD. As with the ring backend, every call returns a Work at once
// and the operations of a group run one at a time, in issue order, on the group's worker thread
// (or on a thread waiting in Work::wait, see work.h), polling MPI_Test against the call's
// deadline. float16/bfloat16 reductions use user-defined MPI operations over the engine's
// reduction kernels (reduced in float32, rounded to nearest even). Any thread may call any method
// (new_group: see process_group.h).
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
// (MPI counts are int). CommError (from Work::wait) when a call fails inside MPI or misses its
// deadline; the group is then poisoned (every pending and later call fails at once with that
// error). MPI cannot cancel a collective: after a timeout the abandoned request stays posted, and
// MPI may still write its receive buffer if the late peers arrive, so keep those buffers alive or
// end the process. Unlike the ring backend, ranks that issue different collectives are not detected
// (MPI's behaviour is undefined; usually the call times out).
//
// Timeout precedence (first that applies): CallOptions::timeout of the call; MpiOptions::timeout
// when non-zero; the DDP_TIMEOUT environment variable (seconds, may be fractional); 300 s.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ddp/process_group.h"

namespace ddp {

struct MpiOptions {
  // 0 = DDP_TIMEOUT if set, else kDefaultTimeout (300 s). See the precedence above.
  std::chrono::milliseconds timeout{0};
  // Names the group in error messages; subgroups are named "<name>/sub<k>".
  std::string group_name = "default";
};

// A group of every process of MPI_COMM_WORLD (rank and size are MPI's).
std::shared_ptr<ProcessGroup> make_mpi_process_group(MpiOptions options = {});

// Whether this build of ddp has the mpi backend (false: make_mpi_process_group throws).
bool mpi_backend_available();

}  // namespace ddp
