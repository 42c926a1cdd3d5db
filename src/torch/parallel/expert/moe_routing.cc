// assign_tokens (moe_routing.h): capacity and drops decided from the whole batch's counts.
#include "torch/parallel/expert/moe_routing.h"

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"

namespace ddp::detail {

namespace {

// The all-gathered row of one rank: [check kind, check value, T, capacity factor (bits), counts
// (k x E), probability sums (E, float64 bits)].
constexpr std::int64_t kHeader = 4;

std::string input_error(int rank, const MoeInputCheck& check, std::int64_t hidden) {
  switch (check.kind) {
    case MoeInputCheck::Kind::kLastDimension:
      return check.value < 0
                 ? fmt::format(
                       "MoeLayer: rank {} of the token group passed a 0-dimensional input; "
                       "pass [..., hidden={}]",
                       rank, hidden)
                 : fmt::format(
                       "MoeLayer: rank {} of the token group passed an input whose last "
                       "dimension is {}, not hidden={}; pass [..., {}]",
                       rank, check.value, hidden, hidden);
    case MoeInputCheck::Kind::kDtype:
      return fmt::format(
          "MoeLayer: rank {} of the token group passed a {} input to a layer of "
          "another dtype; convert the input or the layer",
          rank, c10::toString(static_cast<c10::ScalarType>(check.value)));
    case MoeInputCheck::Kind::kDevice:
      return fmt::format(
          "MoeLayer: rank {} of the token group passed an input that is not on the "
          "CPU; the layer runs on CPU tensors",
          rank);
    case MoeInputCheck::Kind::kNone:
      break;
  }
  return {};
}

}  // namespace

MoeAssignment assign_tokens(const torch::Tensor& experts, const torch::Tensor& probability_sums,
                            std::int64_t num_experts, std::int64_t hidden, double capacity_factor,
                            const MoeInputCheck& check, ProcessGroup* tokens) {
  const auto top_k = experts.size(1);
  const auto slots = top_k * num_experts;
  const auto width = kHeader + slots + num_experts;
  auto row = torch::zeros({width}, torch::kInt64);
  auto* r = row.data_ptr<std::int64_t>();
  r[0] = static_cast<std::int64_t>(check.kind);
  r[1] = check.value;
  r[2] = experts.size(0);
  r[3] = std::bit_cast<std::int64_t>(capacity_factor);
  if (check.kind == MoeInputCheck::Kind::kNone && experts.size(0) > 0) {
    // counts[k][e]: this rank's tokens whose k-th choice is e.
    const auto slot_of = experts + torch::arange(top_k, torch::kInt64).unsqueeze(0) * num_experts;
    row.narrow(0, kHeader, slots).copy_(torch::bincount(slot_of.reshape(-1), {}, slots));
    auto sums = probability_sums.to(torch::kFloat64).contiguous();
    const auto* s = sums.data_ptr<double>();
    for (std::int64_t e = 0; e < num_experts; ++e)
      r[kHeader + slots + e] = std::bit_cast<std::int64_t>(s[e]);
  }
  const int ranks = tokens ? tokens->size() : 1;
  const int my_rank = tokens ? tokens->rank() : 0;
  auto all = row.unsqueeze(0);
  if (ranks > 1) {
    all = torch::empty({ranks, width}, torch::kInt64);
    all_gather_into_tensor(all, row, *tokens);
  }
  const auto* a = all.data_ptr<std::int64_t>();
  for (int q = 0; q < ranks; ++q) {
    MoeInputCheck theirs{static_cast<MoeInputCheck::Kind>(a[q * width]), a[q * width + 1]};
    if (theirs.kind != MoeInputCheck::Kind::kNone)
      throw ConfigError(input_error(q, theirs, hidden));
  }
  for (int q = 1; q < ranks; ++q) {
    if (a[q * width + 3] != a[3]) {
      throw ConfigError(fmt::format(
          "MoeLayer: the ranks of the token group disagree on the capacity factor (rank 0 has "
          "{}, rank {} has {}); every rank must route with the same capacity "
          "(set_capacity_factor on every rank)",
          std::bit_cast<double>(a[3]), q, std::bit_cast<double>(a[q * width + 3])));
    }
  }

  MoeAssignment out;
  auto counts = all.narrow(1, kHeader, slots).reshape({ranks, top_k, num_experts});
  const auto totals = counts.sum(0);  // [k, E]
  for (int q = 0; q < ranks; ++q)
    out.routing.tokens += a[q * width + 2];
  const auto per_expert = totals.sum(0);
  out.routing.per_expert.assign(per_expert.data_ptr<std::int64_t>(),
                                per_expert.data_ptr<std::int64_t>() + num_experts);
  // The batch's probability sums, added in rank order: the same bits on every rank.
  out.probability_sums = torch::zeros({num_experts}, torch::kFloat64);
  auto* p = out.probability_sums.data_ptr<double>();
  for (int q = 0; q < ranks; ++q)
    for (std::int64_t e = 0; e < num_experts; ++e)
      p[e] += std::bit_cast<double>(a[q * width + kHeader + slots + e]);

  const auto T = experts.size(0);
  if (capacity_factor <= 0.0) {
    out.kept = torch::ones({T, top_k}, torch::kBool);
    return out;
  }
  out.routing.capacity = static_cast<std::int64_t>(
      std::ceil(capacity_factor * static_cast<double>(out.routing.tokens * top_k) /
                static_cast<double>(num_experts)));
  for (const auto n : out.routing.per_expert)
    out.routing.dropped += std::max<std::int64_t>(0, n - out.routing.capacity);
  // An assignment's place in its expert's queue: every rank's earlier choices, then the earlier
  // ranks' same choice, then this rank's earlier rows.
  const auto earlier_choices = totals.cumsum(0) - totals;          // [k, E]
  const auto earlier_ranks = counts.narrow(0, 0, my_rank).sum(0);  // [k, E]
  const auto base = earlier_choices + earlier_ranks;
  std::vector<torch::Tensor> kept;
  for (std::int64_t k = 0; k < top_k; ++k) {
    const auto chosen = experts.select(1, k);
    const auto one_hot = torch::one_hot(chosen, num_experts);      // [T, E]
    const auto within = (one_hot.cumsum(0) * one_hot).sum(1) - 1;  // [T]
    const auto place = base.select(0, k).index_select(0, chosen) + within;
    kept.push_back(place < out.routing.capacity);
  }
  out.kept = torch::stack(kept, 1);
  return out;
}

}  // namespace ddp::detail
