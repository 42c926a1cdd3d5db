#include "ddp/torch/comm_hooks.h"

#include "ddp/torch/tensor_collectives.h"

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

}  // namespace

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
