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

namespace ddp {

struct Pipeline::State {
  // What a stage keeps of a micro-batch between its forward and its backward.
  struct StoredMicroBatch {
    torch::Tensor input;      // the stage's input (a leaf that requires grad past stage 0)
    torch::Tensor output;     // with its autograd graph (not kept when recomputing)
    torch::Tensor loss;       // last stage: loss / m with its graph (not kept when recomputing)
    torch::Tensor rng_state;  // recomputing: the CPU generator's state before the forward
  };

  std::shared_ptr<ProcessGroup> group;
  PipelineLossFn loss;
  PipelineOptions options;
  torch::nn::Sequential module;
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

}  // namespace ddp
