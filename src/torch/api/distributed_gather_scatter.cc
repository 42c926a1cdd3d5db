// The gathering and scattering tensor collectives of the tensor-level API (distributed.h):
// all_gather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, gather and scatter.
#include <numeric>

#include <fmt/format.h>

#include "ddp/torch/api/distributed.h"
#include "torch/api/distributed_collectives_internal.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/host_staging.h"

namespace ddp {

using detail::all_same;
using detail::ByteBuffer;
using detail::bytes_of;
using detail::check_collective;
using detail::check_list;
using detail::check_list_length;
using detail::check_numel;
using detail::check_reduce_op;
using detail::check_tensor;
using detail::check_tensor_like;
using detail::counts_of;
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

}  // namespace ddp
