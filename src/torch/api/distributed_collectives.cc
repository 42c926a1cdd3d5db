// The tensor collectives of the tensor-level API (distributed.h): argument checks, then one
// engine call on the tensors' memory; list forms pack into (or unpack from) one flat buffer, the
// unpacking a completion callback of the Work so that it has run when wait() returns.
#include <cmath>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "ddp/torch/api/distributed.h"
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

using detail::check_collective;
using detail::check_list_length;
using detail::check_numel;
using detail::check_tensor;
using detail::check_tensor_like;
using detail::dtype_of;
using detail::element_count;
using detail::must_stage;
using detail::run_on_host;

namespace {

using Tensors = std::vector<torch::Tensor>;
using ByteBuffer = std::vector<std::byte>;

Tensors joined(Tensors a, const Tensors& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

constexpr CallOptions kBlocking{.blocking = true};

std::size_t bytes_of(const torch::Tensor& t) {
  return element_count(t) * t.element_size();
}

// Marks `work`'s result as `outputs` (the Work then keeps them alive until it is destroyed), and
// keeps `inputs` alive until the operation has completed: the caller may drop its handles (e.g. a
// temporary) before the engine has read them.
std::shared_ptr<Work> with_result(std::shared_ptr<Work> work, Tensors outputs,
                                  Tensors inputs = {}) {
  work->set_result(std::move(outputs));
  if (!inputs.empty()) work->then([inputs = std::move(inputs)](Work&) {});
  return work;
}

// The tensors of `list` one after the other in one buffer.
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

// Copies `flat` into the tensors of `list` once `work` has succeeded (plain memcpy: callbacks run
// on the group's thread, where no autograd state is wanted).
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

bool all_same(const std::vector<std::size_t>& counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

void check_list(const Tensors& list, std::size_t want, const std::string& name,
                const torch::Tensor& reference, const std::string& reference_name,
                const std::string& why) {
  check_list_length(list, want, name, why);
  for (std::size_t i = 0; i < list.size(); ++i) {
    check_tensor_like(list[i], fmt::format("{}[{}]", name, i), reference, reference_name);
  }
}

std::size_t world(ProcessGroup& g) {
  return static_cast<std::size_t>(g.size());
}

// PREMUL_SUM's own check, inside check_collective's: floating-point tensors only (as NCCL).
void check_reduce_op(const TensorReduceOp& op, const torch::Tensor& tensor,
                     const std::string& what) {
  if (op.is_premul_sum() && !torch::isFloatingType(tensor.scalar_type())) {
    throw ConfigError(fmt::format(
        "{} is {}; PREMUL_SUM (make_premul_sum) takes floating-point tensors, as NCCL: multiply "
        "an integer tensor yourself and reduce it with ReduceOp::kSum",
        what, c10::toString(tensor.scalar_type())));
  }
}

// What the engine reduces: `t` itself, or for PREMUL_SUM a copy of it times the factor (in t's
// dtype, as NCCL multiplies), so that `t` keeps its value whatever the call does.
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

// Copies `from[i]` into `to[i]` (same sizes) once `work` has succeeded: at once for a blocking
// call, which has completed (and thrown its error) when it returns.
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

}  // namespace

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

std::shared_ptr<Work> all_gather_async(const Tensors& tensor_list, const torch::Tensor& tensor,
                                       GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(tensor_list, {tensor}), /*packs_on_host=*/true)) {
    return run_on_host(g, {tensor}, tensor_list,
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return all_gather_async(w, r[0], on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(tensor, "all_gather: tensor");
    check_list(tensor_list, world(g), "all_gather: tensor_list", tensor, "the input tensor",
               "one per rank of the group");
    check_numel(tensor_list[static_cast<std::size_t>(g.rank())], tensor.numel(),
                fmt::format("all_gather: tensor_list[{}] (this rank's)", g.rank()),
                "as many as the input tensor");
  });
  const auto counts = counts_of(tensor_list);
  auto flat = std::make_shared<ByteBuffer>(
      std::accumulate(counts.begin(), counts.end(), std::size_t{0}) * tensor.element_size());
  auto work = all_same(counts) ? g.allgather(tensor.data_ptr(), flat->data(), element_count(tensor),
                                             dtype_of(tensor))
                               : g.allgather_v(tensor.data_ptr(), element_count(tensor),
                                               flat->data(), counts, dtype_of(tensor));
  unpack_on_success(*work, flat, tensor_list);
  return with_result(std::move(work), tensor_list, {tensor});
}
void all_gather(const Tensors& tensor_list, const torch::Tensor& tensor, GroupRef group) {
  all_gather_async(tensor_list, tensor, group)->wait();
}

std::shared_ptr<Work> all_gather_into_tensor_async(const torch::Tensor& output,
                                                   const torch::Tensor& input, GroupRef group) {
  ProcessGroup& g = group.get_for(output);
  if (must_stage(g, {output, input})) {
    return run_on_host(g, {input}, {output},
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return all_gather_into_tensor_async(w[0], r[0], on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(input, "all_gather_into_tensor: input", &g);
    check_tensor_like(output, "all_gather_into_tensor: output", input, "the input", &g);
    check_numel(output, input.numel() * g.size(), "all_gather_into_tensor: output",
                fmt::format("world size {} x the input's {}", g.size(), input.numel()));
  });
  return with_result(g.allgather(input.data_ptr(), output.data_ptr(), element_count(input),
                                 dtype_of(input), detail::device_call_options(g, input)),
                     {output}, {input});
}
void all_gather_into_tensor(const torch::Tensor& output, const torch::Tensor& input,
                            GroupRef group) {
  all_gather_into_tensor_async(output, input, group)->wait();
}

std::shared_ptr<Work> reduce_scatter_async(const torch::Tensor& output, const Tensors& input_list,
                                           TensorReduceOp op, GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(input_list, {output}), /*packs_on_host=*/true)) {
    return run_on_host(g, input_list, {output},
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return reduce_scatter_async(w[0], r, op, on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(output, "reduce_scatter: output");
    check_list(input_list, world(g), "reduce_scatter: input_list", output, "the output",
               "one per rank of the group");
    check_numel(output, input_list[static_cast<std::size_t>(g.rank())].numel(),
                "reduce_scatter: output",
                fmt::format("as many as input_list[{}], this rank's block", g.rank()));
    check_reduce_op(op, output, "reduce_scatter: output");
  });
  const auto counts = counts_of(input_list);
  auto flat = pack(premultiplied(input_list, op));
  auto work = all_same(counts) ? g.reduce_scatter(flat->data(), output.data_ptr(),
                                                  element_count(output), dtype_of(output), op.op())
                               : g.reduce_scatter_v(flat->data(), output.data_ptr(), counts,
                                                    dtype_of(output), op.op());
  work->then([flat](Work&) {});  // keeps the packed input alive until the operation completes
  return with_result(std::move(work), {output});
}
void reduce_scatter(const torch::Tensor& output, const Tensors& input_list, TensorReduceOp op,
                    GroupRef group) {
  reduce_scatter_async(output, input_list, op, group)->wait();
}

std::shared_ptr<Work> reduce_scatter_tensor_async(const torch::Tensor& output,
                                                  const torch::Tensor& input, TensorReduceOp op,
                                                  GroupRef group) {
  ProcessGroup& g = group.get_for(output);
  if (must_stage(g, {output, input})) {
    return run_on_host(g, {input}, {output},
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return reduce_scatter_tensor_async(w[0], r[0], op, on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(output, "reduce_scatter_tensor: output", &g);
    check_tensor_like(input, "reduce_scatter_tensor: input", output, "the output", &g);
    check_numel(input, output.numel() * g.size(), "reduce_scatter_tensor: input",
                fmt::format("world size {} x the output's {}", g.size(), output.numel()));
    check_reduce_op(op, output, "reduce_scatter_tensor: output");
  });
  const torch::Tensor send = premultiplied(input, op);
  return with_result(
      g.reduce_scatter(send.data_ptr(), output.data_ptr(), element_count(output), dtype_of(output),
                       op.op(), detail::device_call_options(g, output)),
      {output}, {send});
}
void reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input,
                           TensorReduceOp op, GroupRef group) {
  reduce_scatter_tensor_async(output, input, op, group)->wait();
}

namespace {

// The coalesced calls' checks: a non-empty list of tensors sharing tensors[0]'s dtype.
void check_coalesced(const Tensors& tensors, const std::string& what) {
  if (tensors.empty()) {
    throw ConfigError(fmt::format("{} is empty; pass at least one tensor", what));
  }
  check_tensor(tensors[0], what + "[0]");
  for (std::size_t i = 1; i < tensors.size(); ++i) {
    check_tensor_like(tensors[i], fmt::format("{}[{}]", what, i), tensors[0], what + "[0]");
  }
}

// outputs[i] / inputs[i] pairs of a coalesced gather or scatter: as many of each (at least one),
// bigger[i] of smaller[i]'s dtype and holding world x its elements. A reduction also needs one
// dtype for all (`one_dtype`); a gather moves bytes, so its pairs may differ.
void check_coalesced_pairs(const Tensors& bigger, const std::string& bigger_what,
                           const Tensors& smaller, const std::string& smaller_what, int world,
                           const std::string& call, bool one_dtype) {
  const std::string smaller_name = fmt::format("{}: {}", call, smaller_what);
  if (one_dtype) {
    check_coalesced(smaller, smaller_name);
  } else if (smaller.empty()) {
    throw ConfigError(fmt::format("{} is empty; pass at least one tensor", smaller_name));
  }
  check_list_length(bigger, smaller.size(), fmt::format("{}: {}", call, bigger_what),
                    fmt::format("one per tensor of {}", smaller_what));
  for (std::size_t i = 0; i < bigger.size(); ++i) {
    const std::string name = fmt::format("{}: {}[{}]", call, bigger_what, i);
    check_tensor(smaller[i], fmt::format("{}[{}]", smaller_name, i));
    check_tensor_like(bigger[i], name, smaller[i], fmt::format("{}[{}]", smaller_what, i));
    check_numel(
        bigger[i], smaller[i].numel() * world, name,
        fmt::format("world size {} x {}[{}]'s {}", world, smaller_what, i, smaller[i].numel()));
  }
}

}  // namespace

std::shared_ptr<Work> all_reduce_coalesced_async(const Tensors& tensors, TensorReduceOp op,
                                                 GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, tensors, /*packs_on_host=*/true)) {
    return run_on_host(g, {}, tensors, [&](const Tensors&, const Tensors& w, ProcessGroup& on) {
      return all_reduce_coalesced_async(w, op, on);
    });
  }
  check_collective(g, [&] {
    check_coalesced(tensors, "all_reduce_coalesced: tensors");
    check_reduce_op(op, tensors[0], "all_reduce_coalesced: tensors[0]");
  });
  // One allreduce of the tensors taken together, read and written where they lie where the
  // backend can (ProcessGroup::allreduce_segments).
  const Tensors reduced = premultiplied(tensors, op);
  std::vector<BufferSegment> segments;
  segments.reserve(reduced.size());
  for (const auto& t : reduced)
    segments.push_back({t.data_ptr(), element_count(t)});
  auto work = g.allreduce_segments(std::move(segments), dtype_of(tensors[0]), op.op());
  if (op.is_premul_sum()) copy_back_on_success(*work, {}, reduced, tensors);
  return with_result(std::move(work), tensors);
}
void all_reduce_coalesced(const Tensors& tensors, TensorReduceOp op, GroupRef group) {
  all_reduce_coalesced_async(tensors, op, group)->wait();
}

