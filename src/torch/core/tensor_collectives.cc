#include "ddp/torch/core/tensor_collectives.h"

#include <fmt/format.h>

#include <map>

#include <torch/csrc/utils/tensor_flatten.h>

#include "ddp/error.h"
#include "torch/core/device_staging.h"
#include "torch/core/host_values.h"

namespace ddp {

DType to_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float:
      return DType::kFloat32;
    case c10::ScalarType::Double:
      return DType::kFloat64;
    case c10::ScalarType::Half:
      return DType::kFloat16;
    case c10::ScalarType::BFloat16:
      return DType::kBFloat16;
    case c10::ScalarType::Char:
      return DType::kInt8;
    case c10::ScalarType::Byte:
      return DType::kUInt8;
    case c10::ScalarType::Int:
      return DType::kInt32;
    case c10::ScalarType::Long:
      return DType::kInt64;
    default:
      throw ConfigError(fmt::format(
          "tensors of dtype {} cannot be communicated; use float32/64, float16, bfloat16, "
          "int8/uint8, int32 or int64",
          c10::toString(type)));
  }
}

void check_collective_tensor(const torch::Tensor& tensor, const std::string& what) {
  if (!tensor.defined()) throw ConfigError(fmt::format("{} is an undefined tensor", what));
  if (tensor.is_sparse() || tensor.layout() != torch::kStrided) {
    throw ConfigError(fmt::format("{} is not a dense tensor; ddp moves dense tensors only", what));
  }
  if (!tensor.device().is_cpu() && !tensor.device().is_cuda()) {
    throw ConfigError(fmt::format("{} is on {}; ddp moves CPU and CUDA tensors only", what,
                                  tensor.device().str()));
  }
  to_dtype(tensor.scalar_type());
}

namespace {

// What the engine reads and writes for `tensor`: the tensor itself where the group can read its
// memory (with the current stream for a CUDA group), else a host copy of it (`staged`), whose
// result the caller copies back into the tensor.
struct EngineBuffer {
  torch::Tensor buffer;
  CallOptions options;
  bool staged = false;
};

EngineBuffer engine_buffer(ProcessGroup& group, const torch::Tensor& tensor,
                           const std::string& what) {
  const bool cuda_group = group.memory_space() == MemorySpace::kCuda;
  if (cuda_group && !detail::takes_as_is(group, tensor.device())) {
    throw ConfigError(fmt::format(
        "{} is on {}, but the process group ({}) takes CUDA memory only; move it to this "
        "process's GPU (tensor.to(torch::kCUDA)) or use a host group (ring, mpi)",
        what, tensor.device().str(), group.backend()));
  }
  if (cuda_group) {
    return {tensor, tensor.is_cuda()
                        ? CallOptions{.cuda_stream = detail::current_cuda_stream(tensor.device())}
                        : CallOptions{}};
  }
  if (!tensor.is_cuda()) return {tensor, {}};
  // A host group: through host memory. The copy waits for the work queued on the current stream
  // (a synchronous device-to-host copy), so the values are the ones the caller sees.
  torch::NoGradGuard no_grad;
  return {tensor.to(torch::kCPU), {}, true};
}

}  // namespace

std::shared_ptr<Work> allreduce_tensor(ProcessGroup& group, torch::Tensor& tensor, ReduceOp op) {
  check_collective_tensor(tensor, "the allreduce tensor");
  if (!tensor.is_contiguous()) throw ConfigError("allreduce_tensor needs a contiguous tensor");
  auto engine = engine_buffer(group, tensor, "the allreduce tensor");
  auto work = group.allreduce(engine.buffer.data_ptr(), static_cast<std::size_t>(tensor.numel()),
                              to_dtype(tensor.scalar_type()), op, engine.options);
  if (engine.staged) {
    // Back to the device as the chain's last step, so that wait() returns after it and throws
    // its error. The copy is synchronous, so the caller's stream sees the result. It issues no
    // collective, so chaining it cannot reorder collectives between ranks.
    return work->and_then(
        [host = engine.buffer, target = tensor](Work&) mutable -> std::shared_ptr<Work> {
          torch::NoGradGuard no_grad;
          target.copy_(host);
          return nullptr;
        });
  }
  return work;
}

void broadcast_coalesced(ProcessGroup& group, std::vector<torch::Tensor> tensors, int root,
                         std::size_t buffer_bytes) {
  torch::NoGradGuard no_grad;
  // Group by dtype, keeping the order within a dtype (identical on every rank).
  std::map<c10::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    check_collective_tensor(tensors[i], fmt::format("tensor {} of the broadcast", i));
    by_dtype[tensors[i].scalar_type()].push_back(tensors[i]);
  }
  for (auto& [type, list] : by_dtype) {
    const auto element_bytes = c10::elementSize(type);
    std::size_t start = 0;
    while (start < list.size()) {
      std::size_t end = start;
      std::size_t bytes = 0;
      do {
        bytes += static_cast<std::size_t>(list[end].numel()) * element_bytes;
        ++end;
      } while (end < list.size() &&
               bytes + static_cast<std::size_t>(list[end].numel()) * element_bytes <= buffer_bytes);
      const std::vector<torch::Tensor> chunk(list.begin() + static_cast<std::ptrdiff_t>(start),
                                             list.begin() + static_cast<std::ptrdiff_t>(end));
      torch::Tensor flat = torch::utils::flatten_dense_tensors(chunk);
      const auto engine = engine_buffer(group, flat, "the broadcast buffer");
      group
          .broadcast(engine.buffer.data_ptr(), static_cast<std::size_t>(flat.numel()),
                     to_dtype(type), root, engine.options)
          ->wait();
      if (engine.staged) flat.copy_(engine.buffer);
      if (group.rank() != root) {
        const auto pieces = torch::utils::unflatten_dense_tensors(flat, chunk);
        for (std::size_t i = 0; i < chunk.size(); ++i) {
          torch::Tensor target = chunk[i];
          target.copy_(pieces[i]);
        }
      }
      start = end;
    }
  }
}

}  // namespace ddp
