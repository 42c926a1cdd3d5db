// Pipeline::step: every stage runs its schedule (pipeline_stage.cc) and leaves through one
// allreduce, which carries the loss and whether some stage failed; then the gradients are averaged
// over the data-parallel replicas, or the first failure is thrown on every stage.
//
// How a failure reaches every stage without a hang: a stage that fails (or hears of a failure)
// stops its schedule and sends a failure notice to both neighbours on the tags they read from it,
// so a neighbour blocked in a receive from it wakes up and does the same. A stage that is not
// waiting for the failed one still gets there: in a schedule that would have finished, every
// stage's next wait leads, through its neighbours, to the stage that stopped. Then every stage,
// failed or not, leaves the step through one allreduce (which also carries the loss), so a stage
// that had already finished its schedule learns of the failure there instead of waiting in a
// later step.
#include <exception>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "torch/core/wrapper_phase.h"
#include "torch/parallel/pipeline/pipeline_messages.h"
#include "torch/parallel/pipeline/pipeline_state.h"

namespace ddp {

void Pipeline::State::average_over_replicas(double& loss) {
  ProcessGroup& dp = *options.dp_group;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  // A parameter without a gradient keeps none, as in one process (the optimizer skips it); the
  // replicas run the same stage, so they agree on which ones (if they did not, the coalesced
  // call's sizes would differ, which the group's mismatch check names).
  // The experts of a mixture of experts differ along ep: averaged over their own replicas.
  std::set<const void*> experts;
  std::vector<torch::Tensor> expert_grads;
  for (const auto& m : module->modules()) {
    const auto* moe = m->as<MoeLayerImpl>();
    if (moe && moe->ep_group() && moe->ep_group()->size() > 1) {
      for (const auto& p : moe->expert_parameters())
        experts.insert(p.unsafeGetTensorImpl());
    }
  }
  for (auto& p : module->parameters()) {
    if (!p.grad().defined()) continue;
    (experts.contains(p.unsafeGetTensorImpl()) ? expert_grads : grads).push_back(p.grad());
  }
  // One allreduce per dtype (the coalesced form takes one dtype).
  const auto average = [](const std::vector<torch::Tensor>& tensors, ProcessGroup& group) {
    std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
    for (const auto& g : tensors)
      by_dtype[g.scalar_type()].push_back(g);
    for (auto& [dtype, same] : by_dtype) {
      all_reduce_coalesced(same, ReduceOp::kSum, group);
      for (auto& t : same)
        t.div_(group.size());
    }
  };
  average(grads, dp);
  if (options.expert_dp_group && !expert_grads.empty())
    average(expert_grads, *options.expert_dp_group);
  auto mean = torch::tensor({loss}, torch::kFloat64);
  all_reduce(mean, ReduceOp::kSum, dp);
  loss = mean.item<double>() / dp.size();
}

double Pipeline::step(const torch::Tensor& input, const torch::Tensor& target) {
  auto& st = *state_;
  if (!st.broken.empty()) {
    throw ConfigError(fmt::format(
        "Pipeline: an earlier step failed ({}); the stages' messages are out of step: build a new "
        "Pipeline (and group) to go on",
        st.broken));
  }
  ProcessGroup& group = *st.group;
  const int stage = st.stage();
  st.stats = {};
  State::Run run;
  run.start_ns = trace_clock_ns();

  // Run the schedule; on failure note where it started and whether it is a ConfigError.
  std::exception_ptr failure;
  int origin = -1;
  bool config_failure = false;
  std::string failure_text;
  try {
    st.run_schedule(run, input, target);
  } catch (const detail::PipelinePeerFailed& e) {
    failure = std::current_exception();
    origin = e.origin();
    failure_text = e.what();
  } catch (const ConfigError& e) {
    failure = std::current_exception();
    origin = stage;
    config_failure = true;
    failure_text = e.what();
  } catch (const std::exception& e) {
    failure = std::current_exception();
    origin = stage;
    failure_text = e.what();
  }
  // Until the final allreduce below has finished, unless the step failed.
  st.stats.wall = std::chrono::nanoseconds(trace_clock_ns() - run.start_ns);
  if (failure) {
    // Interleaved, the ring closes: rank 0 also reads from the last rank and the reverse.
    if (stage > 0 || st.interleaved())
      detail::send_pipeline_failure(group, st.previous_rank(), kPipelineGradientTag, origin,
                                    st.options.timeout);
    if (!st.last() || st.interleaved())
      detail::send_pipeline_failure(group, st.next_rank(), kPipelineActivationTag, origin,
                                    st.options.timeout);
    run.stored.clear();
    st.broken = failure_text;
  }

  // Every stage leaves through this allreduce: whether some stage failed, and the loss.
  auto summary = torch::tensor({failure ? 1.0 : 0.0, st.last() ? run.loss : 0.0}, torch::kFloat64);
  try {
    all_reduce(summary, ReduceOp::kSum, group);
  } catch (...) {
    if (failure) std::rethrow_exception(failure);
    st.broken = "the step's final allreduce failed";
    throw;
  }
  const auto* words = summary.data_ptr<double>();
  ++st.steps;
  if (words[0] == 0.0) {
    // The step ends for every stage when the last one finishes: the idle time at the end of the
    // pipeline (waiting for the stages that still run backwards) is part of the bubble.
    st.stats.wall = std::chrono::nanoseconds(trace_clock_ns() - run.start_ns);
    if (st.stats.wall.count() > 0) {
      st.stats.idle_fraction = 1.0 - static_cast<double>(st.stats.busy.count()) /
                                         static_cast<double>(st.stats.wall.count());
    }
    for (auto& send : run.sends)
      send->wait();
    double loss = words[1];
    if (options().dp_group) {
      detail::in_phase(
          detail::kPipelineCauses,
          [] { return std::string("gradient average over the data-parallel replicas"); },
          [&] { st.average_over_replicas(loss); });
    }
    return loss;
  }

  // Some stage failed: find the first stage where a failure started, and throw its error.
  std::string report;
  if (failure && origin == stage) report = (config_failure ? "C" : "E") + failure_text;
  if (failure && origin != stage) report = "P";
  std::vector<std::string> reports;
  all_gather_object(reports, report, group);
  int first = -1;
  for (std::size_t s = 0; s < reports.size() && first < 0; ++s) {
    if (!reports[s].empty() && reports[s][0] != 'P') first = static_cast<int>(s);
  }
  if (st.broken.empty()) st.broken = fmt::format("stage {} failed", first);
  if (first < 0) {
    if (failure) std::rethrow_exception(failure);
    throw Error(fmt::format("pipeline stage {}: the step failed on another stage", stage));
  }
  const auto& first_report = reports[static_cast<std::size_t>(first)];
  const std::string first_text = first_report.substr(1);
  if (first_report[0] == 'C') throw ConfigError(first_text);
  if (failure && origin == stage) std::rethrow_exception(failure);
  throw CommError(CommErrorKind::kAborted,
                  fmt::format("pipeline stage {}: the step was aborted because stage {} failed: {}",
                              stage, first, first_text),
                  "pp", fmt::format("pipeline step {}", st.steps - 1), 0, first);
}

}  // namespace ddp
