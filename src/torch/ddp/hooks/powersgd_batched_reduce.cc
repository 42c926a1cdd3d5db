// PowerSGD: batched_powersgd_hook's reduction of a bucket: the whole bucket as one square matrix
// (padded), compressed with one P and one Q.
#include <algorithm>
#include <cmath>

#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "torch/ddp/hooks/powersgd_internal.h"

namespace ddp::powersgd_detail {
namespace {

// Adds the bucket's error to `input` (none on its first step) and returns the bucket's error
// memory, which now holds a copy of the error-corrected input; the finish step subtracts the
// approximation from it, leaving the new error. PyTorch clones the input and allocates the
// difference every step; reusing the one tensor gives the same values without two allocations
// of the bucket's size per step (80 MB each for the mlp).
torch::Tensor apply_error_feedback(PowerSGDState& state, std::size_t index, torch::Tensor& input) {
  auto lock = Access::lock(state);
  auto& errors = Access::error(state);
  auto it = errors.find(index);
  if (it == errors.end()) return errors.emplace(index, input.clone()).first->second;
  check_memory_size(it->second, input.numel(), "error", index);
  input.add_(it->second);
  it->second.copy_(input);
  return it->second;
}

}  // namespace

BucketReduction batched_powersgd_reduce(const std::shared_ptr<PowerSGDState>& state_ptr,
                                        ProcessGroup& group, GradBucket& bucket) {
  PowerSGDState& state = *state_ptr;
  const auto& options = Access::options(state);
  torch::NoGradGuard no_grad;
  if (auto plain = plain_average_unless_compressing(state_ptr, group, bucket)) return *plain;
  torch::Tensor input = bucket.buffer;
  const std::size_t index = bucket.index;
  const double world = group.size();
  const auto total = input.numel();
  const auto side = static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  // PyTorch uses the configured rank here; a rank above the side would fail its assertion.
  const auto rank = std::min<std::int64_t>(side, options.matrix_approximation_rank);
  {
    auto lock = Access::lock(state);
    Access::before(state) += total;
    Access::after(state) += side * options.matrix_approximation_rank * 2;
  }
  // PyTorch resizes the bucket in place; the reducer's bucket is fixed, so pad a copy.
  auto padded = torch::zeros({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);
  torch::Tensor padded_copy;
  if (options.use_error_feedback) padded_copy = apply_error_feedback(state, index, padded);
  auto matrix = padded.view({side, side});
  torch::Tensor p, q;
  {
    auto lock = Access::lock(state);
    auto& ps = Access::p(state);
    auto& qs = Access::q(state);
    if (!options.warm_start || ps.count(index) == 0) {
      ps[index] = torch::empty({side, rank}, input.options());
      auto generator = q_generator(state);
      qs[index] =
          torch::randn({side, rank}, generator, torch::TensorOptions().dtype(input.dtype()));
    }
    check_memory_size(ps[index], side * rank, "P", index);
    check_memory_size(qs[index], side * rank, "Q", index);
    p = ps[index];
    q = qs[index];
  }
  powersgd_detail::orthogonalize(q.unsqueeze(0), 0);
  at::matmul_out(p, matrix, q);
  const std::size_t bytes = 2 * static_cast<std::size_t>(side * rank) * input.element_size();
  {
    auto lock = Access::lock(state);
    Access::bytes(state) += bytes;
  }
  auto work = allreduce_tensor(group, p, ReduceOp::kSum);
  // The Q stage in finish, in bucket order (see powersgd_reduce).
  const bool is_last = bucket.is_last;
  auto finish = [state_ptr, p, q, matrix, padded, padded_copy, input, total, index, world, is_last,
                 &group]() mutable {
    torch::NoGradGuard no_grad;
    PowerSGDState& state = *state_ptr;
    powersgd_detail::orthogonalize(p.unsqueeze(0), 0);
    at::matmul_out(q, matrix.t(), p);
    allreduce_tensor(group, q, ReduceOp::kSum)->wait();
    q.div_(world);
    at::matmul_out(matrix, p, q.t());
    input.copy_(padded.narrow(0, 0, total));
    auto lock = Access::lock(state);
    const auto& options = Access::options(state);
    if (options.use_error_feedback) padded_copy.sub_(padded);  // the error memory
    if (!options.warm_start) {
      Access::p(state).erase(index);
      Access::q(state).erase(index);
    }
    if (is_last) ++Access::iter(state);
  };
  return {std::move(work), std::move(finish), bytes};
}

}  // namespace ddp::powersgd_detail
