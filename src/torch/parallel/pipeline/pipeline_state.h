// Private to the Pipeline's sources (pipeline.cc, pipeline_stage.cc, pipeline_step.cc): the state
// behind Pipeline (pipeline.h).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/comm/work.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "torch/parallel/pipeline/split_backward.h"

namespace ddp {

struct Pipeline::State {
  // What a stage keeps of a micro-batch between its forward and its backward.
  struct StoredMicroBatch {
    torch::Tensor input;      // the stage's input (a leaf that requires grad past stage 0)
    torch::Tensor output;     // with its autograd graph (not kept when recomputing)
    torch::Tensor loss;       // last stage: loss / m with its graph (not kept when recomputing)
    torch::Tensor rng_state;  // recomputing: the CPU generator's state before the forward
    // Zero-bubble: the backward's weight half, pending after its input half.
    std::shared_ptr<detail::SplitBackward> split;
  };

  std::shared_ptr<ProcessGroup> group;
  PipelineLossFn loss;
  PipelineOptions options;
  torch::nn::Sequential module;  // every layer of this rank (interleaved: every chunk's)
  // The rank's model chunks, in chunk order: {module} but for the interleaved schedule.
  std::vector<torch::nn::Sequential> chunks;
  // Where this stage's parameters live: activations and gradients arrive there (stage_device()).
  c10::Device device{c10::kCPU};
  std::pair<int, int> layer_range{0, 0};
  std::vector<PipelineAction> actions;
  PipelineStepStats stats;
  std::int64_t steps = 0;
  std::string broken;  // why steps are refused, once one failed

  int stage() const { return group->rank(); }
  int stages() const { return group->size(); }
  bool last() const { return stage() == stages() - 1; }
  bool interleaved() const { return options.schedule == PipelineSchedule::kInterleaved1F1B; }
  int chunk_count() const { return static_cast<int>(chunks.size()); }
  // Whether chunk `chunk` of this rank is the model's first / last (it takes the input / the
  // loss).
  bool first_chunk(int chunk) const { return stage() == 0 && chunk == 0; }
  bool last_chunk(int chunk) const { return last() && chunk == chunk_count() - 1; }
  // The ranks a chunk's activations come from and go to (interleaved: around the ring).
  int previous_rank() const { return (stage() + stages() - 1) % stages(); }
  int next_rank() const { return (stage() + 1) % stages(); }
  // A message's id: its micro-batch, and its chunk on the receiving rank when interleaved.
  int message_id(int chunk, int micro_batch) const {
    return chunk * options.micro_batches + micro_batch;
  }

  // One step's working state.
  struct Run {
    std::vector<torch::Tensor> inputs, targets;
    // Stage 0, when its input requires grad: the input's micro-batches as views in its graph;
    // `inputs` then holds leaves cut from them, and one backward after the schedule carries their
    // gradients into the input (backward_into_input).
    std::vector<torch::Tensor> input_views;
    std::map<int, StoredMicroBatch> stored;  // by message_id(chunk, micro-batch)
    std::vector<std::shared_ptr<Work>> sends;
    double loss = 0.0;
    std::int64_t start_ns = 0;
  };

  void agree(const std::string& description, const std::string& local_error);
  // PipelineOptions::dp_group: the gradients and `loss` averaged over the replicas.
  void average_over_replicas(double& loss);
  void run_schedule(Run& run, const torch::Tensor& input, const torch::Tensor& target);
  void forward(Run& run, int micro_batch, int chunk);
  void backward(Run& run, int micro_batch, int chunk);
  void backward_weight(Run& run, int micro_batch, int chunk);
  bool split_backward() const { return options.schedule == PipelineSchedule::kZeroBubble; }
  void backward_into_input(Run& run);
  torch::Tensor stage_forward(int chunk, const torch::Tensor& x) {
    return chunks[static_cast<std::size_t>(chunk)]->forward(x);
  }
  torch::Tensor scaled_loss(const torch::Tensor& output, const torch::Tensor& target);
  void record(Run& run, PipelineAction action, std::int64_t begin_ns, std::int64_t end_ns);
};

}  // namespace ddp
