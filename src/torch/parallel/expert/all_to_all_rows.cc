// all_to_all_rows (mixture_of_experts.h): the uneven all-to-all of the token dispatch, as an
// autograd function whose backward sends every row's gradient back where the row came from.
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "torch/core/autograd_group.h"

namespace ddp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor exchange_rows(const torch::Tensor& input, const std::vector<std::int64_t>& out_splits,
                            const std::vector<std::int64_t>& in_splits, ProcessGroup& group) {
  const auto rows = std::accumulate(out_splits.begin(), out_splits.end(), std::int64_t{0});
  auto sizes = input.sizes().vec();
  sizes[0] = rows;
  auto output = torch::empty(sizes, input.options());
  all_to_all_single(output, input.contiguous(), out_splits, in_splits, group);
  return output;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               std::vector<std::int64_t> out_splits,
                               std::vector<std::int64_t> in_splits,
                               const std::shared_ptr<ProcessGroup>& group) {
    detail::save_group(ctx, "group", group);
    ctx->saved_data["out_splits"] = out_splits;
    ctx->saved_data["in_splits"] = in_splits;
    return exchange_rows(input, out_splits, in_splits, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto group = detail::saved_group(ctx, "group");
    // Back along the same pairs: what came from rank j returns to it.
    const auto out_splits = ctx->saved_data["in_splits"].toIntVector();
    const auto in_splits = ctx->saved_data["out_splits"].toIntVector();
    return {exchange_rows(grad_outputs[0], out_splits, in_splits, *group), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all_rows(const torch::Tensor& input,
                              std::vector<std::int64_t> output_split_sizes,
                              std::vector<std::int64_t> input_split_sizes,
                              const std::shared_ptr<ProcessGroup>& group) {
  if (!group) throw ConfigError("all_to_all_rows: the group is null (this rank is not a member)");
  if (input.dim() < 1)
    throw ConfigError("all_to_all_rows: the input must have at least one dimension (rows)");
  return AllToAllRows::apply(input, std::move(output_split_sizes), std::move(input_split_sizes),
                             group);
}

}  // namespace ddp
