// The `nccl` backend: ddp::ProcessGroup over NVIDIA's NCCL, for buffers in CUDA device memory.
//
// Every rank drives its own GPU (NCCL refuses two ranks on one device). The buffers a call names
// are device pointers on that device (memory_space() == MemorySpace::kCuda); a call is ordered
// after the work queued so far on CallOptions::cuda_stream (captured when the call is made) and
// runs on the group's own communication stream; its Work completes once the device finished it.
// As with the other backends, calls return a Work at once and run one at a time in issue order,
// and each call's fingerprint is compared across ranks before its data moves (a mismatch is a
// CommError of kind kMismatch naming both calls).
//
//   auto pg = ddp::make_nccl_process_group(store, rank, world, {.device = local_rank});
//   pg->allreduce(device_grads, n, ddp::DType::kFloat32, ddp::ReduceOp::kAvg,
//                 {.cuda_stream = current_stream})->wait();
//
// libnccl (libnccl.so.2, or the path in NcclOptions::library / DDP_NCCL_LIBRARY) and the CUDA
// runtime (libcudart.so.13, .12, or libcudart.so) are loaded when the first group is made, not at
// link time: a process that already loaded them (PyTorch) shares its copy. make_nccl_process_group
// blocks until every rank joined the communicator (bounded by the timeout).
//
// Errors: ConfigError when this ddp was built without NCCL headers, a library or one of its
// functions is missing, this process sees no CUDA device, or the device is beyond the count.
// CommError (kTimeout) when a peer does not arrive before the timeout: the communicator is then
// aborted, so nothing hangs. A call that misses its deadline aborts the communicator and fails with
// kTimeout; NCCL's own errors (a peer's failure included) map to the kinds in nccl_errors.h.
// After the first failure the group is poisoned, as every backend's.
//
// Point to point: NCCL matches a send and a recv by their order between two ranks (tags are not
// used for matching: the tag and the count travel with the data and are checked on arrival). A
// send larger than NCCL's buffers waits on the device until the peer posts its recv; sends and
// receives run in posting order on a communicator of their own, so a cycle in which every rank
// posts a large send before its recv stalls until the deadline. Use allgather/alltoall for
// exchanges among all ranks.
//
// Timeout precedence (first that applies): CallOptions::timeout; NcclOptions::timeout when
// non-zero; DDP_TIMEOUT (seconds); 300 s. The same timeout bounds the communicator's set-up.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "ddp/comm/process_group.h"
#include "ddp/store/store.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct NcclOptions {
  // 0 = DDP_TIMEOUT if set, else kDefaultTimeout (300 s). See the precedence above.
  std::chrono::milliseconds timeout{0};
  // Names the group in store keys and error messages; subgroups are named "<name>/sub<k>".
  std::string group_name = "default";
  // The CUDA device this rank uses (made current on the calling thread); -1 = the calling
  // thread's current device.
  int device = -1;
  // The libnccl to load; "" = DDP_NCCL_LIBRARY if set, else libnccl.so.2 (the loader's search,
  // then the folder beside the headers ddp was built with). One NCCL per process: once loaded,
  // later groups use that one.
  std::string library;
};

// A group of `size` ranks meeting through `store` (keys under "nccl/<group_name>/").
std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, NcclOptions options = {});

// What make_nccl_process_group checks on this rank before it meets the others: loads libnccl and
// the CUDA runtime and makes options.device current after checking it exists (ConfigError as
// above). init_process_group calls it before the rendezvous, so that a rank without a GPU or
// libnccl fails at once rather than after waiting for its peers. Returns the device.
int prepare_nccl_device(const NcclOptions& options);

// Whether this build of ddp has the nccl backend (false: make_nccl_process_group throws, saying
// why). True does not mean this machine has a GPU or libnccl: that shows when a group is made.
bool nccl_backend_available();
// Why this build lacks it (no NCCL headers at configure time, or DDP_WITH_NCCL=OFF); "" when
// nccl_backend_available().
const char* nccl_backend_unavailable_reason();

}  // namespace ddp
#pragma GCC visibility pop