std::shared_ptr<Work> all_gather_into_tensor_coalesced_async(const Tensors& outputs,
                                                             const Tensors& inputs,
                                                             GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(outputs, inputs), /*packs_on_host=*/true)) {
    return run_on_host(g, inputs, outputs,
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return all_gather_into_tensor_coalesced_async(w, r, on);
                       });
  }
  check_collective(g, [&] {
    check_coalesced_pairs(outputs, "outputs", inputs, "inputs", g.size(),
                          "all_gather_into_tensor_coalesced", /*one_dtype=*/false);
  });
  // Each rank's block is the bytes of its inputs one after the other (dtypes may differ); block
  // r of the result then holds rank r's part of every output.
  auto send = pack(inputs);
  auto recv = std::make_shared<ByteBuffer>(send->size() * world(g));
  auto work = g.allgather(send->data(), recv->data(), send->size(), DType::kUInt8);
  work->then([send, recv, outputs, inputs, size = g.size()](Work& done) {
    if (done.error()) return;
    const std::size_t block = send->size();
    std::size_t offset = 0;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const std::size_t part = bytes_of(inputs[i]);
      auto* out = static_cast<std::byte*>(outputs[i].data_ptr());
      for (int r = 0; r < size && part > 0; ++r) {
        std::memcpy(out + static_cast<std::size_t>(r) * part,
                    recv->data() + static_cast<std::size_t>(r) * block + offset, part);
      }
      offset += part;
    }
  });
  return with_result(std::move(work), outputs);
}
void all_gather_into_tensor_coalesced(const Tensors& outputs, const Tensors& inputs,
                                      GroupRef group) {
  all_gather_into_tensor_coalesced_async(outputs, inputs, group)->wait();
}

