// C10dBackend: each ddp collective as the c10d call of the same kind (c10d_backend.h).
#include "torch/c10d/c10d_backend.h"

#include <cstring>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::torch_c10d {
namespace {

using Clock = std::chrono::steady_clock;

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:  // a sum, divided by the group size afterwards (divide_for_avg)
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kProduct:
      return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kBand:
      return c10d::ReduceOp::BAND;
    case ReduceOp::kBor:
      return c10d::ReduceOp::BOR;
    case ReduceOp::kBxor:
      return c10d::ReduceOp::BXOR;
  }
  throw ConfigError(fmt::format("c10d: reduce op {} is unknown", static_cast<int>(op)));
}

// ReduceOp::kAvg's division, as ddp's own kernels do it: integers truncate.
void divide_for_avg(at::Tensor& result, int size) {
  if (c10::isIntegralType(result.scalar_type(), /*includeBool=*/false)) {
    result.div_(size, "trunc");
  } else {
    result.div_(size);
  }
}

// Block `r` (of `count` elements) of a buffer of blocks.
const void* block(const void* base, std::size_t r, std::size_t count, DType dtype) {
  return static_cast<const std::byte*>(base) + r * count * dtype_size(dtype);
}

std::vector<at::Tensor> blocks(const void* base, int size, std::size_t count, DType dtype) {
  std::vector<at::Tensor> result;
  result.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    result.push_back(alias(block(base, static_cast<std::size_t>(r), count, dtype), count, dtype));
  }
  return result;
}

}  // namespace

c10::ScalarType scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kInt8:
      return at::kChar;
    case DType::kUInt8:
      return at::kByte;
    case DType::kInt32:
      return at::kInt;
    case DType::kInt64:
      return at::kLong;
  }
  throw_unknown_dtype(dtype);
}

at::Tensor alias(const void* data, std::size_t count, DType dtype) {
  // c10d reads inputs only; from_blob takes a non-const pointer whatever it will do with it.
  return torch::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(count)},
                          torch::TensorOptions().dtype(scalar_type(dtype)));
}

C10dBackend::C10dBackend(c10::intrusive_ptr<C10dCollectives> collectives, C10dWrapOptions options)
    : collectives_(std::move(collectives)),
      options_(std::move(options)),
      c10d_name_(collectives_->getBackendName()),
      name_("c10d:" + c10d_name_),
      rank_(collectives_->getRank()),
      size_(collectives_->getSize()),
      p2p_(options_.name, name_) {}

void C10dBackend::check(const BackendCall& call) const {
  if (call.kind == Collective::kBarrier) return;
  if (c10d_name_ == "gloo" && !libtorch_compat::c10d_gloo_takes(scalar_type(call.dtype))) {
    throw ConfigError(fmt::format(
        "{}: the {} backend of this libtorch ({}) cannot move {} tensors; convert the buffer to "
        "float32, or use ddp's ring group",
        to_string(call.kind), name_, TORCH_VERSION, to_string(call.dtype)));
  }
}

void C10dBackend::fail(CommErrorKind kind, const BackendCall& call, const std::string& what) const {
  throw CommError(kind,
                  fmt::format("rank {}: {} in group '{}' ({}) failed: {}", rank_, call.description,
                              options_.name, name_, what),
                  options_.name, call.description, call.sequence, -1);
}

void C10dBackend::run(const BackendCall& call, Clock::time_point deadline) {
  if (call.count == 0 && call.kind != Collective::kBarrier) return;  // the same on every rank
  const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  if (remaining.count() <= 0) fail(CommErrorKind::kTimeout, call, "the deadline passed first");
  std::vector<at::Tensor> keep;  // what c10d works on, alive until it is done
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = issue(call, remaining, keep);
  } catch (const c10::Error& e) {
    fail(CommErrorKind::kTransport, call,
         fmt::format("c10d refused it: {}", e.what_without_backtrace()));
  }
  wait(*work, call, deadline);
  if (call.kind == Collective::kReduceScatter && reduce_scatter_refused_) {
    std::memcpy(
        call.recv,
        block(keep.front().data_ptr(), static_cast<std::size_t>(rank_), call.count, call.dtype),
        call.count * dtype_size(call.dtype));
  }
  if (call.op != ReduceOp::kAvg) return;
  switch (call.kind) {
    case Collective::kAllreduce:
    case Collective::kReduceScatter: {
      auto result = alias(call.recv, call.count, call.dtype);
      divide_for_avg(result, size_);
      break;
    }
    case Collective::kReduce:
      if (rank_ == call.root) {
        auto result = alias(call.recv, call.count, call.dtype);
        divide_for_avg(result, size_);
      }
      break;
    default:
      break;
  }
}

