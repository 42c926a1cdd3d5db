#include "ddp/torch/ddp/hooks/comm_hooks.h"

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"

namespace ddp {
namespace {

// Casts the bucket to `wire_type`, averages it over the group, and casts back in `finish`.
CommHook compress_hook(c10::ScalarType wire_type) {
  return [wire_type](ProcessGroup& group, GradBucket& bucket) -> BucketReduction {
    if (bucket.buffer.scalar_type() == wire_type) {
      return {allreduce_tensor(group, bucket.buffer, ReduceOp::kAvg), {}, bucket.buffer.nbytes()};
    }
    auto compressed = std::make_shared<torch::Tensor>(bucket.buffer.to(wire_type));
    auto work = allreduce_tensor(group, *compressed, ReduceOp::kAvg);
    torch::Tensor target = bucket.buffer;
    return {std::move(work), [compressed, target]() mutable { target.copy_(*compressed); },
            compressed->nbytes()};
  };
}

// `inner` over a copy of the bucket in `wire_type`; the result cast back after its finish step.
CommHook compress_wrapper(c10::ScalarType wire_type, CommHook inner, const char* name) {
  if (!inner) throw ConfigError(fmt::format("{}: the hook to wrap is empty", name));
  return [wire_type, inner = std::move(inner)](ProcessGroup& group,
                                               GradBucket& bucket) -> BucketReduction {
    if (bucket.buffer.scalar_type() == wire_type) return inner(group, bucket);
    // Owned by the finish step: the inner hook may keep references to it until then.
    auto compressed = std::make_shared<GradBucket>();
    compressed->index = bucket.index;
    compressed->buffer = bucket.buffer.to(wire_type);
    compressed->parameter_names = bucket.parameter_names;
    compressed->is_last = bucket.is_last;
    std::int64_t offset = 0;
    for (const auto& gradient : bucket.gradients) {
      compressed->gradients.push_back(
          compressed->buffer.narrow(0, offset, gradient.numel()).view(gradient.sizes()));
      offset += gradient.numel();
    }
    BucketReduction reduction = inner(group, *compressed);
    reduction.bytes_sent =
        reduction.bytes_sent.value_or(static_cast<std::size_t>(compressed->buffer.nbytes()));
    reduction.finish = [compressed, target = bucket.buffer,
                        inner_finish = std::move(reduction.finish)]() mutable {
      if (inner_finish) inner_finish();
      torch::NoGradGuard no_grad;
      target.copy_(compressed->buffer);
    };
    return reduction;
  };
}

}  // namespace

CommHook fp16_compress_wrapper(CommHook hook) {
  return compress_wrapper(torch::kHalf, std::move(hook), "fp16_compress_wrapper");
}

CommHook bf16_compress_wrapper(CommHook hook) {
  return compress_wrapper(torch::kBFloat16, std::move(hook), "bf16_compress_wrapper");
}

CommHook allreduce_hook() {
  return [](ProcessGroup& group, GradBucket& bucket) -> BucketReduction {
    return {allreduce_tensor(group, bucket.buffer, ReduceOp::kAvg), {}, bucket.buffer.nbytes()};
  };
}

CommHook fp16_compress_hook() {
  return compress_hook(torch::kHalf);
}

CommHook bf16_compress_hook() {
  return compress_hook(torch::kBFloat16);
}

CommHook noop_hook() {
  return [](ProcessGroup&, GradBucket&) -> BucketReduction { return {nullptr, {}, 0}; };
}

}  // namespace ddp
