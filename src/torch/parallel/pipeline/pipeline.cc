// Pipeline: the stage, the construction check and the step (pipeline.h). The schedules are in
// pipeline_schedule.cc, the messages between stages in pipeline_messages.cc.
//
// How a failure reaches every stage without a hang: a stage that fails (or hears of a failure)
// stops its schedule and sends a failure notice to both neighbours on the tags they read from it,
// so a neighbour blocked in a receive from it wakes up and does the same. A stage that is not
// waiting for the failed one still gets there: in a schedule that would have finished, every
// stage's next wait leads, through its neighbours, to the stage that stopped. Then every stage,
// failed or not, leaves the step through one allreduce (which also carries the loss), so a stage
// that had already finished its schedule learns of the failure there instead of waiting in a
// later step.
#include "ddp/torch/parallel/pipeline/pipeline.h"

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/trace.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/wrapper_phase.h"
#include "torch/parallel/pipeline/pipeline_messages.h"

namespace ddp {

namespace {

using Clock = std::chrono::steady_clock;
using Kind = PipelineAction::Kind;

// Children [first, first + count) of the whole model for each stage.
std::vector<std::pair<int, int>> split_children(int children, int stages,
                                                const std::vector<int>& balance) {
  if (stages > children) {
    throw ConfigError(fmt::format(
        "Pipeline: the model has {} children but the pp group has {} stages; every stage needs at "
        "least one child: use fewer stages or a Sequential of more children",
        children, stages));
  }
  std::vector<int> counts(static_cast<std::size_t>(stages));
  if (balance.empty()) {
    for (int s = 0; s < stages; ++s)
      counts[static_cast<std::size_t>(s)] = children / stages + (s < children % stages ? 1 : 0);
  } else {
    if (static_cast<int>(balance.size()) != stages) {
      throw ConfigError(fmt::format(
          "Pipeline: balance has {} entries ({}) but the pp group has {} stages; give one child "
          "count per stage",
          balance.size(), fmt::join(balance, ","), stages));
    }
    const int sum = std::accumulate(balance.begin(), balance.end(), 0);
    if (sum != children || *std::min_element(balance.begin(), balance.end()) < 1) {
      throw ConfigError(fmt::format(
          "Pipeline: balance {} must give every stage at least one child and add up to the "
          "model's {} children (it adds up to {})",
          fmt::join(balance, ","), children, sum));
    }
    counts = balance;
  }
  std::vector<std::pair<int, int>> ranges;
  int first = 0;
  for (const int count : counts) {
    ranges.emplace_back(first, count);
    first += count;
  }
  return ranges;
}

void check_options(const PipelineOptions& options, int stages) {
  if (options.micro_batches < 1) {
    throw ConfigError(
        fmt::format("Pipeline: micro_batches is {}; it must be at least 1", options.micro_batches));
  }
  if (options.schedule == PipelineSchedule::k1F1B && options.micro_batches < stages) {
    throw ConfigError(fmt::format(
        "Pipeline: the 1F1B schedule needs at least as many micro-batches as stages, but "
        "micro_batches is {} with {} stages: raise micro_batches or use the gpipe schedule",
        options.micro_batches, stages));
  }
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("Pipeline: the timeout is negative ({} ms)", options.timeout.count()));
  }
}

std::shared_ptr<ProcessGroup> checked_group(std::shared_ptr<ProcessGroup> group) {
  if (!group) {
    throw ConfigError("Pipeline: the group is null (this rank is not a member of the pp group?)");
  }
  return group;
}

// The CPU generator's state, to run a forward again with the random draws of its first run.
torch::Tensor cpu_rng_state() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_cpu_rng_state(const torch::Tensor& state) {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

// What a stage keeps of a micro-batch between its forward and its backward.
struct StoredMicroBatch {
  torch::Tensor input;      // the stage's input (a leaf that requires grad past stage 0)
  torch::Tensor output;     // with its autograd graph (not kept when recomputing)
  torch::Tensor loss;       // last stage: loss / m with its graph (not kept when recomputing)
  torch::Tensor rng_state;  // recomputing: the CPU generator's state before the forward
};

}  // namespace

struct Pipeline::State {
  std::shared_ptr<ProcessGroup> group;
  PipelineLossFn loss;
  PipelineOptions options;
  torch::nn::Sequential module;
  std::pair<int, int> layer_range{0, 0};
  std::vector<PipelineAction> actions;
  PipelineStepStats stats;
  std::int64_t steps = 0;
  std::string broken;  // why steps are refused, once one failed

  int stage() const { return group->rank(); }
  int stages() const { return group->size(); }
  bool last() const { return stage() == stages() - 1; }