c10::intrusive_ptr<c10d::Work> C10dBackend::issue(const BackendCall& call,
                                                  std::chrono::milliseconds timeout,
                                                  std::vector<at::Tensor>& keep) {
  const std::size_t bytes = call.count * dtype_size(call.dtype);
  switch (call.kind) {
    case Collective::kAllreduce: {
      // c10d reduces in place: the result goes where recv is.
      if (call.send != call.recv) std::memcpy(call.recv, call.send, bytes);
      keep = {alias(call.recv, call.count, call.dtype)};
      c10d::AllreduceOptions opts;
      opts.reduceOp = to_c10d(call.op);
      opts.timeout = timeout;
      return collectives_->allreduce(keep, opts);
    }
    case Collective::kBroadcast: {
      keep = {alias(call.recv, call.count, call.dtype)};
      c10d::BroadcastOptions opts;
      opts.rootRank = call.root;
      opts.timeout = timeout;
      return collectives_->broadcast(keep, opts);
    }
    case Collective::kReduce: {
      // In place too, and the other ranks' tensors serve as scratch: they reduce a copy of send.
      if (rank_ == call.root) {
        if (call.send != call.recv) std::memcpy(call.recv, call.send, bytes);
        keep = {alias(call.recv, call.count, call.dtype)};
      } else {
        keep = {alias(call.send, call.count, call.dtype).clone()};
      }
      c10d::ReduceOptions opts;
      opts.reduceOp = to_c10d(call.op);
      opts.rootRank = call.root;
      opts.timeout = timeout;
      return collectives_->reduce(keep, opts);
    }
    case Collective::kAllgather: {
      std::vector<std::vector<at::Tensor>> outputs = {
          blocks(call.recv, size_, call.count, call.dtype)};
      keep = {alias(call.send, call.count, call.dtype)};
      c10d::AllgatherOptions opts;
      opts.timeout = timeout;
      return collectives_->allgather(outputs, keep, opts);
    }
    case Collective::kGather: {
      std::vector<std::vector<at::Tensor>> outputs;  // empty away from the root, as c10d wants
      if (rank_ == call.root) outputs.push_back(blocks(call.recv, size_, call.count, call.dtype));
      keep = {alias(call.send, call.count, call.dtype)};
      c10d::GatherOptions opts;
      opts.rootRank = call.root;
      opts.timeout = timeout;
      return collectives_->gather(outputs, keep, opts);
    }
    case Collective::kScatter: {
      std::vector<std::vector<at::Tensor>> inputs;  // empty away from the root
      if (rank_ == call.root) inputs.push_back(blocks(call.send, size_, call.count, call.dtype));
      keep = {alias(call.recv, call.count, call.dtype)};
      c10d::ScatterOptions opts;
      opts.rootRank = call.root;
      opts.timeout = timeout;
      return collectives_->scatter(keep, inputs, opts);
    }
    case Collective::kReduceScatter:
      return issue_reduce_scatter(call, timeout, keep);
    case Collective::kAlltoall: {
      const auto total = call.count * static_cast<std::size_t>(size_);
      at::Tensor output = alias(call.recv, total, call.dtype);
      at::Tensor input = alias(call.send, total, call.dtype);
      keep = {output, input};
      std::vector<std::int64_t> equal_splits;  // empty: size() equal blocks
      c10d::AllToAllOptions opts;
      opts.timeout = timeout;
      return collectives_->alltoall_base(output, input, equal_splits, equal_splits, opts);
    }
    case Collective::kBarrier: {
      c10d::BarrierOptions opts;
      opts.timeout = timeout;
      return collectives_->barrier(opts);
    }
    case Collective::kSend:
      break;
  }
  throw ConfigError(
      fmt::format("{}: {} is not a collective the front queues", name_, to_string(call.kind)));
}

c10::intrusive_ptr<c10d::Work> C10dBackend::issue_reduce_scatter(const BackendCall& call,
                                                                 std::chrono::milliseconds timeout,
                                                                 std::vector<at::Tensor>& keep) {
  if (!reduce_scatter_refused_) {
    std::vector<std::vector<at::Tensor>> inputs = {
        blocks(call.send, size_, call.count, call.dtype)};
    keep = {alias(call.recv, call.count, call.dtype)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(call.op);
    opts.timeout = timeout;
    try {
      return collectives_->reduce_scatter(keep, inputs, opts);
    } catch (const c10::Error&) {
      // Refused before anything was sent ("ProcessGroupGloo does not support reduce_scatter",
      // 1.13), and so on every rank alike: every rank takes the fallback below.
      reduce_scatter_refused_ = true;
    }
  }
  // Fallback: allreduce a copy of every block, keep this rank's (twice the bytes on the wire).
  at::Tensor all =
      alias(call.send, call.count * static_cast<std::size_t>(size_), call.dtype).clone();
  keep = {all};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(call.op);
  opts.timeout = timeout;
  return collectives_->allreduce(keep, opts);  // run() copies this rank's block once done
}

void C10dBackend::wait(c10d::Work& work, const BackendCall& call,
                       Clock::time_point deadline) const {
  const auto remaining = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  bool completed = false;
  try {
    // c10d reads a zero timeout as "no timeout": wait at least 1 ms.
    completed = work.wait(std::max(remaining, std::chrono::milliseconds(1)));
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const auto line = what.substr(0, what.find('\n'));  // c10::Error appends a backtrace
    if (Clock::now() >= deadline) {
      fail(CommErrorKind::kTimeout, call,
           fmt::format("not done within its deadline (c10d: {})", line));
    }
    fail(CommErrorKind::kTransport, call, fmt::format("c10d: {}", line));
  }
  if (!completed) fail(CommErrorKind::kAborted, call, "c10d aborted the operation");
}

}  // namespace ddp::torch_c10d