std::shared_ptr<Work> reduce_scatter_tensor_coalesced_async(const Tensors& outputs,
                                                            const Tensors& inputs,
                                                            TensorReduceOp op, GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(outputs, inputs), /*packs_on_host=*/true)) {
    return run_on_host(g, inputs, outputs,
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return reduce_scatter_tensor_coalesced_async(w, r, op, on);
                       });
  }
  check_collective(g, [&] {
    check_coalesced_pairs(inputs, "inputs", outputs, "outputs", g.size(),
                          "reduce_scatter_tensor_coalesced", /*one_dtype=*/true);
    check_reduce_op(op, outputs[0], "reduce_scatter_tensor_coalesced: outputs[0]");
  });
  const Tensors sent = premultiplied(inputs, op);
  // Block r of the send buffer is block r of every input, one after the other: the reduced
  // block this rank receives is then its block of every output.
  std::size_t block = 0;
  for (const auto& t : outputs)
    block += bytes_of(t);
  auto send = std::make_shared<ByteBuffer>(block * world(g));
  std::size_t offset = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::size_t part = bytes_of(outputs[i]);
    const auto* in = static_cast<const std::byte*>(sent[i].data_ptr());
    for (std::size_t r = 0; r < world(g) && part > 0; ++r)
      std::memcpy(send->data() + r * block + offset, in + r * part, part);
    offset += part;
  }
  auto recv = std::make_shared<ByteBuffer>(block);
  auto work = g.reduce_scatter(send->data(), recv->data(), block / outputs[0].element_size(),
                               dtype_of(outputs[0]), op.op());
  work->then([send](Work&) {});
  unpack_on_success(*work, recv, outputs);
  return with_result(std::move(work), outputs);
}
void reduce_scatter_tensor_coalesced(const Tensors& outputs, const Tensors& inputs,
                                     TensorReduceOp op, GroupRef group) {
  reduce_scatter_tensor_coalesced_async(outputs, inputs, op, group)->wait();
}

