// Pipeline: construction (the model split into stages, the check that every stage was configured
// alike) and the accessors (pipeline.h). A stage's run of its schedule is in pipeline_stage.cc,
// the step in pipeline_step.cc; the schedules are in pipeline_schedule.cc, the messages between
// stages in pipeline_messages.cc.
#include "ddp/torch/parallel/pipeline/pipeline.h"

#include <algorithm>
#include <exception>
#include <numeric>
#include <utility>

#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/split_parameters.h"
#include "torch/parallel/pipeline/pipeline_state.h"

namespace ddp {

namespace {

using Clock = std::chrono::steady_clock;

// Children [first, first + count) of the whole model for each stage (interleaved: each of the
// stages x virtual_stages chunks).
std::vector<std::pair<int, int>> split_children(int children, int stages,
                                                const std::vector<int>& balance,
                                                int virtual_stages) {
  if (stages > children) {
    throw ConfigError(fmt::format(
        "Pipeline: the model has {} children but the pp group has {} stages; every stage needs at "
        "least one child: use fewer stages or a Sequential of more children",
        children, stages));
  }
  if (virtual_stages > 1 && stages * virtual_stages > children) {
    throw ConfigError(fmt::format(
        "Pipeline: the model has {} children, fewer than the {} stages x {} virtual stages = {} "
        "chunks of the interleaved schedule; every chunk needs at least one child: use fewer "
        "virtual stages or a Sequential of more children",
        children, stages, virtual_stages, stages * virtual_stages));
  }
  stages *= virtual_stages;
  std::vector<int> counts(static_cast<std::size_t>(stages));
  if (balance.empty()) {
    for (int s = 0; s < stages; ++s)
      counts[static_cast<std::size_t>(s)] = children / stages + (s < children % stages ? 1 : 0);
  } else {
    if (static_cast<int>(balance.size()) != stages) {
      throw ConfigError(fmt::format(
          "Pipeline: balance has {} entries ({}) but the pp group has {} {}; give one child "
          "count per {}",
          balance.size(), fmt::join(balance, ","), stages,
          virtual_stages > 1 ? "chunks (stages x virtual stages)" : "stages",
          virtual_stages > 1 ? "chunk" : "stage"));
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
  if ((options.schedule == PipelineSchedule::k1F1B ||
       options.schedule == PipelineSchedule::kZeroBubble) &&
      options.micro_batches < stages) {
    throw ConfigError(fmt::format(
        "Pipeline: the {} schedule needs at least as many micro-batches as stages, but "
        "micro_batches is {} with {} stages: raise micro_batches or use the gpipe schedule",
        options.schedule == PipelineSchedule::k1F1B ? "1F1B" : "zero-bubble", options.micro_batches,
        stages));
  }
  if (options.virtual_stages < 1) {
    throw ConfigError(fmt::format("Pipeline: virtual_stages is {}; it must be at least 1",
                                  options.virtual_stages));
  }
  if (options.schedule != PipelineSchedule::kInterleaved1F1B && options.virtual_stages != 1) {
    throw ConfigError(fmt::format(
        "Pipeline: virtual_stages {} needs the interleaved schedule (the {} schedule runs one "
        "chunk per rank)",
        options.virtual_stages, to_string(options.schedule)));
  }
  if (options.schedule == PipelineSchedule::kInterleaved1F1B) {
    if (stages < 2) {
      throw ConfigError(
          "Pipeline: the interleaved schedule needs at least 2 stages (it passes each micro-batch "
          "around the ranks); use 1f1b or gpipe with one stage");
    }
    if (options.micro_batches < stages || options.micro_batches % stages != 0) {
      throw ConfigError(fmt::format(
          "Pipeline: the interleaved schedule runs micro-batches in groups of the stage count, "
          "but micro_batches is {} with {} stages: use a multiple of {} micro-batches",
          options.micro_batches, stages, stages));
    }
  }
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("Pipeline: the timeout is negative ({} ms)", options.timeout.count()));
  }
}

// The groups the stage's gradients are averaged over, against what its layers need. A MoeLayer
// split over ep holds other experts than its ep peers, which are among dp_group (the
// ranks that split the batch's rows): its experts' replicas are the other dp_group ranks with its
// ep rank, |dp_group| / ep of them. With more than one, expert_dp_group must be exactly those, or
// the experts' gradients would never be averaged (each replica drifting its own way, silently),
// or averaged over the wrong ranks.
void check_gradient_groups(torch::nn::Module& stage, const PipelineOptions& options) {
  // The rest averages over dp_group (none without it): a parameter whose layer says its gradient
  // needs another number of ranks (a MoeLayer's router: its token group's) is named.
  const int replicas = options.dp_group ? options.dp_group->size() : 1;
  for (const auto& item : stage.named_parameters()) {
    const auto needs = detail::gradient_ranks_of(item.value());
    const auto part = detail::split_part_of(item.value());
    if (!needs || (part && std::string_view(part->kind) == "expert-parallel")) continue;
    if (needs->ranks != replicas) {
      throw ConfigError(fmt::format(
          "Pipeline: the parameter '{}' ({}) must have its gradient averaged over {} ranks, but "
          "PipelineOptions::dp_group has {}; pass the group of the ranks that split the batch's "
          "rows",
          item.key(), needs->what, needs->ranks, replicas));
    }
  }
  if (!options.dp_group) return;
  for (const auto& item : stage.named_modules()) {
    const auto* moe = item.value()->as<MoeLayerImpl>();
    if (moe == nullptr || !moe->ep_group() || moe->ep_group()->size() < 2) continue;
    const int ep = moe->ep_group()->size();
    const int data = options.dp_group->size();
    if (data % ep != 0) {
      throw ConfigError(fmt::format(
          "Pipeline: the MoeLayer '{}' splits its experts over {} ranks (ep), but dp_group has {} "
          "ranks, not a multiple: dp_group is the dp x ep ranks that split the batch's rows",
          item.key(), ep, data));
    }
    const int replicas = data / ep;
    if (replicas > 1 && !options.expert_dp_group) {
      throw ConfigError(fmt::format(
          "Pipeline: the MoeLayer '{}' splits its experts over {} ranks (ep) and dp_group has {}, "
          "so each expert has {} replicas, but PipelineOptions::expert_dp_group is not set: their "
          "gradients would never be averaged and the replicas would drift apart; pass the group of "
          "the ranks that hold the same experts (a mesh's \"dp\")",
          item.key(), ep, data, replicas));
    }
    if (options.expert_dp_group && options.expert_dp_group->size() != replicas) {
      throw ConfigError(fmt::format(
          "Pipeline: the MoeLayer '{}' splits its experts over {} ranks (ep) and dp_group has {}, "
          "so each expert has {} replicas, but expert_dp_group has {} ranks; pass the group of "
          "the ranks that hold the same experts (a mesh's \"dp\")",
          item.key(), ep, data, replicas, options.expert_dp_group->size()));
    }
  }
}

// The one device of a stage's parameters and buffers (the CPU when it has none), checked against
// what the pp group carries: a host group (ring, mpi) takes CPU and CUDA stages (CUDA tensors
// staged through host copies), a CUDA group (nccl) only a stage on its own GPU.
c10::Device stage_device(const torch::nn::Module& stage, const ProcessGroup& group, int rank) {
  std::optional<c10::Device> device;
  auto look = [&](const torch::Tensor& t) {
    if (!device) {
      device = t.device();
    } else if (*device != t.device()) {
      throw ConfigError(fmt::format(
          "Pipeline: stage {} holds parameters or buffers on {} and on {}; move the stage's "
          "layers to one device",
          rank, device->str(), t.device().str()));
    }
  };
  for (const auto& p : stage.parameters())
    look(p);
  for (const auto& b : stage.buffers())
    look(b);
  const c10::Device where = device.value_or(c10::Device(c10::kCPU));
  if (!where.is_cpu() && !where.is_cuda()) {
    throw ConfigError(
        fmt::format("Pipeline: stage {} is on {}; stages run on the CPU or on a CUDA device", rank,
                    where.str()));
  }
  if (group.memory_space() == MemorySpace::kCuda &&
      (!where.is_cuda() || where.index() != group.cuda_device())) {
    throw ConfigError(fmt::format(
        "Pipeline: stage {} is on {}, but its pp group ({}) carries the memory of cuda:{} only; "
        "move the stage there, or use a host group (ring, mpi), which stages CUDA tensors "
        "through host copies",
        rank, where.str(), group.backend(), group.cuda_device()));
  }
  return where;
}

std::shared_ptr<ProcessGroup> checked_group(std::shared_ptr<ProcessGroup> group) {
  if (!group) {
    throw ConfigError("Pipeline: the group is null (this rank is not a member of the pp group?)");
  }
  return group;
}

}  // namespace

void Pipeline::State::agree(const std::string& description, const std::string& local_error) {
  detail::agree_or_throw(
      *group, description, local_error,
      {.wrapper = "Pipeline",
       .member = "stage",
       .differ = "the stages were configured differently",
       .requirement = "Every rank of the pp group must pass the same model split, schedule, "
                      "micro-batch count and recomputation"});
  actions = pipeline_actions(options.schedule, stage(), stages(), options.micro_batches,
                             options.virtual_stages);
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
  if (options.expert_dp_group) {
    // Its ranks average their experts: they must hold the same ones (not be an ep group).
    std::string experts;
    for (const auto& item : module->named_modules()) {
      const auto* moe = item.value()->as<MoeLayerImpl>();
      if (moe != nullptr && moe->ep_group() && moe->ep_group()->size() > 1) {
        experts += fmt::format("MoeLayer '{}': experts [{}, +{})\n", item.key(),
                               moe->first_expert(), moe->local_experts());
      }
    }
    const auto agreement = detail::compare_across_ranks(*options.expert_dp_group, experts, "");
    if (!agreement.difference.empty()) {
      throw ConfigError(fmt::format(
          "Pipeline: the ranks of PipelineOptions::expert_dp_group hold different experts: {}. "
          "It must be the ranks that hold the same experts (a mesh's \"dp\"), not the ep ones",
          agreement.difference));
    }
  }
}

namespace {

std::string common_description(const PipelineOptions& options, int stages) {
  return fmt::format("schedule {}\nmicro-batches {}\nstages {}\nvirtual stages {}\nrecompute {}\n",
                     to_string(options.schedule), options.micro_batches, stages,
                     options.virtual_stages, options.recompute ? "on" : "off");
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
    const int chunks = st.interleaved() ? st.options.virtual_stages : 1;
    const auto ranges = split_children(children, st.stages(), st.options.balance, chunks);
    std::vector<int> counts;
    for (const auto& range : ranges)
      counts.push_back(range.second);
    description += fmt::format("model children {}\nsplit {}\n", children, fmt::join(counts, ","));
    // Chunk c of this rank is the model's chunk c x stages + stage.
    const auto names = whole_model->named_children().keys();
    for (int c = 0; c < chunks; ++c) {
      const auto range = ranges[static_cast<std::size_t>(c * st.stages() + st.stage())];
      if (c == 0) st.layer_range = range;
      torch::nn::Sequential chunk;
      for (int k = range.first; k < range.first + range.second; ++k) {
        const auto& name = names[static_cast<std::size_t>(k)];
        chunk->push_back(name, *(whole_model->begin() + k));
        st.module->push_back(name, *(whole_model->begin() + k));
      }
      st.chunks.push_back(chunk);
    }
    st.device = stage_device(*st.module, *st.group, st.stage());
    check_gradient_groups(*st.module, st.options);
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
    if (st.interleaved()) {
      throw ConfigError(
          "Pipeline: the interleaved schedule places several chunks of the model on each rank: "
          "give it the whole model (the constructor that takes it), not one stage's layers");
    }
    st.module = stage.module;
    st.chunks = {st.module};
    st.layer_range = {0, static_cast<int>(st.module->size())};
    st.device = stage_device(*st.module, *st.group, st.stage());
    check_gradient_groups(*st.module, st.options);
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

}  // namespace ddp
