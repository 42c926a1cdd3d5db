// Communication hooks: how DistributedDataParallel reduces one bucket of gradients.
//
// A hook receives the bucket (a flat buffer of one dtype, whose pieces are the gradients of the
// bucket's parameters) and starts its reduction, returning the pending Work and a `finish` step.
// When the Work completes, the reducer runs `finish` on the autograd thread; afterwards
// bucket.buffer must hold the *average* of the ranks' gradients. Hooks run on the autograd thread
// in bucket order, identically on every rank; they must make the same collectives on every rank.
//
//   ddp_model->register_comm_hook(ddp::fp16_compress_hook());
//
// Built-ins: allreduce_hook() (default: in-place allreduce with ReduceOp::kAvg),
// fp16_compress_hook() and bf16_compress_hook() (halve the bytes on the wire: cast to 16 bits,
// average, cast back; lossy, as in PyTorch); powersgd_hook() and batched_powersgd_hook()
// (powersgd_hook.h: low-rank compression with PyTorch's semantics) and int8_quantize_hook()
// (quantized_hook.h: int8 with a per-bucket scale and error feedback); post_local_sgd_hook()
// (local_sgd.h); fp16_compress_wrapper() and bf16_compress_wrapper() run any hook on a 16-bit
// copy. noop_hook() (PyTorch's debugging noop_hook) communicates nothing and leaves each
// rank's own gradients in the bucket: the exception to the rule above, for measuring DDP's step
// without communication (the bound no hook can beat); the ranks' replicas then drift apart.
//
// Bytes: a hook sets BucketReduction::bytes_sent to the payload it hands to collectives for the
// bucket (this rank's input bytes, summed over its collectives); the reducer sums them per
// backward pass (BackwardTimeline::bytes_sent). A hook that leaves it unset is counted as sending
// the bucket's size. A hook that throws fails backward() on its rank with an Error naming the
// bucket, and the reducer refuses every later backward (the ranks are out of step); the other
// ranks fail in that bucket's collective within the group's timeout.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct GradBucket {
  std::size_t index = 0;                 // position in launch order (0 = first reduced)
  torch::Tensor buffer;                  // flat, contiguous; reduce it in place (or via finish)
  std::vector<torch::Tensor> gradients;  // views of buffer, one per parameter, in bucket order
  std::vector<std::string> parameter_names;
  bool is_last = false;  // the last bucket of this backward pass
  // The parameters whose gradients these are (PyTorch's GradBucket.parameters()), in bucket order.
  std::vector<torch::Tensor> parameters;
};

struct BucketReduction {
  std::shared_ptr<Work> work;  // may be null: then nothing is waited for
  // May be empty; runs after work completed successfully, on the autograd thread, in bucket
  // order on every rank. It may make further collectives and wait for them (PowerSGD's second
  // allreduce): that order is the same on every rank. Issuing them from a Work callback
  // (Work::and_then) instead would race with the next bucket's collectives and could pair them
  // differently on different ranks.
  std::function<void()> finish;
  // Payload bytes this rank hands to the collectives of this reduction (see above).
  std::optional<std::size_t> bytes_sent;
};

using CommHook = std::function<BucketReduction(ProcessGroup& group, GradBucket& bucket)>;

CommHook allreduce_hook();
CommHook fp16_compress_hook();
CommHook bf16_compress_hook();
CommHook noop_hook();

// PyTorch's fp16_compress_wrapper(hook) and bf16_compress_wrapper(hook): `hook` runs on a 16-bit
// copy of the bucket (its buffer and gradient views in that dtype), and the bucket gets the
// result, cast back, when the reduction finishes: e.g. fp16_compress_wrapper(powersgd_hook(...))
// compresses what PowerSGD starts from. A bucket already in that dtype goes to `hook` as it is.
// An empty `hook` is a ConfigError.
CommHook fp16_compress_wrapper(CommHook hook);
CommHook bf16_compress_wrapper(CommHook hook);

}  // namespace ddp
#pragma GCC visibility pop
