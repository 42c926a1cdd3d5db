// The pipeline schedules as lists of actions per stage (pipeline.h). Pure: no communication.
#include <algorithm>
#include <cctype>
#include <string>

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
  }
  return "unknown";
}

PipelineSchedule pipeline_schedule_from_name(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "gpipe") return PipelineSchedule::kGPipe;
  if (lower == "1f1b") return PipelineSchedule::k1F1B;
  throw ConfigError(
      fmt::format("unknown pipeline schedule '{}': the choices are gpipe and 1f1b", name));
}

// GPipe: F0 .. F(m-1), B0 .. B(m-1).
// 1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage s warms up with
// w = min(p - s - 1, m) forwards, so that the last stage starts its first backward as soon as
// its first forward is done; then m - w pairs (forward of the next micro-batch, backward of the
// oldest); then the w backwards left. A stage holds at most w + 1 <= p - s micro-batches'
// activations, against m for GPipe; the bubble is the same.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stage, int stages,
                                             int micro_batches) {
  using Kind = PipelineAction::Kind;
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
