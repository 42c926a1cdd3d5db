// Tensor-level helpers over ProcessGroup: the bridge between libtorch tensors and the raw-buffer
// collectives of ddp::comm.
//
//   ddp::broadcast_coalesced(*pg, module->parameters(), /*root=*/0);   // same values everywhere
//
// Tensors must be dense CPU or CUDA tensors. A CUDA tensor on a group of host memory (ring, mpi)
// is staged: copied to the host (after the work queued on the current stream), reduced there, and
// copied back before wait() returns, in place as for a CPU tensor; on a CUDA group (nccl) it goes
// in directly, ordered after the current stream. Calls are collective: every rank of the group
// makes the same calls with tensors of the same shapes and dtypes, in the same order.
// Thread-safety as for ProcessGroup. Throws ConfigError for tensors ddp cannot move (sparse, on
// another device such as meta, complex, bool; a CPU tensor on a CUDA group), and whatever
// Work::wait throws (CommError, TimeoutError).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// The collective element type of a tensor's dtype; ConfigError for unsupported dtypes.
DType to_dtype(c10::ScalarType type);

// Checks that `tensor` can be handed to the helpers below (dense, CPU or CUDA, supported dtype);
// `what` names it in the error.
void check_collective_tensor(const torch::Tensor& tensor, const std::string& what);

// Starts an in-place allreduce of a contiguous tensor; the tensor must outlive the Work. For a
// CUDA tensor on a host group the Work is a chain (Work::and_then) whose last step copies the
// result back to the device; its wait() throws that copy's error too.
std::shared_ptr<Work> allreduce_tensor(ProcessGroup& group, torch::Tensor& tensor, ReduceOp op);

// Broadcasts `tensors` from `root` in place, packing tensors of one dtype into flat buffers of at
// most `buffer_bytes` so that many small tensors cost few collectives. Waits for completion.
void broadcast_coalesced(ProcessGroup& group, std::vector<torch::Tensor> tensors, int root,
                         std::size_t buffer_bytes = std::size_t{64} << 20);

}  // namespace ddp
#pragma GCC visibility pop