  // One step's working state.
  struct Run {
    std::vector<torch::Tensor> inputs, targets;
    // Stage 0, when its input requires grad: the input's micro-batches as views in its graph;
    // `inputs` then holds leaves cut from them, and one backward after the schedule carries their
    // gradients into the input (backward_into_input).
    std::vector<torch::Tensor> input_views;
    std::map<int, StoredMicroBatch> stored;
    std::vector<std::shared_ptr<Work>> sends;
    double loss = 0.0;
    std::int64_t start_ns = 0;
  };

  void agree(const std::string& description, const std::string& local_error);
  // PipelineOptions::dp_group: the gradients and `loss` averaged over the replicas.
  void average_over_replicas(double& loss);
  void run_schedule(Run& run, const torch::Tensor& input, const torch::Tensor& target);
  void forward(Run& run, int micro_batch);
  void backward(Run& run, int micro_batch);
  void backward_into_input(Run& run);
  torch::Tensor stage_forward(const torch::Tensor& x) { return module->forward(x); }
  torch::Tensor scaled_loss(const torch::Tensor& output, const torch::Tensor& target);
  void record(Run& run, PipelineAction action, std::int64_t begin_ns, std::int64_t end_ns);
};

void Pipeline::State::agree(const std::string& description, const std::string& local_error) {
  detail::agree_or_throw(
      *group, description, local_error,
      {.wrapper = "Pipeline",
       .member = "stage",
       .differ = "the stages were configured differently",
       .requirement = "Every rank of the pp group must pass the same model split, schedule, "
                      "micro-batch count and recomputation"});
  actions = pipeline_actions(options.schedule, stage(), stages(), options.micro_batches);
  if (options.dp_group) {
    // The replicas of this stage average their gradients: they must hold the same layers.
    std::string replica = fmt::format("stage {} of {}\nlayers [{}, +{})\n", stage(), stages(),
                                      layer_range.first, layer_range.second);
    for (const auto& item : module->named_parameters())
      replica += item.key() + " " + detail::shape_text(item.value()) + "\n";
    const auto agreement = detail::compare_across_ranks(*options.dp_group, replica, "");
    if (!agreement.difference.empty()) {
      throw ConfigError(fmt::format(
          "Pipeline: the data-parallel replicas of this stage differ: {}. Every rank of "
          "PipelineOptions::dp_group must hold the same stage of the same model",
          agreement.difference));
    }
  }
}

