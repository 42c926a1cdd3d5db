// The conjugate autograd functions of tensor and sequence parallelism (tensor_parallel.h).
#include <cstdint>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "torch/core/distributed_checks.h"
#include "torch/parallel/tensor/tensor_parallel_internal.h"

namespace ddp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What a backward needs to run its collective: the group (kept alive by the graph) and the
// dimension the region splits.
struct RegionContext : torch::CustomClassHolder {
  std::shared_ptr<ProcessGroup> group;
  std::int64_t dim = -1;
};

void save_region(AutogradContext* ctx, const std::shared_ptr<ProcessGroup>& group,
                 std::int64_t dim) {
  auto context = c10::make_intrusive<RegionContext>();
  context->group = group;
  context->dim = dim;
  ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(context));
}

c10::intrusive_ptr<RegionContext> region_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<RegionContext>(ctx->saved_data["region"].toCapsule());
}

torch::Tensor all_reduced(const torch::Tensor& input, ProcessGroup& group) {
  auto out = input.contiguous().clone();
  if (group.size() > 1) all_reduce(out, ReduceOp::kSum, group);
  return out;
}

// The concatenation along `dim` of every rank's `input` (rank order).
torch::Tensor all_gathered_along(const torch::Tensor& input, std::int64_t dim,
                                 ProcessGroup& group) {
  if (group.size() == 1) return input.contiguous();
  auto moved = input.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] *= group.size();
  auto out = torch::empty(sizes, moved.options());
  all_gather_into_tensor(out, moved, group);
  return out.movedim(0, dim).contiguous();
}

// This rank's part along `dim` of the sum over ranks of `input`.
torch::Tensor reduce_scattered_along(const torch::Tensor& input, std::int64_t dim,
                                     ProcessGroup& group) {
  if (group.size() == 1) return input.contiguous();
  auto moved = input.movedim(dim, 0).contiguous();
  auto sizes = moved.sizes().vec();
  sizes[0] /= group.size();
  auto out = torch::empty(sizes, moved.options());
  reduce_scatter_tensor(out, moved, ReduceOp::kSum, group);
  return out.movedim(0, dim).contiguous();
}

// This rank's part along `dim` (no communication).
torch::Tensor own_part_along(const torch::Tensor& input, std::int64_t dim, ProcessGroup& group) {
  const auto part = input.size(dim) / group.size();
  return input.narrow(dim, part * group.rank(), part).contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const std::shared_ptr<ProcessGroup>& group) {
    save_region(ctx, group, -1);
    return input;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    return {all_reduced(grad_outputs[0], *region_of(ctx)->group), torch::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& input,
                               const std::shared_ptr<ProcessGroup>& group) {
    return all_reduced(input, *group);
  }
  static variable_list backward(AutogradContext*, variable_list grad_outputs) {
    return {grad_outputs[0], torch::Tensor()};
  }
};

// Forward keeps this rank's part along dim; backward gathers the parts.
struct ScatterToRegion : torch::autograd::Function<ScatterToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const std::shared_ptr<ProcessGroup>& group, std::int64_t dim) {
    save_region(ctx, group, dim);
    return own_part_along(input, dim, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto region = region_of(ctx);
    return {all_gathered_along(grad_outputs[0], region->dim, *region->group), torch::Tensor(),
            torch::Tensor()};
  }
};