std::shared_ptr<Work> all_to_all_async(const Tensors& output_list, const Tensors& input_list,
                                       GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(output_list, input_list), /*packs_on_host=*/true)) {
    return run_on_host(g, input_list, output_list,
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return all_to_all_async(w, r, on);
                       });
  }
  check_collective(g, [&] {
    check_list_length(input_list, world(g), "all_to_all: input_list", "one per rank of the group");
    check_tensor(input_list[0], "all_to_all: input_list[0]");
    check_list(input_list, world(g), "all_to_all: input_list", input_list[0], "input_list[0]",
               "one per rank of the group");
    check_list(output_list, world(g), "all_to_all: output_list", input_list[0], "input_list[0]",
               "one per rank of the group");
  });
  auto send = pack(input_list);
  const auto recv_counts = counts_of(output_list);
  auto recv = std::make_shared<ByteBuffer>(
      std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0}) *
      input_list[0].element_size());
  auto work = g.alltoall_v(send->data(), counts_of(input_list), recv->data(), recv_counts,
                           dtype_of(input_list[0]));
  work->then([send](Work&) {});
  unpack_on_success(*work, recv, output_list);
  return with_result(std::move(work), output_list);
}
void all_to_all(const Tensors& output_list, const Tensors& input_list, GroupRef group) {
  all_to_all_async(output_list, input_list, group)->wait();
}

