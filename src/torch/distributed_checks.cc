#include "torch/distributed_checks.h"

#include <fmt/format.h>

#include "ddp/torch/tensor_collectives.h"

namespace ddp::detail {

void check_tensor(const torch::Tensor& tensor, const std::string& what) {
  check_collective_tensor(tensor, what);
  if (tensor.is_cuda()) {
    // These calls hand the engine the tensor's memory itself; staging them is issue 25's next step.
    throw ConfigError(fmt::format(
        "{} is on {}; this call does not take CUDA tensors yet (issue 25: only allreduce_tensor, "
        "broadcast_coalesced and DistributedDataParallel do). Pass tensor.cpu() and copy the "
        "result back",
        what, tensor.device().str()));
  }
  if (!tensor.is_contiguous()) {
    throw ConfigError(fmt::format(
        "{} is not contiguous (strides {}); pass tensor.contiguous() and copy the result back",
        what, fmt::join(tensor.strides(), ", ")));
  }
}

void check_tensor_like(const torch::Tensor& tensor, const std::string& what,
                       const torch::Tensor& reference, const std::string& reference_what) {
  check_tensor(tensor, what);
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

}  // namespace ddp::detail
