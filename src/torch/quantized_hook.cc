#include "ddp/torch/quantized_hook.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/tensor_collectives.h"

namespace ddp {

struct Int8Access {
  static std::unique_lock<std::mutex> lock(Int8QuantizeState& s) {
    return std::unique_lock(s.mutex_);
  }
  static std::uint64_t& bytes(Int8QuantizeState& s) { return s.bytes_sent_; }
  static std::map<std::size_t, torch::Tensor>& error(Int8QuantizeState& s) { return s.error_; }
};

namespace {

constexpr std::int64_t kScaleBytes = sizeof(float);
constexpr const char* kPrefix = "int8/error/";

BucketReduction quantize_reduce(const std::shared_ptr<Int8QuantizeState>& state_ptr,
                                ProcessGroup& group, GradBucket& bucket) {
  Int8QuantizeState& state = *state_ptr;
  torch::NoGradGuard no_grad;
  torch::Tensor input = bucket.buffer;
  if (!input.is_floating_point()) {
    const auto bytes = static_cast<std::size_t>(input.nbytes());
    auto lock = Int8Access::lock(state);
    Int8Access::bytes(state) += bytes;
    return {allreduce_tensor(group, input, ReduceOp::kAvg), {}, bytes};
  }
  const std::size_t index = bucket.index;
  const std::int64_t n = input.numel();
  auto value = input.to(torch::kFloat);  // a copy for float32 buckets too (.to may alias)
  if (value.data_ptr() == input.data_ptr()) value = value.clone();
  const bool feedback = state.options().use_error_feedback;
  if (feedback) {
    auto lock = Int8Access::lock(state);
    auto& errors = Int8Access::error(state);
    auto it = errors.find(index);
    if (it != errors.end()) {
      if (it->second.numel() != n) {
        throw ConfigError(fmt::format(
            "int8_quantize_hook: the state's error memory of gradient bucket {} has {} elements "
            "but the bucket has {}: the state belongs to another model (use one "
            "Int8QuantizeState per DDP model)",
            index, it->second.numel(), n));
      }
      value.add_(it->second);
    }
  }
  float scale = value.abs().max().item<float>() / 127.0f;
  if (scale == 0) scale = 1;  // all zeros; inf/nan gradients stay inf/nan (not hidden)
  const auto quantized = value.div(scale).round_().clamp_(-127, 127);
  if (feedback) {
    auto error = value - quantized * scale;
    auto lock = Int8Access::lock(state);
    Int8Access::error(state)[index] = std::move(error);
  }
  const std::int64_t block = n + kScaleBytes;
  auto send = std::make_shared<torch::Tensor>(torch::empty({block}, torch::kInt8));
  send->narrow(0, 0, n).copy_(quantized.to(torch::kInt8));
  std::memcpy(static_cast<char*>(send->data_ptr()) + n, &scale, kScaleBytes);
  const int world = group.size();
  auto recv = std::make_shared<torch::Tensor>(torch::empty({world * block}, torch::kInt8));
  auto work = group.allgather(send->data_ptr(), recv->data_ptr(), static_cast<std::size_t>(block),
                              DType::kInt8);
  {
    auto lock = Int8Access::lock(state);
    Int8Access::bytes(state) += static_cast<std::size_t>(block);
  }
  auto finish = [send, recv, input, n, block, world]() mutable {
    torch::NoGradGuard no_grad;
    auto sum = torch::zeros({n}, torch::kFloat);
    for (int r = 0; r < world; ++r) {
      float rank_scale = 0;
      std::memcpy(&rank_scale, static_cast<const char*>(recv->data_ptr()) + r * block + n,
                  kScaleBytes);
      sum.add_(recv->narrow(0, r * block, n).to(torch::kFloat), rank_scale);
    }
    input.copy_(sum.div_(world));
  };
  return {std::move(work), std::move(finish), static_cast<std::size_t>(block)};
}

}  // namespace

std::uint64_t Int8QuantizeState::bytes_sent() const {
  std::lock_guard lock(mutex_);
  return bytes_sent_;
}

void Int8QuantizeState::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard lock(mutex_);
  archive.write("int8/bytes_sent", c10::IValue(static_cast<std::int64_t>(bytes_sent_)));
  for (const auto& [index, error] : error_)
    archive.write(fmt::format("{}{}", kPrefix, index), error);
}

void Int8QuantizeState::load(torch::serialize::InputArchive& archive) {
  c10::IValue bytes;
  if (!archive.try_read("int8/bytes_sent", bytes)) {
    throw ConfigError(
        "Int8QuantizeState::load: the archive holds no int8 hook state (no 'int8/bytes_sent'); "
        "save it with Int8QuantizeState::save into the archive you load from");
  }
  std::map<std::size_t, torch::Tensor> errors;
  const std::string prefix = kPrefix;
  for (const auto& key : archive.keys()) {
    if (key.rfind(prefix, 0) != 0) continue;
    torch::Tensor tensor;
    archive.read(key, tensor);
    errors[std::stoul(key.substr(prefix.size()))] = tensor;
  }
  std::lock_guard lock(mutex_);
  bytes_sent_ = static_cast<std::uint64_t>(bytes.toInt());
  error_ = std::move(errors);
}

CommHook int8_quantize_hook(std::shared_ptr<Int8QuantizeState> state) {
  if (!state) {
    throw ConfigError(
        "int8_quantize_hook: the state is null; pass std::make_shared<ddp::Int8QuantizeState>()");
  }
  return [state](ProcessGroup& group, GradBucket& bucket) {
    return quantize_reduce(state, group, bucket);
  };
}

}  // namespace ddp