namespace {

// Elements per row (dim 0) of `t`; ConfigError for a tensor without dimensions.
std::size_t row_elements(const torch::Tensor& t, const std::string& what) {
  if (t.dim() == 0) {
    throw ConfigError(fmt::format(
        "{} has no dimensions; all_to_all_single splits along dim 0 (use tensor.reshape({{-1}}))",
        what));
  }
  std::size_t n = 1;
  for (std::int64_t i = 1; i < t.dim(); ++i)
    n *= static_cast<std::size_t>(t.size(i));
  return n;
}

// The element counts of the blocks of `t` (rows per block `splits`, or equal blocks when empty).
std::vector<std::size_t> block_counts(const torch::Tensor& t,
                                      const std::vector<std::int64_t>& splits, std::size_t ranks,
                                      const std::string& what, const std::string& splits_name) {
  const std::size_t row = row_elements(t, what);
  const auto rows = static_cast<std::size_t>(t.size(0));
  std::vector<std::size_t> counts(ranks);
  if (splits.empty()) {
    if (rows % ranks != 0) {
      throw ConfigError(fmt::format(
          "all_to_all_single: {} has {} rows, which do not split evenly among {} ranks; pass {}",
          what, rows, ranks, splits_name));
    }
    std::fill(counts.begin(), counts.end(), rows / ranks * row);
    return counts;
  }
  if (splits.size() != ranks) {
    throw ConfigError(
        fmt::format("all_to_all_single: {} has {} entries; it needs one per rank ({})", splits_name,
                    splits.size(), ranks));
  }
  std::int64_t sum = 0;
  for (std::size_t j = 0; j < ranks; ++j) {
    if (splits[j] < 0) {
      throw ConfigError(
          fmt::format("all_to_all_single: {}[{}] is negative ({})", splits_name, j, splits[j]));
    }
    sum += splits[j];
    counts[j] = static_cast<std::size_t>(splits[j]) * row;
  }
  if (sum != t.size(0)) {
    throw ConfigError(fmt::format(
        "all_to_all_single: {} add up to {} rows but {} has {} (dim 0); they must add up to it",
        splits_name, sum, what, t.size(0)));
  }
  return counts;
}

}  // namespace

std::shared_ptr<Work> all_to_all_single_async(const torch::Tensor& output,
                                              const torch::Tensor& input,
                                              std::vector<std::int64_t> output_split_sizes,
                                              std::vector<std::int64_t> input_split_sizes,
                                              GroupRef group) {
  ProcessGroup& g = group.get_for(output);
  if (must_stage(g, {output, input})) {
    return run_on_host(
        g, {input}, {output}, [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
          return all_to_all_single_async(w[0], r[0], output_split_sizes, input_split_sizes, on);
        });
  }
  std::vector<std::size_t> send_counts;
  std::vector<std::size_t> recv_counts;
  check_collective(g, [&] {
    check_tensor(input, "all_to_all_single: input", &g);
    check_tensor_like(output, "all_to_all_single: output", input, "the input", &g);
    send_counts =
        block_counts(input, input_split_sizes, world(g), "the input", "input_split_sizes");
    recv_counts =
        block_counts(output, output_split_sizes, world(g), "the output", "output_split_sizes");
    if (row_elements(input, "the input") != row_elements(output, "the output")) {
      throw ConfigError(fmt::format(
          "all_to_all_single: rows of the input have {} elements but rows of the output {}; "
          "they must have the same shape after dim 0",
          row_elements(input, "the input"), row_elements(output, "the output")));
    }
  });
  if (input_split_sizes.empty() && output_split_sizes.empty()) {
    return with_result(g.alltoall(input.data_ptr(), output.data_ptr(), send_counts[0],
                                  dtype_of(input), detail::device_call_options(g, input)),
                       {output}, {input});
  }
  return with_result(
      g.alltoall_v(input.data_ptr(), std::move(send_counts), output.data_ptr(),
                   std::move(recv_counts), dtype_of(input), detail::device_call_options(g, input)),
      {output}, {input});
}
void all_to_all_single(const torch::Tensor& output, const torch::Tensor& input,
                       std::vector<std::int64_t> output_split_sizes,
                       std::vector<std::int64_t> input_split_sizes, GroupRef group) {
  all_to_all_single_async(output, input, std::move(output_split_sizes),
                          std::move(input_split_sizes), group)
      ->wait();
}

