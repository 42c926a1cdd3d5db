#include "torch/core/recomputation.h"

#include <algorithm>
#include <mutex>

namespace ddp::detail {
namespace {

// The autograd engine runs a checkpointed node's recomputation on the thread of that backward
// pass, and a forward runs the function on the caller's: both are the thread's.
thread_local int t_recomputing = 0;
thread_local std::vector<GeneratorRecorder*> t_recorders;

}  // namespace

bool in_recomputation() {
  return t_recomputing > 0;
}

RecomputationScope::RecomputationScope() {
  ++t_recomputing;
}

RecomputationScope::~RecomputationScope() {
  --t_recomputing;
}

void note_generator_draw(const at::Generator& generator) {
  for (GeneratorRecorder* recorder : t_recorders) {
    auto& recorded = recorder->recorded_;
    const bool known = std::any_of(recorded.begin(), recorded.end(),
                                   [&](const auto& entry) { return entry.first == generator; });
    if (known) continue;
    at::Generator g = generator;
    std::lock_guard lock(g.mutex());
    recorded.emplace_back(g, g.get_state());
  }
}

GeneratorRecorder::GeneratorRecorder() {
  t_recorders.push_back(this);
}

GeneratorRecorder::~GeneratorRecorder() {
  std::erase(t_recorders, this);
}

}  // namespace ddp::detail
