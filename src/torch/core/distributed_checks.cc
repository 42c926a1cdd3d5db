#include "torch/core/distributed_checks.h"

#include <fmt/format.h>

#include "ddp/torch/core/tensor_collectives.h"
#include "torch/core/device_staging.h"

namespace ddp::detail {

namespace {

void check_contiguous(const torch::Tensor& tensor, const std::string& what) {
  if (!tensor.is_contiguous()) {
    throw ConfigError(fmt::format(
        "{} is not contiguous (strides {}); pass tensor.contiguous() and copy the result back",
        what, fmt::join(tensor.strides(), ", ")));
  }
}

}  // namespace

void check_tensor(const torch::Tensor& tensor, const std::string& what,
                  ProcessGroup* device_group) {
  check_collective_tensor(tensor, what);
  const bool direct = device_group != nullptr && device_group->memory_space() == MemorySpace::kCuda;
  if (tensor.is_cuda() && !direct) {
    // Every call stages CUDA tensors before these checks where it cannot take them (host
    // groups; the list forms on a CUDA group): reaching here is a call made without staging.
    throw ConfigError(fmt::format(
        "{} is on {}, which this call cannot take without staging; pass tensor.cpu(), or call "
        "it through the tensor API (ddp/torch/api/distributed.h), which stages CUDA tensors",
        what, tensor.device().str()));
  }
  check_contiguous(tensor, what);
}

void check_tensor_on(ProcessGroup& group, const torch::Tensor& tensor, const std::string& what) {
  if (!(tensor.defined() && tensor.is_cuda() && group.memory_space() == MemorySpace::kHost)) {
    check_tensor(tensor, what, &group);
    return;
  }
  check_collective_tensor(tensor, what);
  check_contiguous(tensor, what);
}

void check_tensor_like(const torch::Tensor& tensor, const std::string& what,
                       const torch::Tensor& reference, const std::string& reference_what,
                       ProcessGroup* device_group) {
  check_tensor(tensor, what, device_group);
  if (device_group != nullptr && tensor.device() != reference.device()) {
    throw ConfigError(fmt::format("{} is on {} but {} is on {}; they must be on one device", what,
                                  tensor.device().str(), reference_what, reference.device().str()));
  }
  if (tensor.scalar_type() != reference.scalar_type()) {
    throw ConfigError(fmt::format("{} has dtype {} but {} has dtype {}; they must match", what,
                                  c10::toString(tensor.scalar_type()), reference_what,
                                  c10::toString(reference.scalar_type())));
  }
}

void check_list_length(const std::vector<torch::Tensor>& list, std::size_t want,
                       const std::string& what, const std::string& why) {
  if (list.size() != want) {
    throw ConfigError(
        fmt::format("{} has {} tensors; it needs {} ({})", what, list.size(), want, why));
  }
}

void check_numel(const torch::Tensor& tensor, std::int64_t want, const std::string& what,
                 const std::string& why) {
  if (tensor.numel() != want) {
    throw ConfigError(fmt::format("{} has {} elements (shape [{}]); it needs {} ({})", what,
                                  tensor.numel(), fmt::join(tensor.sizes(), ", "), want, why));
  }
}

std::size_t element_count(const torch::Tensor& tensor) {
  return static_cast<std::size_t>(tensor.numel());
}

DType dtype_of(const torch::Tensor& tensor) {
  return to_dtype(tensor.scalar_type());
}

CallOptions device_call_options(ProcessGroup& group, const torch::Tensor& tensor,
                                CallOptions options) {
  if (group.memory_space() == MemorySpace::kCuda && tensor.is_cuda())
    options.cuda_stream = current_cuda_stream(tensor.device());
  return options;
}

}  // namespace ddp::detail
