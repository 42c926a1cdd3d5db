// DistributedDataParallel under ddp::Join: each step's plan agreed by the ranks, the gradient
// scale, and the hooks of a joined rank (its shadow step, the final model synchronisation).
#include <algorithm>
#include <array>
#include <cstdint>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "torch/core/host_values.h"
#include "torch/core/wrapper_phase.h"
#include "torch/ddp/distributed_data_parallel_internal.h"

namespace ddp {
namespace {

using detail::in_ddp_phase;
using detail::parameters_and_buffers;

}  // namespace

// What the reducer multiplies the averaged gradients by under a Join: averaged over the ranks
// still training instead of all (divide_by_initial_world_size false), or 1.
double DistributedDataParallelBase::join_gradient_scale(const JoinState& join,
                                                        int nonjoined) const {
  return join.options.divide_by_initial_world_size || nonjoined <= 0
             ? 1.0
             : static_cast<double>(group_->size()) / nonjoined;
}

DistributedDataParallelBase::StepPlan DistributedDataParallelBase::plan_join_step(
    bool joined, bool loaded_here) {
  std::array<std::int32_t, 6> flags{};
  if (!joined) {
    const bool sync = reducer_->require_sync();
    flags = {sync ? 1 : 0,
             sync ? 0 : 1,
             options_.broadcast_buffers && !buffers_.empty() && group_->size() > 1 ? 1 : 0,
             reducer_->rebuild_due() ? 1 : 0,
             group_->rank() + 1,
             loaded_here ? 1 : 0};
  }
  in_ddp_phase([] { return std::string("Join step agreement"); },
               [&] {
                 detail::HostValues(*group_)
                     ->allreduce(flags.data(), flags.size(), DType::kInt32, ReduceOp::kMax)
                     ->wait();
               });
  if (flags[0] != 0 && flags[1] != 0) {
    throw Error(
        "DistributedDataParallel under Join: in this step some ranks run inside no_sync() and "
        "others do not. Every rank still training must synchronise the same steps");
  }
  return StepPlan{.sync = flags[0] != 0,
                  .broadcast_buffers = flags[2] != 0,
                  .rebuild = flags[3] != 0,
                  .buffer_root = std::max(0, flags[4] - 1),
                  .loaded = flags[5] != 0};
}

void DistributedDataParallelBase::join_main_hook() {
  buffers_ = wrapped_.named_buffers().values();
  const StepPlan plan = plan_join_step(/*joined=*/true, /*loaded_here=*/false);
  if (plan.rebuild) reducer_->rebuild_buckets();
  if (plan.broadcast_buffers) broadcast_buffers_from(plan.buffer_root);
  // The gradients the shadow step leaves here (for a sharded optimizer's step) are scaled as the
  // training ranks scale theirs.
  if (const auto& join = join_state()) {
    reducer_->set_gradient_scale(join_gradient_scale(*join, join->nonjoined));
  }
  if (plan.sync) reducer_->shadow_backward();
}

void DistributedDataParallelBase::join_post_hook(bool is_last_joiner) {
  // Ranks that joined early did not step their optimizers while shadowing: every rank takes the
  // model of the (highest) rank that trained longest.
  std::int64_t root = is_last_joiner ? group_->rank() : -1;
  in_ddp_phase(
      [] { return std::string("Join's final model synchronisation"); },
      [&] {
        detail::HostValues(*group_)->allreduce(&root, 1, DType::kInt64, ReduceOp::kMax)->wait();
        std::vector<torch::Tensor> state = parameters_and_buffers(wrapped_);
        broadcast_coalesced(*group_, state, static_cast<int>(root));
      });
  reducer_->set_gradient_scale(1.0);
}

std::string DistributedDataParallelBase::join_description() const {
  return fmt::format("DistributedDataParallel({} parameters, {} buffers)",
                     wrapped_.named_parameters().size(), wrapped_.named_buffers().values().size());
}

}  // namespace ddp
