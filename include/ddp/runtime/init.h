// init_process_group: the one call a training program makes to join its job.
//
//   auto pg = ddp::init_process_group();        // under ddprun, torchrun, mpirun or srun
//   pg->allreduce(buf, n, ddp::DType::kFloat32, ddp::ReduceOp::kAvg)->wait();
//
// Runs the rendezvous (rendezvous.h: launcher variables, store, deadline), then creates the
// job's default ProcessGroup with the chosen backend and makes it the default group
// (default_process_group()). Backend, first that applies: InitOptions::backend, the environment
// variable DDP_BACKEND, "mpi" when launched by mpirun and the mpi backend was built, else "ring".
// "nccl" (only when chosen) drives CUDA device LOCAL_RANK of each rank; its calls take device
// buffers (ProcessGroup::memory_space()).
//
// "auto" (as PyTorch's "cpu:gloo,cuda:nccl"): the default group is a ring group, for CPU
// tensors; where every rank can drive a GPU of its own with nccl (the nccl backend built,
// libnccl and the CUDA runtime load, device LOCAL_RANK exists), a second, nccl group over the
// same ranks is made for CUDA tensors (default_cuda_process_group()). The ranks agree on it
// through the ring group, so that all or none use nccl; otherwise CUDA tensors take the staged
// path over the ring (host copies) and the reason names the first rank that could not
// (cuda_process_group_absent_reason(); rank 0 prints one line saying which, unless DDP_QUIET).
// The torch layer routes by device when no group is passed: DistributedDataParallel and the
// single-tensor calls of ddp/torch/distributed.h send CUDA tensors to the nccl group. Every rank
// must then pass tensors on the same kind of device (as PyTorch's multi-backend groups demand).
//
// Call it once per process, from one thread. Throws what rendezvous() throws, ConfigError for an
// unknown backend (the message lists the available ones), and CommError when the group's
// connections cannot be set up before the deadline.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ddp/comm/process_group.h"
#include "ddp/launch/rendezvous.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

// The group made by the last init_process_group, or nullptr before it. Thread-safe.
std::shared_ptr<ProcessGroup> default_process_group();
// Forgets the default groups (each is destroyed once nobody else holds it). Thread-safe.
void destroy_process_group();

// Under DDP_BACKEND=auto: the nccl group for CUDA tensors that init_process_group made where every
// rank drives a GPU of its own; nullptr otherwise (and under every other backend). Thread-safe.
std::shared_ptr<ProcessGroup> default_cuda_process_group();
// After init_process_group under auto without a nccl group: why ("1 of 2 ranks cannot use nccl;
// the first, rank 1: <its error>"), else "". Thread-safe.
std::string cuda_process_group_absent_reason();

// Backends built into this library, e.g. {"ring", "mpi", "nccl", "auto"}. ("nccl" when it was
// built: the machine may still lack a GPU or libnccl, which init_process_group then names;
// "auto" always: ring, plus nccl for CUDA tensors where every rank can use it.)
std::vector<std::string> available_backends();

// The backend init_process_group() uses, and the one parser of backend names every tool shares:
// `requested` when non-empty (`source` names where it came from, for the message), else the
// environment variable DDP_BACKEND when set and non-empty, else "mpi" when launched by mpirun
// and the mpi backend was built, else "ring". Throws ConfigError naming the value, where it came
// from and this build's backends when the name is not one of them (unknown names are never
// ignored).
std::string resolve_backend(const std::string& requested = {},
                            const std::string& source = "InitOptions::backend");

}  // namespace ddp
#pragma GCC visibility pop