void Pipeline::State::average_over_replicas(double& loss) {
  ProcessGroup& dp = *options.dp_group;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  // A parameter without a gradient keeps none, as in one process (the optimizer skips it); the
  // replicas run the same stage, so they agree on which ones (if they did not, the coalesced
  // call's sizes would differ, which the group's mismatch check names).
  for (auto& p : module->parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  // One allreduce per dtype (the coalesced form takes one dtype).
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;
  for (const auto& g : grads)
    by_dtype[g.scalar_type()].push_back(g);
  for (auto& [dtype, tensors] : by_dtype) {
    all_reduce_coalesced(tensors, ReduceOp::kSum, dp);
    for (auto& t : tensors)
      t.div_(dp.size());
  }
  auto mean = torch::tensor({loss}, torch::kFloat64);
  all_reduce(mean, ReduceOp::kSum, dp);
  loss = mean.item<double>() / dp.size();
}

namespace {

std::string common_description(const PipelineOptions& options, int stages) {
  return fmt::format("schedule {}\nmicro-batches {}\nstages {}\nrecompute {}\n",
                     to_string(options.schedule), options.micro_batches, stages,
                     options.recompute ? "on" : "off");
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential whole_model, std::shared_ptr<ProcessGroup> group,
                   PipelineLossFn loss, PipelineOptions options)
    : state_(std::make_unique<State>()) {
  auto& st = *state_;
  st.group = checked_group(std::move(group));
  st.loss = std::move(loss);
  st.options = std::move(options);
  std::string description = common_description(st.options, st.stages());
  std::string local_error;
  try {
    if (whole_model.is_empty()) throw ConfigError("Pipeline: the model is an empty holder");
    if (!st.loss) throw ConfigError("Pipeline: no loss function");
    check_options(st.options, st.stages());
    const int children = static_cast<int>(whole_model->size());
    const auto ranges = split_children(children, st.stages(), st.options.balance);
    std::vector<int> counts;
    for (const auto& range : ranges)
      counts.push_back(range.second);
    description += fmt::format("model children {}\nsplit {}\n", children, fmt::join(counts, ","));
    st.layer_range = ranges[static_cast<std::size_t>(st.stage())];
    const auto names = whole_model->named_children().keys();
    for (int k = st.layer_range.first; k < st.layer_range.first + st.layer_range.second; ++k) {
      st.module->push_back(names[static_cast<std::size_t>(k)], *(whole_model->begin() + k));
    }
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  st.agree(description, local_error);
}

Pipeline::Pipeline(PipelineStageModule stage, std::shared_ptr<ProcessGroup> group,
                   PipelineLossFn loss, PipelineOptions options)
    : state_(std::make_unique<State>()) {
  auto& st = *state_;
  st.group = checked_group(std::move(group));
  st.loss = std::move(loss);
  st.options = std::move(options);
  std::string local_error;
  try {
    if (stage.module.is_empty() || stage.module->size() == 0) {
      throw ConfigError(fmt::format("Pipeline: stage {}'s module has no layers", st.stage()));
    }
    if (!st.loss) throw ConfigError("Pipeline: no loss function");
    check_options(st.options, st.stages());
    st.module = stage.module;
    st.layer_range = {0, static_cast<int>(st.module->size())};
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  st.agree(common_description(st.options, st.stages()), local_error);
}

Pipeline::~Pipeline() = default;

int Pipeline::stage() const {
  return state_->stage();
}
int Pipeline::num_stages() const {
  return state_->stages();
}
std::pair<int, int> Pipeline::layer_range() const {
  return state_->layer_range;
}
torch::nn::Sequential& Pipeline::stage_module() {
  return state_->module;
}
std::vector<torch::Tensor> Pipeline::parameters() const {
  return state_->module->parameters();
}
const PipelineOptions& Pipeline::options() const {
  return state_->options;
}
const PipelineStepStats& Pipeline::last_step_stats() const {
  return state_->stats;
}

void Pipeline::State::record(Run& run, PipelineAction action, std::int64_t begin_ns,
                             std::int64_t end_ns) {
  stats.timings.push_back({action, std::chrono::nanoseconds(begin_ns - run.start_ns),
                           std::chrono::nanoseconds(end_ns - run.start_ns)});
  stats.busy += std::chrono::nanoseconds(end_ns - begin_ns);
  if (trace_enabled()) {
    trace_complete(action.kind == Kind::kForward ? "pipeline forward" : "pipeline backward",
                   "pipeline", trace_thread_lane(), begin_ns, end_ns,
                   {{"stage", stage()}, {"micro_batch", action.micro_batch}, {"step", steps}});
  }
}

torch::Tensor Pipeline::State::scaled_loss(const torch::Tensor& output,
                                           const torch::Tensor& target) {
  if (output.dim() == 0 || target.dim() == 0 || output.size(0) != target.size(0)) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: the model's output has shape {} but the target micro-batch has shape "
        "{}; they must have the same rows (dim 0)",
        stage(), fmt::join(output.sizes(), "x"), fmt::join(target.sizes(), "x")));
  }
  auto loss_value = loss(output, target);
  if (!loss_value.defined() || loss_value.numel() != 1) {
    throw ConfigError(
        fmt::format("pipeline stage {}: the loss function must return a scalar (the mean over the "
                    "micro-batch), not a tensor of {} elements",
                    stage(), loss_value.defined() ? loss_value.numel() : 0));
  }
  return loss_value.reshape({}) / options.micro_batches;
}

void Pipeline::State::forward(Run& run, int micro_batch) {
  const auto i = static_cast<std::size_t>(micro_batch);
  StoredMicroBatch kept;
  if (stage() == 0) {
    kept.input = run.inputs[i];
  } else {
    kept.input = detail::recv_pipeline_tensor(*group, stage() - 1, kPipelineActivationTag,
                                              micro_batch, options.timeout);
  }
  const auto begin_ns = trace_clock_ns();
  torch::Tensor output;
  if (options.recompute) {
    kept.rng_state = cpu_rng_state();
    torch::NoGradGuard no_grad;
    output = stage_forward(kept.input);
    if (last()) run.loss += scaled_loss(output, run.targets[i]).item<double>();
  } else {
    if (stage() > 0) kept.input.requires_grad_(true);
    output = stage_forward(kept.input);
    if (last()) {
      kept.loss = scaled_loss(output, run.targets[i]);
      run.loss += kept.loss.item<double>();
    } else {
      kept.output = output;
    }
  }
  const auto end_ns = trace_clock_ns();
  run.stored.emplace(micro_batch, std::move(kept));
  stats.peak_stored_activations =
      std::max(stats.peak_stored_activations, static_cast<int>(run.stored.size()));
  record(run, {Kind::kForward, micro_batch}, begin_ns, end_ns);
  if (!last()) {
    run.sends.push_back(detail::send_pipeline_tensor(
        *group, output, stage() + 1, kPipelineActivationTag, micro_batch, options.timeout));
  }
}

void Pipeline::State::backward(Run& run, int micro_batch) {
  auto node = run.stored.extract(micro_batch);
  auto& kept = node.mapped();
  torch::Tensor output_grad;
  if (!last()) {
    output_grad = detail::recv_pipeline_tensor(*group, stage() + 1, kPipelineGradientTag,
                                               micro_batch, options.timeout);
  }
  const auto begin_ns = trace_clock_ns();
  if (options.recompute && stage() > 0) {
    kept.input = kept.input.detach().requires_grad_(true);
  }
  if (options.recompute) {
    const auto current_rng = cpu_rng_state();
    set_cpu_rng_state(kept.rng_state);
    auto output = stage_forward(kept.input);
    set_cpu_rng_state(current_rng);
    if (last()) {
      kept.loss = scaled_loss(output, run.targets[static_cast<std::size_t>(micro_batch)]);
    } else {
      kept.output = output;
    }
  }
  if (last()) {
    kept.loss.backward();
  } else {
    if (output_grad.sizes() != kept.output.sizes()) {
      throw ConfigError(fmt::format(
          "pipeline stage {}: the gradient of micro-batch {} from stage {} has shape {} but the "
          "activation sent has shape {}",
          stage(), micro_batch, stage() + 1, fmt::join(output_grad.sizes(), "x"),
          fmt::join(kept.output.sizes(), "x")));
    }
    // A stage whose output does not depend on anything that requires grad has nothing to do.
    if (kept.output.requires_grad()) kept.output.backward(output_grad);
  }
  const auto end_ns = trace_clock_ns();
  record(run, {Kind::kBackward, micro_batch}, begin_ns, end_ns);
  if (stage() > 0) {
    auto input_grad = kept.input.grad();
    if (!input_grad.defined()) input_grad = torch::zeros_like(kept.input);
    run.sends.push_back(detail::send_pipeline_tensor(
        *group, input_grad, stage() - 1, kPipelineGradientTag, micro_batch, options.timeout));
  }
}

namespace {

// `batch` split into `parts` equal chunks along dim 0; `what` names it ("input", "target").
std::vector<torch::Tensor> micro_batches_of(const torch::Tensor& batch, int parts, int stage,
                                            const char* what) {
  if (!batch.defined() || batch.dim() == 0) {
    throw ConfigError(
        fmt::format("pipeline stage {}: the {} is {}; stage {} needs a batch (rows along dim 0)",
                    stage, what, batch.defined() ? "a scalar" : "undefined", stage));
  }
  if (batch.size(0) % parts != 0) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: the {} batch has {} rows, which do not divide into {} micro-batches; "
        "use a batch size that is a multiple of micro_batches",
        stage, what, batch.size(0), parts));
  }
  return batch.split(batch.size(0) / parts);
}

}  // namespace

