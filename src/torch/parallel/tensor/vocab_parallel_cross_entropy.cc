// vocab_parallel_cross_entropy (tensor_parallel.h): Megatron's cross-entropy over logits split
// along the vocabulary, without gathering them.
#include <cstdint>

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

// loss = log(sum_v exp(z_v - m)) - (z_target - m) with m the global max; every sum over the
// vocabulary is this rank's part plus an all-reduce.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& target,
                               const std::shared_ptr<ProcessGroup>& group) {
    auto& g = *group;
    const auto part = logits.size(-1);
    auto max = std::get<0>(logits.max(-1)).contiguous();
    if (g.size() > 1) all_reduce(max, ReduceOp::kMax, g);
    const auto shifted = logits - max.unsqueeze(-1);

    const auto start = part * g.rank();
    const auto outside = (target < start) | (target >= start + part);
    const auto local_target = (target - start).masked_fill(outside, 0);
    const auto target_logit =
        shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    const auto exp = shifted.exp();
    // One all-reduce for both sums: the target's logit (non-zero on its owner only) and the sum
    // of exponentials.
    auto sums = torch::stack({target_logit, exp.sum(-1)}).contiguous();
    if (g.size() > 1) all_reduce(sums, ReduceOp::kSum, g);
    const auto sum_exp = sums[1];

    ctx->save_for_backward({exp / sum_exp.unsqueeze(-1), local_target, outside});
    return sum_exp.log() - sums[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& softmax = saved[0];
    const auto& local_target = saved[1];
    const auto& outside = saved[2];
    // d loss / d z_v = softmax_v - [v == target], on this rank's part of the vocabulary.
    auto grad = softmax.clone();
    grad.scatter_add_(-1, local_target.unsqueeze(-1),
                      (outside.logical_not().to(grad.scalar_type()) * -1.0).unsqueeze(-1));
    grad.mul_(grad_outputs[0].unsqueeze(-1));
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           const std::shared_ptr<ProcessGroup>& group) {
  constexpr const char* call = "vocab_parallel_cross_entropy";
  auto& g = detail::tp_group_or_throw(group, call);
  detail::check_collective(g, [&] {
    if (!logits.defined() || !target.defined() || logits.dim() < 1) {
      throw ConfigError(fmt::format("{}: logits and target must be defined tensors", call));
    }
    if (target.scalar_type() != torch::kInt64) {
      throw ConfigError(fmt::format("{}: the target must be int64 class ids, got {}", call,
                                    c10::toString(target.scalar_type())));
    }
    const auto batch = logits.sizes().slice(0, logits.dim() - 1);
    if (target.sizes() != batch) {
      throw ConfigError(fmt::format(
          "{}: the target has shape [{}] but the logits [{}]; the target must have the logits' "
          "shape without the last (vocabulary) dimension",
          call, fmt::join(target.sizes(), ", "), fmt::join(logits.sizes(), ", ")));
    }
    const auto vocab = logits.size(-1) * g.size();
    if (target.numel() > 0) {
      const auto low = target.min().item<std::int64_t>();
      const auto high = target.max().item<std::int64_t>();
      if (low < 0 || high >= vocab) {
        throw ConfigError(fmt::format(
            "{}: target ids range over [{}, {}], outside the vocabulary [0, {}) ({} per rank x {} "
            "ranks)",
            call, low, high, vocab, logits.size(-1), g.size()));
      }
    }
  });
  return VocabParallelCrossEntropy::apply(logits, target, group);
}

}  // namespace ddp
