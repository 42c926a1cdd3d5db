// The tensor collectives of the tensor-level API (distributed.h): argument checks, then one
// engine call on the tensors' memory; list forms pack into (or unpack from) one flat buffer, the
// unpacking a completion callback of the Work so that it has run when wait() returns.
// This file: PREMUL_SUM, the helpers the collectives share (distributed_collectives_internal.h),
// all_reduce, broadcast, reduce and barrier; the others are in distributed_gather_scatter.cc,
// distributed_coalesced.cc and distributed_all_to_all.cc.
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "ddp/torch/api/distributed.h"
#include "torch/api/distributed_collectives_internal.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/host_staging.h"

namespace ddp {

double TensorReduceOp::premul_factor() const {
  if (!premul_factor_) {
    throw ConfigError(
        fmt::format("premul_factor() of ReduceOp {}, which is not PREMUL_SUM", to_string(op_)));
  }
  return *premul_factor_;
}

TensorReduceOp make_premul_sum(double factor) {
  if (!std::isfinite(factor)) {
    throw ConfigError(fmt::format("make_premul_sum: factor {} is not finite", factor));
  }
  TensorReduceOp op(ReduceOp::kSum);
  op.premul_factor_ = factor;
  return op;
}

TensorReduceOp make_premul_sum(const torch::Tensor& factor) {
  if (!factor.defined() || factor.numel() != 1) {
    throw ConfigError(fmt::format(
        "make_premul_sum: the factor tensor has {} elements; pass a tensor of one element (or a "
        "double)",
        factor.defined() ? factor.numel() : 0));
  }
  return make_premul_sum(factor.item<double>());
}

namespace detail {

std::shared_ptr<Work> with_result(std::shared_ptr<Work> work, Tensors outputs, Tensors inputs) {
  work->set_result(std::move(outputs));
  if (!inputs.empty()) work->then([inputs = std::move(inputs)](Work&) {});
  return work;
}

std::shared_ptr<ByteBuffer> pack(const Tensors& list) {
  std::size_t total = 0;
  for (const auto& t : list)
    total += bytes_of(t);
  auto flat = std::make_shared<ByteBuffer>(total);
  std::size_t at = 0;
  for (const auto& t : list) {
    if (bytes_of(t) > 0) std::memcpy(flat->data() + at, t.data_ptr(), bytes_of(t));
    at += bytes_of(t);
  }
  return flat;
}

void unpack_on_success(Work& work, std::shared_ptr<ByteBuffer> flat, Tensors list) {
  work.then([flat = std::move(flat), list = std::move(list)](Work& done) {
    if (done.error()) return;
    std::size_t at = 0;
    for (const auto& t : list) {
      if (bytes_of(t) > 0) std::memcpy(t.data_ptr(), flat->data() + at, bytes_of(t));
      at += bytes_of(t);
    }
  });
}

std::vector<std::size_t> counts_of(const Tensors& list) {
  std::vector<std::size_t> counts;
  counts.reserve(list.size());
  for (const auto& t : list)
    counts.push_back(element_count(t));
  return counts;
}

void check_list(const Tensors& list, std::size_t want, const std::string& name,
                const torch::Tensor& reference, const std::string& reference_name,
                const std::string& why) {
  check_list_length(list, want, name, why);
  for (std::size_t i = 0; i < list.size(); ++i) {
    check_tensor_like(list[i], fmt::format("{}[{}]", name, i), reference, reference_name);
  }
}

void check_reduce_op(const TensorReduceOp& op, const torch::Tensor& tensor,
                     const std::string& what) {
  if (op.is_premul_sum() && !torch::isFloatingType(tensor.scalar_type())) {
    throw ConfigError(fmt::format(
        "{} is {}; PREMUL_SUM (make_premul_sum) takes floating-point tensors, as NCCL: multiply "
        "an integer tensor yourself and reduce it with ReduceOp::kSum",
        what, c10::toString(tensor.scalar_type())));
  }
}

torch::Tensor premultiplied(const torch::Tensor& t, const TensorReduceOp& op) {
  if (!op.is_premul_sum()) return t;
  torch::NoGradGuard no_grad;
  return (t * op.premul_factor()).contiguous();
}
Tensors premultiplied(const Tensors& list, const TensorReduceOp& op) {
  if (!op.is_premul_sum()) return list;
  Tensors scaled;
  scaled.reserve(list.size());
  for (const auto& t : list)
    scaled.push_back(premultiplied(t, op));
  return scaled;
}

void copy_back_on_success(Work& work, const CallOptions& options, Tensors from, Tensors to) {
  auto copy = [from = std::move(from), to = std::move(to)](Work& done) {
    if (done.error()) return;
    for (std::size_t i = 0; i < to.size(); ++i) {
      if (bytes_of(to[i]) == 0) continue;
      if (to[i].is_cuda()) {  // a CUDA group's device tensors: a device copy
        torch::NoGradGuard no_grad;
        torch::Tensor target = to[i];
        target.copy_(from[i]);
      } else {
        std::memcpy(to[i].data_ptr(), from[i].data_ptr(), bytes_of(to[i]));
      }
    }
  };
  if (options.blocking) {
    copy(work);
  } else {
    work.then(std::move(copy));
  }
}

}  // namespace detail

using detail::check_collective;
using detail::check_reduce_op;
using detail::check_tensor;
using detail::copy_back_on_success;
using detail::dtype_of;
using detail::element_count;
using detail::kBlocking;
using detail::must_stage;
using detail::premultiplied;
using detail::run_on_host;
using detail::Tensors;
using detail::with_result;

// The engine calls of the single-tensor collectives, checked; the blocking forms pass
// CallOptions::blocking (no Work of their own, and on an idle group no thread hand-off).
std::shared_ptr<Work> all_reduce_call(const torch::Tensor& tensor, TensorReduceOp op,
                                      GroupRef group, CallOptions options) {
  ProcessGroup& g = group.get_for(tensor);
  if (must_stage(g, {tensor})) {
    return run_on_host(
        g, {}, {tensor},
        [&](const Tensors&, const Tensors& w, ProcessGroup& on) {
          return all_reduce_call(w[0], op, on, {});
        },
        options.blocking);
  }
  check_collective(g, [&] {
    check_tensor(tensor, "all_reduce: tensor", &g);
    check_reduce_op(op, tensor, "all_reduce: tensor");
  });
  const torch::Tensor reduced = premultiplied(tensor, op);
  auto work = g.allreduce(reduced.data_ptr(), element_count(reduced), dtype_of(reduced), op.op(),
                          detail::device_call_options(g, tensor, options));
  if (op.is_premul_sum()) copy_back_on_success(*work, options, {reduced}, {tensor});
  return work;
}
std::shared_ptr<Work> broadcast_call(const torch::Tensor& tensor, int src, GroupRef group,
                                     CallOptions options) {
  ProcessGroup& g = group.get_for(tensor);
  if (must_stage(g, {tensor})) {
    // The source only reads its tensor: nothing to copy back there (the Work's result is the
    // tensor everywhere).
    const bool source = g.rank() == src;
    const Tensors outputs{tensor};
    return run_on_host(
        g, source ? Tensors{tensor} : Tensors{}, source ? Tensors{} : Tensors{tensor},
        [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
          return broadcast_call(source ? r[0] : w[0], src, on, {});
        },
        options.blocking, &outputs);
  }
  check_collective(g, [&] { check_tensor(tensor, "broadcast: tensor", &g); });
  return g.broadcast(tensor.data_ptr(), element_count(tensor), dtype_of(tensor), src,
                     detail::device_call_options(g, tensor, options));
}

std::shared_ptr<Work> all_reduce_async(const torch::Tensor& tensor, TensorReduceOp op,
                                       GroupRef group) {
  return with_result(all_reduce_call(tensor, op, group, {}), {tensor});
}
void all_reduce(const torch::Tensor& tensor, TensorReduceOp op, GroupRef group) {
  all_reduce_call(tensor, op, group, kBlocking);
}

std::shared_ptr<Work> broadcast_async(const torch::Tensor& tensor, int src, GroupRef group) {
  return with_result(broadcast_call(tensor, src, group, {}), {tensor});
}
void broadcast(const torch::Tensor& tensor, int src, GroupRef group) {
  broadcast_call(tensor, src, group, kBlocking);
}

std::shared_ptr<Work> reduce_async(const torch::Tensor& tensor, int dst, TensorReduceOp op,
                                   GroupRef group) {
  ProcessGroup& g = group.get_for(tensor);
  if (must_stage(g, {tensor})) {
    // Only the destination's tensor is written (the Work's result is the tensor everywhere).
    const bool destination = g.rank() == dst;
    const Tensors outputs{tensor};
    return run_on_host(
        g, destination ? Tensors{} : Tensors{tensor}, destination ? Tensors{tensor} : Tensors{},
        [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
          return reduce_async(destination ? w[0] : r[0], dst, op, on);
        },
        /*blocking=*/false, &outputs);
  }
  check_collective(g, [&] {
    check_tensor(tensor, "reduce: tensor", &g);
    check_reduce_op(op, tensor, "reduce: tensor");
  });
  const torch::Tensor send = premultiplied(tensor, op);
  void* recv = g.rank() == dst ? tensor.data_ptr() : nullptr;
  return with_result(g.reduce(send.data_ptr(), recv, element_count(tensor), dtype_of(tensor),
                              op.op(), dst, detail::device_call_options(g, tensor)),
                     {tensor}, {send});
}
void reduce(const torch::Tensor& tensor, int dst, TensorReduceOp op, GroupRef group) {
  reduce_async(tensor, dst, op, group)->wait();
}

std::shared_ptr<Work> barrier_async(GroupRef group) {
  return group.get().barrier();
}
void barrier(GroupRef group) {
  group.get().barrier(kBlocking);
}

}  // namespace ddp