std::shared_ptr<Work> gather_async(const torch::Tensor& tensor, const Tensors& gather_list, int dst,
                                   GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(gather_list, {tensor}), /*packs_on_host=*/true)) {
    return run_on_host(g, {tensor}, gather_list,
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return gather_async(r[0], w, dst, on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(tensor, "gather: tensor");
    if (dst < 0 || dst >= g.size()) {
      throw ConfigError(
          fmt::format("gather: dst {} is not a rank of the group (0..{})", dst, g.size() - 1));
    }
    if (g.rank() != dst) {
      check_list_length(gather_list, 0, "gather: gather_list",
                        fmt::format("only dst {} receives; pass an empty list elsewhere", dst));
      return;
    }
    check_list(gather_list, world(g), "gather: gather_list", tensor, "the input tensor",
               "one per rank of the group, on dst");
    for (std::size_t i = 0; i < gather_list.size(); ++i) {
      check_numel(gather_list[i], tensor.numel(), fmt::format("gather: gather_list[{}]", i),
                  "as many as the input tensor");
    }
  });
  if (g.rank() != dst) {
    return with_result(
        g.gather(tensor.data_ptr(), nullptr, element_count(tensor), dtype_of(tensor), dst), {},
        {tensor});
  }
  auto flat = std::make_shared<ByteBuffer>(bytes_of(tensor) * world(g));
  auto work =
      g.gather(tensor.data_ptr(), flat->data(), element_count(tensor), dtype_of(tensor), dst);
  unpack_on_success(*work, flat, gather_list);
  return with_result(std::move(work), gather_list, {tensor});
}
void gather(const torch::Tensor& tensor, const Tensors& gather_list, int dst, GroupRef group) {
  gather_async(tensor, gather_list, dst, group)->wait();
}

std::shared_ptr<Work> scatter_async(const torch::Tensor& tensor, const Tensors& scatter_list,
                                    int src, GroupRef group) {
  ProcessGroup& g = group.get();
  if (must_stage(g, joined(scatter_list, {tensor}), /*packs_on_host=*/true)) {
    return run_on_host(g, scatter_list, {tensor},
                       [&](const Tensors& r, const Tensors& w, ProcessGroup& on) {
                         return scatter_async(w[0], r, src, on);
                       });
  }
  check_collective(g, [&] {
    check_tensor(tensor, "scatter: tensor");
    if (src < 0 || src >= g.size()) {
      throw ConfigError(
          fmt::format("scatter: src {} is not a rank of the group (0..{})", src, g.size() - 1));
    }
    if (g.rank() != src) {
      check_list_length(scatter_list, 0, "scatter: scatter_list",
                        fmt::format("only src {} sends; pass an empty list elsewhere", src));
      return;
    }
    check_list(scatter_list, world(g), "scatter: scatter_list", tensor, "the output tensor",
               "one per rank of the group, on src");
    for (std::size_t i = 0; i < scatter_list.size(); ++i) {
      check_numel(scatter_list[i], tensor.numel(), fmt::format("scatter: scatter_list[{}]", i),
                  "as many as the output tensor");
    }
  });
  std::shared_ptr<ByteBuffer> flat = g.rank() == src ? pack(scatter_list) : nullptr;
  auto work = g.scatter(flat ? flat->data() : nullptr, tensor.data_ptr(), element_count(tensor),
                        dtype_of(tensor), src);
  work->then([flat](Work&) {});
  return with_result(std::move(work), {tensor});
}
void scatter(const torch::Tensor& tensor, const Tensors& scatter_list, int src, GroupRef group) {
  scatter_async(tensor, scatter_list, src, group)->wait();
}

std::shared_ptr<Work> barrier_async(GroupRef group) {
  return group.get().barrier();
}
void barrier(GroupRef group) {
  group.get().barrier(kBlocking);
}

}  // namespace ddp
