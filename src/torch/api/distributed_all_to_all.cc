// The all-to-all tensor collectives of the tensor-level API (distributed.h): all_to_all over
// lists, and all_to_all_single's blocks of dim 0 (equal, or of the rows the splits give).
#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "ddp/torch/api/distributed.h"
#include "torch/api/distributed_collectives_internal.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/host_staging.h"

namespace ddp {

using detail::ByteBuffer;
using detail::check_collective;
using detail::check_list;
using detail::check_list_length;
using detail::check_tensor;
using detail::check_tensor_like;
using detail::counts_of;
using detail::dtype_of;
using detail::joined;
using detail::must_stage;
using detail::pack;
using detail::run_on_host;
using detail::Tensors;
using detail::unpack_on_success;
using detail::with_result;
using detail::world;

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

}  // namespace ddp
