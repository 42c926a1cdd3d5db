// The coalesced tensor collectives of the tensor-level API (distributed.h): one collective over a
// list of tensors (all_reduce_coalesced, all_gather_into_tensor_coalesced,
// reduce_scatter_tensor_coalesced).
#include <cstring>

#include <fmt/format.h>

#include "ddp/torch/api/distributed.h"
#include "torch/api/distributed_collectives_internal.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/host_staging.h"

namespace ddp {

using detail::ByteBuffer;
using detail::bytes_of;
using detail::check_collective;
using detail::check_list_length;
using detail::check_numel;
using detail::check_reduce_op;
using detail::check_tensor;
using detail::check_tensor_like;
using detail::copy_back_on_success;
using detail::dtype_of;
using detail::element_count;
using detail::joined;
using detail::must_stage;
using detail::pack;
using detail::premultiplied;
using detail::run_on_host;
using detail::Tensors;
using detail::unpack_on_success;
using detail::with_result;
using detail::world;

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

}  // namespace ddp
