#include "ddp/torch/ddp/hooks/quantized_hook.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"

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
constexpr const char* kErrorStatePrefix = "int8/error/";

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
  if (!input.device().is_cpu()) {
    // Every rank's buckets are on the same kind of device, so every rank refuses here.
    throw ConfigError(fmt::format(
        "int8_quantize_hook: gradient bucket {} is on {}; this hook quantizes host memory (a "
        "host group such as ring stages CUDA buckets through host twins for it). On a CUDA group "
        "(nccl) use fp16_compress_hook, bf16_compress_hook or powersgd_hook",
        bucket.index, input.device().str()));
  }
  const std::size_t index = bucket.index;
  const std::int64_t n = input.numel();
  // Plain loops over float32 (a handful of passes over the bucket, vectorised) instead of tensor
  // expressions, which allocated and walked the bucket a dozen times (755 ms a step on the mlp).
  // Other floating types go through a float32 copy. The bucket is overwritten in finish anyway,
  // so a float32 bucket serves as the working buffer.
  const bool is_float = input.scalar_type() == torch::kFloat;
  torch::Tensor work_values = is_float ? input : input.to(torch::kFloat);
  float* value = work_values.data_ptr<float>();
  const bool feedback = state.options().use_error_feedback;
  float* error = nullptr;
  if (feedback) {
    auto lock = Int8Access::lock(state);
    auto& errors = Int8Access::error(state);
    auto it = errors.find(index);
    if (it == errors.end()) {
      it = errors.emplace(index, torch::zeros({n}, torch::kFloat)).first;
    } else if (it->second.numel() != n || it->second.scalar_type() != torch::kFloat) {
      throw ConfigError(fmt::format(
          "int8_quantize_hook: the state's error memory of gradient bucket {} has {} elements "
          "but the bucket has {}: the state belongs to another model (use one "
          "Int8QuantizeState per DDP model)",
          index, it->second.numel(), n));
    }
    error = it->second.data_ptr<float>();  // this bucket's, touched by this bucket only
  }
  float max_abs = 0;
  if (error != nullptr) {
    for (std::int64_t i = 0; i < n; ++i) {
      value[i] += error[i];
      max_abs = std::max(max_abs, std::abs(value[i]));
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i)
      max_abs = std::max(max_abs, std::abs(value[i]));
  }
  // All zeros: any scale. inf/nan gradients give an inf/nan scale and stay inf/nan (not hidden).
  const float scale = max_abs == 0 ? 1.0f : max_abs / 127.0f;
  const float inverse = 1.0f / scale;
  const std::int64_t block = n + kScaleBytes;
  auto send = std::make_shared<torch::Tensor>(torch::empty({block}, torch::kInt8));
  auto* q = static_cast<std::int8_t*>(send->data_ptr());
  for (std::int64_t i = 0; i < n; ++i) {
    // Round half away from zero; |value| <= 127 * scale, so no clamping is needed.
    const float x = value[i] * inverse;
    const auto rounded = static_cast<std::int32_t>(x + (x >= 0 ? 0.5f : -0.5f));
    q[i] = static_cast<std::int8_t>(rounded);
    if (error != nullptr) error[i] = value[i] - static_cast<float>(rounded) * scale;
  }
  std::memcpy(q + n, &scale, kScaleBytes);
  const int world = group.size();
  auto recv = std::make_shared<torch::Tensor>(torch::empty({world * block}, torch::kInt8));
  auto work = group.allgather(send->data_ptr(), recv->data_ptr(), static_cast<std::size_t>(block),
                              DType::kInt8);
  {
    auto lock = Int8Access::lock(state);
    Int8Access::bytes(state) += static_cast<std::size_t>(block);
  }
  auto finish = [send, recv, input, work_values, n, block, world, is_float]() mutable {
    torch::NoGradGuard no_grad;
    // The same sum in the same rank order on every rank: bit-identical averages.
    float* out = work_values.data_ptr<float>();
    const auto* all = static_cast<const std::int8_t*>(recv->data_ptr());
    for (int r = 0; r < world; ++r) {
      const std::int8_t* rank_q = all + r * block;
      float rank_scale = 0;
      std::memcpy(&rank_scale, rank_q + n, kScaleBytes);
      const float factor = rank_scale / static_cast<float>(world);
      if (r == 0) {
        for (std::int64_t i = 0; i < n; ++i)
          out[i] = static_cast<float>(rank_q[i]) * factor;
      } else {
        for (std::int64_t i = 0; i < n; ++i)
          out[i] += static_cast<float>(rank_q[i]) * factor;
      }
    }
    if (!is_float) input.copy_(work_values);
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
    archive.write(fmt::format("{}{}", kErrorStatePrefix, index), error);
}

void Int8QuantizeState::load(torch::serialize::InputArchive& archive) {
  c10::IValue bytes;
  if (!archive.try_read("int8/bytes_sent", bytes)) {
    throw ConfigError(
        "Int8QuantizeState::load: the archive holds no int8 hook state (no 'int8/bytes_sent'); "
        "save it with Int8QuantizeState::save into the archive you load from");
  }
  std::map<std::size_t, torch::Tensor> errors;
  const std::string prefix = kErrorStatePrefix;
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