void Pipeline::State::run_schedule(Run& run, const torch::Tensor& input,
                                   const torch::Tensor& target) {
  const int m = options.micro_batches;
  if (stage() == 0) {
    run.inputs = micro_batches_of(input, m, stage(), "input");
    if (input.requires_grad() && torch::GradMode::is_enabled()) {
      // Backpropagating each micro-batch through its view of the input would materialise an
      // input-sized gradient per micro-batch (the split's backward fills the other parts with
      // zeros) and run the graph before the input m times (which frees it after the first):
      // the stage works on leaves instead, and the input gets one backward at the end.
      run.input_views = std::move(run.inputs);
      for (const auto& view : run.input_views)
        run.inputs.push_back(view.detach().requires_grad_(true));
    }
  }
  if (last()) run.targets = micro_batches_of(target, m, stage(), "target");
  for (const auto& action : actions) {
    if (action.kind == Kind::kForward) {
      forward(run, action.micro_batch);
    } else {
      backward(run, action.micro_batch);
    }
  }
  if (!run.input_views.empty()) backward_into_input(run);
}

void Pipeline::State::backward_into_input(Run& run) {
  const auto begin_ns = trace_clock_ns();
  std::vector<torch::Tensor> grads;
  grads.reserve(run.inputs.size());
  for (const auto& leaf : run.inputs)
    grads.push_back(leaf.grad().defined() ? leaf.grad() : torch::zeros_like(leaf));
  torch::autograd::backward(run.input_views, grads);
  // Stage work, but of no micro-batch: busy time without an entry in `timings`.
  stats.busy += std::chrono::nanoseconds(trace_clock_ns() - begin_ns);
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
    if (stage > 0)
      detail::send_pipeline_failure(group, stage - 1, kPipelineGradientTag, origin,
                                    st.options.timeout);
    if (!st.last())
      detail::send_pipeline_failure(group, stage + 1, kPipelineActivationTag, origin,
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
