// The pipeline schedules as lists of actions per stage (pipeline.h). Pure: no communication.
#include <algorithm>
#include <cctype>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"

namespace ddp {

const char* to_string(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe:
      return "gpipe";
    case PipelineSchedule::k1F1B:
      return "1f1b";
    case PipelineSchedule::kInterleaved1F1B:
      return "interleaved";
    case PipelineSchedule::kZeroBubble:
      return "zero-bubble";
  }
  return "unknown";
}

PipelineSchedule pipeline_schedule_from_name(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "gpipe") return PipelineSchedule::kGPipe;
  if (lower == "1f1b") return PipelineSchedule::k1F1B;
  if (lower == "interleaved") return PipelineSchedule::kInterleaved1F1B;
  if (lower == "zero-bubble") return PipelineSchedule::kZeroBubble;
  throw ConfigError(fmt::format(
      "unknown pipeline schedule '{}': the choices are gpipe, 1f1b, interleaved and zero-bubble",
      name));
}

namespace {

// Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving): the m x v chunk
// passes of a rank in groups of p micro-batches: chunk 0 of micro-batches 0..p-1, chunk 1 of the
// same, ..., then the next p micro-batches; backwards the same with the chunks in reverse. Rank s
// runs 2 (p - s - 1) + (v - 1) p forwards first, then one forward and one backward, then the
// backwards left. Every rank passes the units in the same order, so each message (sent
// asynchronously) is the next one its receiver waits for.
std::vector<PipelineAction> interleaved_actions(int stage, int stages, int micro_batches,
                                                int virtual_stages) {
  using Kind = PipelineAction::Kind;
  const int p = stages, v = virtual_stages;
  const int units = micro_batches * v;
  const auto unit = [&](Kind kind, int k) {
    const int chunk_in_order = (k / p) % v;
    const int micro_batch = (k / (p * v)) * p + k % p;
    return PipelineAction{kind, micro_batch,
                          kind == Kind::kForward ? chunk_in_order : v - 1 - chunk_in_order};
  };
  const int warmup = std::min((p - stage - 1) * 2 + (v - 1) * p, units);
  std::vector<PipelineAction> actions;
  actions.reserve(2 * static_cast<std::size_t>(units));
  for (int k = 0; k < warmup; ++k)
    actions.push_back(unit(Kind::kForward, k));
  for (int k = 0; k < units - warmup; ++k) {
    actions.push_back(unit(Kind::kForward, warmup + k));
    actions.push_back(unit(Kind::kBackward, k));
  }
  for (int k = units - warmup; k < units; ++k)
    actions.push_back(unit(Kind::kBackward, k));
  return actions;
}

// ZB-H1: every stage simulated with F = B = W = 1 and no message time. At each decision the
// stage that can start soonest acts (so what it knows is all that has finished by then): a B whose
// gradient is there, else an F whose input is there and that keeps at most p - s micro-batches
// held (F done minus W done), else a W pending since its B; with none of them possible now, the
// earliest B or F. The W's fill the waits of 1F1B's ends, and B, half a backward, hands the
// gradient on sooner.
std::vector<PipelineAction> zero_bubble_actions(int stage, int stages, int micro_batches) {
  using Kind = PipelineAction::Kind;
  constexpr double kNever = std::numeric_limits<double>::infinity();
  const int p = stages, m = micro_batches;
  struct Stage {
    double time = 0;
    int forwards = 0, backwards = 0, weights = 0;
    std::deque<int> pending;  // micro-batches whose B ran and W did not
    std::vector<PipelineAction> actions;
  };
  const auto index = [](int i) { return static_cast<std::size_t>(i); };
  std::vector<Stage> st(index(p));
  std::vector<std::vector<double>> forward_done(index(p), std::vector<double>(index(m), kNever));
  auto backward_done = forward_done;
  for (int left = 3 * p * m; left > 0; --left) {
    int best = -1;
    Kind best_kind = Kind::kForward;
    double best_start = kNever;
    for (int s = 0; s < p; ++s) {
      const auto& x = st[index(s)];
      double b = kNever, f = kNever;
      if (x.backwards < x.forwards) {
        b = s == p - 1 ? forward_done[index(s)][index(x.backwards)]
                       : backward_done[index(s + 1)][index(x.backwards)];
      }
      if (x.forwards < m && x.forwards - x.weights < p - s) {
        f = s == 0 ? 0.0 : forward_done[index(s - 1)][index(x.forwards)];
      }
      Kind kind = Kind::kForward;
      double start = x.time;
      if (b <= x.time) {
        kind = Kind::kBackward;
      } else if (f <= x.time) {
        kind = Kind::kForward;
      } else if (!x.pending.empty()) {
        kind = Kind::kWeight;
      } else if (std::min(b, f) < kNever) {
        kind = b <= f ? Kind::kBackward : Kind::kForward;
        start = std::min(b, f);
      } else {
        continue;
      }
      if (start < best_start) best = s, best_kind = kind, best_start = start;
    }
    if (best < 0) break;  // cannot happen: some stage can always act until every action ran
    auto& x = st[index(best)];
    x.time = best_start + 1.0;
    if (best_kind == Kind::kForward) {
      forward_done[index(best)][index(x.forwards)] = x.time;
      x.actions.push_back({Kind::kForward, x.forwards++});
    } else if (best_kind == Kind::kBackward) {
      backward_done[index(best)][index(x.backwards)] = x.time;
      x.pending.push_back(x.backwards);
      x.actions.push_back({Kind::kBackward, x.backwards++});
    } else {
      x.actions.push_back({Kind::kWeight, x.pending.front()});
      x.pending.pop_front();
      ++x.weights;
    }
  }
  return st[index(stage)].actions;
}

}  // namespace

// GPipe: F0 .. F(m-1), B0 .. B(m-1).
// 1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage s warms up with
// w = min(p - s - 1, m) forwards, so that the last stage starts its first backward as soon as
// its first forward is done; then m - w pairs (forward of the next micro-batch, backward of the
// oldest); then the w backwards left. A stage holds at most w + 1 <= p - s micro-batches'
// activations, against m for GPipe; the bubble is the same.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stage, int stages,
                                             int micro_batches, int virtual_stages) {
  using Kind = PipelineAction::Kind;
  if (schedule == PipelineSchedule::kInterleaved1F1B) {
    return interleaved_actions(stage, stages, micro_batches, std::max(virtual_stages, 1));
  }
  if (schedule == PipelineSchedule::kZeroBubble) {
    if (micro_batches < 1 || stage < 0 || stage >= stages) return {};
    return zero_bubble_actions(stage, stages, micro_batches);
  }
  std::vector<PipelineAction> actions;
  actions.reserve(2 * static_cast<std::size_t>(std::max(micro_batches, 0)));
  if (schedule == PipelineSchedule::kGPipe) {
    for (int i = 0; i < micro_batches; ++i)
      actions.push_back({Kind::kForward, i});
    for (int i = 0; i < micro_batches; ++i)
      actions.push_back({Kind::kBackward, i});
    return actions;
  }
  const int warmup = std::clamp(stages - stage - 1, 0, micro_batches);
  for (int i = 0; i < warmup; ++i)
    actions.push_back({Kind::kForward, i});
  for (int i = 0; i < micro_batches - warmup; ++i) {
    actions.push_back({Kind::kForward, warmup + i});
    actions.push_back({Kind::kBackward, i});
  }
  for (int i = micro_batches - warmup; i < micro_batches; ++i)
    actions.push_back({Kind::kBackward, i});
  return actions;
}

}  // namespace ddp
