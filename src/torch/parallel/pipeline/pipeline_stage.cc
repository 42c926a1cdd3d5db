// Pipeline: a stage's run of its schedule in one step: the micro-batches, each action's forward
// (or, recomputing, its replay) and backward, the messages to the neighbouring stages, and the
// timings of the step's stats.
#include <algorithm>
#include <mutex>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "torch/parallel/pipeline/pipeline_messages.h"
#include "torch/parallel/pipeline/pipeline_state.h"

namespace ddp {

namespace {

using Kind = PipelineAction::Kind;

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

void Pipeline::State::record(Run& run, PipelineAction action, std::int64_t begin_ns,
                             std::int64_t end_ns) {
  stats.timings.push_back({action, std::chrono::nanoseconds(begin_ns - run.start_ns),
                           std::chrono::nanoseconds(end_ns - run.start_ns)});
  stats.busy += std::chrono::nanoseconds(end_ns - begin_ns);
  if (trace_enabled()) {
    trace_complete(action.kind == Kind::kForward    ? "pipeline forward"
                   : action.kind == Kind::kBackward ? "pipeline backward"
                                                    : "pipeline weight gradient",
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

void Pipeline::State::forward(Run& run, int micro_batch, int chunk) {
  const auto i = static_cast<std::size_t>(micro_batch);
  const bool first = first_chunk(chunk), final = last_chunk(chunk);
  StoredMicroBatch kept;
  if (first) {
    kept.input = run.inputs[i];
  } else {
    kept.input =
        detail::recv_pipeline_tensor(*group, previous_rank(), kPipelineActivationTag,
                                     message_id(chunk, micro_batch), options.timeout, device);
  }
  const auto begin_ns = trace_clock_ns();
  torch::Tensor output;
  if (options.recompute) {
    kept.rng_state = cpu_rng_state();
    torch::NoGradGuard no_grad;
    output = stage_forward(chunk, kept.input);
    if (final) run.loss += scaled_loss(output, run.targets[i]).item<double>();
  } else {
    if (!first) kept.input.requires_grad_(true);
    output = stage_forward(chunk, kept.input);
    if (final) {
      kept.loss = scaled_loss(output, run.targets[i]);
      run.loss += kept.loss.item<double>();
    } else {
      kept.output = output;
    }
  }
  const auto end_ns = trace_clock_ns();
  run.stored.emplace(message_id(chunk, micro_batch), std::move(kept));
  stats.peak_stored_activations =
      std::max(stats.peak_stored_activations, static_cast<int>(run.stored.size()));
  record(run, {Kind::kForward, micro_batch, chunk}, begin_ns, end_ns);
  if (!final) {
    // The next rank's chunk: the same one, or (from the last rank) the next one.
    const int next_chunk = last() ? chunk + 1 : chunk;
    run.sends.push_back(
        detail::send_pipeline_tensor(*group, output, next_rank(), kPipelineActivationTag,
                                     message_id(next_chunk, micro_batch), options.timeout));
  }
}

void Pipeline::State::backward(Run& run, int micro_batch, int chunk) {
  const bool first = first_chunk(chunk), final = last_chunk(chunk);
  const auto stored = run.stored.find(message_id(chunk, micro_batch));
  auto& kept = stored->second;
  torch::Tensor output_grad;
  if (!final) {
    output_grad =
        detail::recv_pipeline_tensor(*group, next_rank(), kPipelineGradientTag,
                                     message_id(chunk, micro_batch), options.timeout, device);
  }
  const auto begin_ns = trace_clock_ns();
  if (options.recompute && !first) {
    kept.input = kept.input.detach().requires_grad_(true);
  }
  if (options.recompute) {
    const auto current_rng = cpu_rng_state();
    set_cpu_rng_state(kept.rng_state);
    auto output = stage_forward(chunk, kept.input);
    set_cpu_rng_state(current_rng);
    if (final) {
      kept.loss = scaled_loss(output, run.targets[static_cast<std::size_t>(micro_batch)]);
    } else {
      kept.output = output;
    }
  }
  if (!final && output_grad.sizes() != kept.output.sizes()) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: the gradient of micro-batch {} from stage {} has shape {} but the "
        "activation sent has shape {}",
        stage(), micro_batch, next_rank(), fmt::join(output_grad.sizes(), "x"),
        fmt::join(kept.output.sizes(), "x")));
  }
  torch::Tensor input_grad;
  if (split_backward()) {
    // The input half now (what the previous stage waits for); the weight half at its W.
    kept.split = std::make_shared<detail::SplitBackward>();
    const auto& out = final ? kept.loss : kept.output;
    if (out.requires_grad()) {
      input_grad =
          kept.split->backward_input(out, final ? torch::Tensor() : output_grad, kept.input,
                                     chunks[static_cast<std::size_t>(chunk)]->parameters());
    }
    // Stage 0's input leaves (the input requires grad): their gradients as a whole backward
    // leaves them, for backward_into_input.
    if (first && input_grad.defined()) kept.input.mutable_grad() = input_grad;
  } else if (final) {
    kept.loss.backward();
  } else if (kept.output.requires_grad()) {
    // A stage whose output does not depend on anything that requires grad has nothing to do.
    kept.output.backward(output_grad);
  }
  const auto end_ns = trace_clock_ns();
  record(run, {Kind::kBackward, micro_batch, chunk}, begin_ns, end_ns);
  const auto input = kept.input;
  if (!split_backward()) {
    input_grad = input.grad();
    run.stored.erase(stored);  // `kept` goes with it
  }
  if (!first) {
    if (!input_grad.defined()) input_grad = torch::zeros_like(input);
    // The previous rank's chunk: the same one, or (to the last rank) the one before.
    const int previous_chunk = stage() == 0 ? chunk - 1 : chunk;
    run.sends.push_back(
        detail::send_pipeline_tensor(*group, input_grad, previous_rank(), kPipelineGradientTag,
                                     message_id(previous_chunk, micro_batch), options.timeout));
  }
}

void Pipeline::State::backward_weight(Run& run, int micro_batch, int chunk) {
  auto node = run.stored.extract(message_id(chunk, micro_batch));
  const auto begin_ns = trace_clock_ns();
  node.mapped().split->backward_weight();
  record(run, {Kind::kWeight, micro_batch, chunk}, begin_ns, trace_clock_ns());
}

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
      forward(run, action.micro_batch, action.chunk);
    } else if (action.kind == Kind::kBackward) {
      backward(run, action.micro_batch, action.chunk);
    } else {
      backward_weight(run, action.micro_batch, action.chunk);
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

}  // namespace ddp
