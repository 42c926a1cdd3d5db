// Names the wrapper's phase, and the likely causes, in errors that come from a collective.
//
// A CommError from the engine names the collective ("broadcast(int64 x 1, root 0) #46"); a user
// needs to know which part of DDP, ZeRO or FSDP issued it ("gradient bucket 3 of 7 (parameters
// fc1.weight … fc2.bias)") and, for a mismatch or a timeout, what usually causes one in that
// wrapper (ranks that ran different numbers of steps, a forward on one rank only). in_phase runs
// `body` and rethrows CommError and TimeoutError with the wrapper and phase in front of the
// message and the causes behind it, keeping the type and the CommError's fields.
#pragma once

#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"

namespace ddp::detail {

// What the wrapper is called in messages, and what usually makes its ranks disagree.
struct WrapperCauses {
  std::string_view wrapper;
  std::string_view causes;
};

inline constexpr WrapperCauses kDdpCauses{
    "DistributedDataParallel",
    "the ranks ran different numbers of training steps (uneven data: wrap the loop in ddp::Join, "
    "or let the DistributedSampler pad), a training-mode forward ran on some ranks only (evaluate "
    "after model->eval(), or on every rank), or the ranks built different models or DdpOptions"};
inline constexpr WrapperCauses kZeroCauses{
    "ZeroRedundancyOptimizer",
    "the ranks called step() a different number of times (uneven data: ddp::Join with the "
    "optimizer as a joinable), or consolidate_state_dict() ran on some ranks only"};
inline constexpr WrapperCauses kFsdpCauses{
    "FullyShardedDataParallel",
    "the ranks ran different numbers of forwards or backwards (FSDP's forward is collective: "
    "evaluate on every rank, and give every rank the same number of batches)"};

inline constexpr WrapperCauses kPipelineCauses{
    "Pipeline",
    "the data-parallel replicas ran different numbers of steps, or a replica's pipeline failed "
    "(its own error names the stage)"};

// `phase` is called only when there is an error (building the text may cost).
template <typename Body, typename Phase>
decltype(auto) in_phase(const WrapperCauses& where, Phase&& phase, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (const CommError& e) {
    const bool disagreement =
        e.kind() == CommErrorKind::kMismatch || e.kind() == CommErrorKind::kTimeout;
    throw CommError(e.kind(),
                    fmt::format("{}, {}: {}{}", where.wrapper, phase(), e.what(),
                                disagreement ? fmt::format(". Likely causes: {}", where.causes)
                                             : std::string()),
                    e.group(), e.op(), e.sequence(), e.peer());
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}, {}: {}. If no rank failed, likely causes: {}",
                                   where.wrapper, phase(), e.what(), where.causes));
  }
}

template <typename Body, typename Phase>
decltype(auto) in_ddp_phase(Phase&& phase, Body&& body) {
  return in_phase(kDdpCauses, std::forward<Phase>(phase), std::forward<Body>(body));
}

}  // namespace ddp::detail
