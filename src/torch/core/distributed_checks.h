// Argument checks of the tensor-level API (internal): each names the call and the argument, and
// refuse() keeps the other ranks from waiting for a call this rank did not make.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/comm/types.h"
#include "ddp/error.h"

namespace ddp::detail {

// `tensor` can be handed to the engine as it is: defined, dense, on the CPU, of a communicable
// dtype and contiguous. `what` names it, e.g. "all_gather: tensor_list[2]". A CUDA tensor is
// refused (host groups stage CUDA tensors before these checks: host_staging.h) unless
// `device_group` is a CUDA group (nccl) that the call hands device memory directly (the
// single-tensor calls do; the list forms pack on the host and pass null).
void check_tensor(const torch::Tensor& tensor, const std::string& what,
                  ProcessGroup* device_group = nullptr);
// check_tensor for a call on `group` that stages CUDA tensors on a host group (their host copies
// are checked as CPU tensors later) and passes them directly to a CUDA group.
void check_tensor_on(ProcessGroup& group, const torch::Tensor& tensor, const std::string& what);
// check_tensor, and of dtype `want` (the dtype of `reference`, named in the message); with a
// `device_group`, also on `reference`'s device.
void check_tensor_like(const torch::Tensor& tensor, const std::string& what,
                       const torch::Tensor& reference, const std::string& reference_what,
                       ProcessGroup* device_group = nullptr);
// The options of a call that hands `tensor`'s memory to `group`: for a CUDA group, ordered after
// the current stream of the tensor's device (CallOptions::cuda_stream).
CallOptions device_call_options(ProcessGroup& group, const torch::Tensor& tensor,
                                CallOptions options = {});
// `list` has exactly `want` tensors.
void check_list_length(const std::vector<torch::Tensor>& list, std::size_t want,
                       const std::string& what, const std::string& why);
void check_numel(const torch::Tensor& tensor, std::int64_t want, const std::string& what,
                 const std::string& why);

std::size_t element_count(const torch::Tensor& tensor);
DType dtype_of(const torch::Tensor& tensor);

// Runs `check` (local argument checks that may throw ConfigError). When it throws, this rank
// issues a barrier on `group` in place of the refused collective, so that ranks which did make
// the call fail at once on the mismatch instead of waiting for their deadline, waits for that
// barrier (its errors are dropped: they only echo this one), and rethrows the ConfigError.
template <class Check>
void check_collective(ProcessGroup& group, Check&& check) {
  try {
    check();
  } catch (const ConfigError&) {
    try {
      group.barrier()->wait();
    } catch (...) {  // NOLINT: the ConfigError below is the cause
    }
    throw;
  }
}

}  // namespace ddp::detail