// Forward gathers along dim; backward keeps this rank's part (tensor parallel: the gradient of
// a replicated activation is already whole on every rank) or reduce-scatters it (sequence
// parallel: the ranks' gradients are partial sums).
struct GatherFromRegion : torch::autograd::Function<GatherFromRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const std::shared_ptr<ProcessGroup>& group, std::int64_t dim,
                               bool reduce_scatter_gradient) {
    save_region(ctx, group, dim);
    ctx->saved_data["reduce_scatter"] = reduce_scatter_gradient;
    return all_gathered_along(input, dim, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto region = region_of(ctx);
    auto grad = ctx->saved_data["reduce_scatter"].toBool()
                    ? reduce_scattered_along(grad_outputs[0], region->dim, *region->group)
                    : own_part_along(grad_outputs[0], region->dim, *region->group);
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

struct ReduceScatterToRegion : torch::autograd::Function<ReduceScatterToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const std::shared_ptr<ProcessGroup>& group, std::int64_t dim) {
    save_region(ctx, group, dim);
    return reduce_scattered_along(input, dim, *group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto region = region_of(ctx);
    return {all_gathered_along(grad_outputs[0], region->dim, *region->group), torch::Tensor(),
            torch::Tensor()};
  }
};

// `dim` of `input` as a non-negative index, and its size divisible by the group's size; on
// failure a ConfigError after a barrier in place of the collective (distributed_checks.h).
std::int64_t checked_dim(const torch::Tensor& input, std::int64_t dim, ProcessGroup& group,
                         const char* call, bool must_divide) {
  std::int64_t index = dim;
  detail::check_collective(group, [&] {
    if (!input.defined()) throw ConfigError(fmt::format("{}: the input is undefined", call));
    const auto rank = input.dim();
    if (dim < -rank || dim >= rank || rank == 0) {
      throw ConfigError(fmt::format("{}: dimension {} is out of range for an input of shape [{}]",
                                    call, dim, fmt::join(input.sizes(), ", ")));
    }
    index = dim < 0 ? dim + rank : dim;
    if (must_divide && input.size(index) % group.size() != 0) {
      throw ConfigError(fmt::format(
          "{}: dimension {} of the input (shape [{}]) has size {}, not divisible by the group's "
          "{} ranks; make it a multiple of {}",
          call, index, fmt::join(input.sizes(), ", "), input.size(index), group.size(),
          group.size()));
    }
  });
  return index;
}

}  // namespace

torch::Tensor copy_to_tensor_parallel_region(const torch::Tensor& input,
                                             const std::shared_ptr<ProcessGroup>& group) {
  detail::tp_group_or_throw(group, "copy_to_tensor_parallel_region");
  return CopyToRegion::apply(input, group);
}

torch::Tensor reduce_from_tensor_parallel_region(const torch::Tensor& input,
                                                 const std::shared_ptr<ProcessGroup>& group) {
  detail::tp_group_or_throw(group, "reduce_from_tensor_parallel_region");
  return ReduceFromRegion::apply(input, group);
}

torch::Tensor scatter_to_tensor_parallel_region(const torch::Tensor& input,
                                                const std::shared_ptr<ProcessGroup>& group) {
  constexpr const char* call = "scatter_to_tensor_parallel_region";
  const auto dim = checked_dim(input, -1, detail::tp_group_or_throw(group, call), call, true);
  return ScatterToRegion::apply(input, group, dim);
}

torch::Tensor gather_from_tensor_parallel_region(const torch::Tensor& input,
                                                 const std::shared_ptr<ProcessGroup>& group) {
  constexpr const char* call = "gather_from_tensor_parallel_region";
  const auto dim = checked_dim(input, -1, detail::tp_group_or_throw(group, call), call, false);
  return GatherFromRegion::apply(input, group, dim, false);
}

torch::Tensor scatter_to_sequence_parallel_region(const torch::Tensor& input,
                                                  const std::shared_ptr<ProcessGroup>& group,
                                                  std::int64_t sequence_dim) {
  constexpr const char* call = "scatter_to_sequence_parallel_region";
  const auto dim =
      checked_dim(input, sequence_dim, detail::tp_group_or_throw(group, call), call, true);
  return ScatterToRegion::apply(input, group, dim);
}

torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& input,
                                                   const std::shared_ptr<ProcessGroup>& group,
                                                   std::int64_t sequence_dim) {
  constexpr const char* call = "gather_from_sequence_parallel_region";
  const auto dim =
      checked_dim(input, sequence_dim, detail::tp_group_or_throw(group, call), call, false);
  return GatherFromRegion::apply(input, group, dim, true);
}

torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& input,
                                                         const std::shared_ptr<ProcessGroup>& group,
                                                         std::int64_t sequence_dim) {
  constexpr const char* call = "reduce_scatter_to_sequence_parallel_region";
  const auto dim =
      checked_dim(input, sequence_dim, detail::tp_group_or_throw(group, call), call, true);
  return ReduceScatterToRegion::apply(input, group, dim);
}

}  // namespace ddp
