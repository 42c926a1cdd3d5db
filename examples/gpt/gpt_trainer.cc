#include "gpt_trainer.h"

#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/mesh/mesh_train_state.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h"

namespace train_gpt {

namespace {

namespace fs = std::filesystem;

// The mean cross-entropy of this tp rank's vocabulary columns of the logits (collective over tp).
torch::Tensor vocabulary_loss(const torch::Tensor& logits, const torch::Tensor& target,
                              const std::shared_ptr<ddp::ProcessGroup>& tp, std::int64_t vocab) {
  return ddp::vocab_parallel_cross_entropy(logits.reshape({-1, vocab / tp->size()}),
                                           target.reshape({-1}), tp)
      .mean();
}

// Both trainers' checkpoint: a DCP folder of the whole model under its names (each split tensor
// whole, each FSDP shard a flat range of it), AdamW's state per parameter, and these two values.
// The names are the same with and without --fsdp: each resumes the other's at any layout.
constexpr const char* kTag = "train-gpt";
constexpr const char* kTagEntry = "train_gpt.tag";
constexpr const char* kStepEntry = "train_gpt.global_step";

// The step of the DCP folder `folder` that train-gpt saved (ConfigError naming the folder for one
// it did not); `load` reads the model and optimizer from it.
ddp::TrainProgress load_train_gpt_dcp(const fs::path& folder,
                                      const std::function<void(const ddp::DcpReader&)>& load) {
  const ddp::DcpReader checkpoint(folder);
  const auto& values = checkpoint.info().values;
  if (!values.contains(kTagEntry) || !values.contains(kStepEntry) ||
      !checkpoint.read_value(kTagEntry).isString() ||
      checkpoint.read_value(kTagEntry).toStringRef() != kTag) {
    throw ddp::ConfigError(fmt::format(
        "--resume: '{}' is a distributed checkpoint, but not one train-gpt saved (no '{}' "
        "entry naming it)",
        folder.string(), kTagEntry));
  }
  load(checkpoint);
  ddp::TrainProgress progress;
  progress.global_step = checkpoint.read_value(kStepEntry).toInt();
  return progress;
}

// Names what a checkpoint folder holds when it is an earlier layout's, so that a resume with
// another --fsdp setting is refused by name rather than as a missing file.
std::string saved_layout(const fs::path& dir) {
  if (fs::exists(dir / "mesh.pt")) return "without --fsdp (a pipeline's MeshTrainState)";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if (entry.is_directory() && name.rfind("tp-", 0) == 0) {
      return fmt::format("with --fsdp (ShardedTrainState folders such as {})", name);
    }
  }
  return {};
}

// The interleaved schedule's chunks: the blocks split evenly over pp x virtual_stages chunks, the
// embeddings joining the first and the head the last (Megatron's layout); empty (an even split of
// the children) for the other schedules.
std::vector<int> interleaved_balance(const TrainerConfig& config, int stages) {
  if (config.schedule != "interleaved") return {};
  const int chunks = stages * config.virtual_stages;
  std::vector<int> balance(static_cast<std::size_t>(chunks), config.shape.layers / chunks);
  balance.front() += 1;
  balance.back() += 1;
  return balance;
}

class PipelineTrainer final : public Trainer {
 public:
  PipelineTrainer(const ddp::DeviceMesh& mesh, const TrainerConfig& config) : config_(config) {
    // The whole model on every rank (the split layers are cut for this tp rank); the pipeline
    // keeps this rank's stage.
    const auto tp = mesh.group("tp");
    torch::nn::Sequential model;
    const auto names = gpt_child_names(config.shape.layers);
    const bool experts = config.shape.moe_experts > 0;
    const ddp::MoeGroups moe =
        experts ? ddp::MoeGroups{.ep = mesh.group("ep"), .tokens = config.data} : ddp::MoeGroups{};
    for (std::size_t i = 0; i < names.size(); ++i)
      model->push_back(names[i], make_gpt_child(i, config.shape, tp,
                                                config.activation_checkpointing, moe, config.cp));
    pipe_.emplace(
        model, mesh.group("pp"),
        [tp, vocab = config.shape.vocab](const torch::Tensor& logits, const torch::Tensor& target) {
          return vocabulary_loss(logits, target, tp, vocab);
        },
        ddp::PipelineOptions{.schedule = ddp::pipeline_schedule_from_name(config.schedule),
                             .micro_batches = config.microbatches,
                             .virtual_stages = config.virtual_stages,
                             .balance = interleaved_balance(config, mesh.size("pp")),
                             .dp_group = experts || config.cp ? config.data : mesh.group("dp"),
                             .expert_dp_group = experts ? mesh.group("dp") : nullptr});
    optimizer_.emplace(pipe_->parameters(), torch::optim::AdamWOptions(config.lr));
    // Each rank's part of the model and of AdamW's state (the dp replicas share theirs).
    state_.emplace(mesh, *pipe_->stage_module(), *optimizer_,
                   ddp::MeshTrainStateOptions{.tag = "train-gpt"});
    pp_ = mesh.group("pp");
  }

  double step(const torch::Tensor& inputs, const torch::Tensor& targets) override {
    optimizer_->zero_grad();
    const double loss = pipe_->step(inputs, targets);
    optimizer_->step();
    return loss;
  }

  // A checkpoint is a DCP folder: the model and AdamW's state under their names in the whole
  // model (each tp rank's part of a split tensor a region of it, every stage its own entries),
  // and the step. It resumes at any dp x tp x pp. A folder of an earlier train-gpt, a
  // MeshTrainState (mesh.pt), still resumes on the split it was saved with.
  ddp::TrainProgress load() override {
    if (fs::exists(config_.checkpoint / ".metadata")) {
      return load_train_gpt_dcp(config_.checkpoint,
                                [&](const ddp::DcpReader& checkpoint) { load_dcp(checkpoint); });
    }
    const auto other = saved_layout(config_.checkpoint);
    if (!fs::exists(config_.checkpoint / "mesh.pt") && !other.empty()) {
      throw ddp::ConfigError(
          fmt::format("--resume: the checkpoint in '{}' was saved {}; resume it with --fsdp",
                      config_.checkpoint.string(), other));
    }
    return state_->load(config_.checkpoint);
  }

  void save(const ddp::TrainProgress& progress) override {
    ddp::DcpStateDict state = ddp::dcp_model_state(*pipe_->stage_module(), &*optimizer_, layout());
    state.add_value(kTagEntry, std::string(kTag));
    state.add_value(kStepEntry, progress.global_step);
    ddp::save_dcp(state, config_.checkpoint);
  }

  double parameter_sum() override {
    auto sum = torch::tensor({full_parameter_sum(pipe_->stage_module())}, torch::kFloat64);
    ddp::all_reduce(sum, ddp::ReduceOp::kSum, *pp_);  // one sum per stage
    return sum.item<double>();
  }

 private:
  TrainerConfig config_;
  std::optional<ddp::Pipeline> pipe_;
  std::optional<torch::optim::AdamW> optimizer_;
  std::optional<ddp::MeshTrainState> state_;
  std::shared_ptr<ddp::ProcessGroup> pp_;

  // This rank's stage: its tensor-parallel parts, part of the whole model, its AdamW options per
  // parameter (the stages hold different parameters).
  ddp::DcpModelLayout layout() {
    ddp::DcpModelLayout l = ddp::tensor_parallel_dcp_layout(*pipe_->stage_module());
    l.part_of_model = true;
    l.per_parameter_groups = true;
    return l;
  }

  void load_dcp(const ddp::DcpReader& checkpoint) {
    // Each stage loads its own entries; together they must be all of the checkpoint's, or it
    // was saved from another model (more --layers, say), which no stage alone would notice.
    std::int64_t saved = 0;
    for (const auto& name : checkpoint.info().order)
      saved += name.starts_with("model.") ? 1 : 0;
    auto held = torch::tensor(
        {static_cast<std::int64_t>(ddp::state_dict(*pipe_->stage_module()).size())}, torch::kInt64);
    ddp::all_reduce(held, ddp::ReduceOp::kSum, *pp_);
    if (held.item<std::int64_t>() != saved) {
      throw ddp::ConfigError(fmt::format(
          "--resume: '{}' holds {} model tensors, this model {}: it was saved from another "
          "model (resume with the --layers, --hidden, --heads and --vocab-at-least it was saved "
          "with)",
          config_.checkpoint.string(), saved, held.item<std::int64_t>()));
    }
    ddp::load_dcp_model_state(config_.checkpoint, *pipe_->stage_module(), &*optimizer_, {},
                              layout());
  }
};

class FsdpTrainer final : public Trainer {
 public:
  FsdpTrainer(const ddp::DeviceMesh& mesh, const TrainerConfig& config)
      : config_(config),
        tp_(mesh.group("tp")),
        dp_(mesh.group("dp")),
        // Each child is sharded over dp before the next is built: no rank holds more than its
        // shards plus one child. min_num_params 1: every child is a unit of its own.
        model_(ddp::fsdp_build_sharded(
            gpt_child_names(config.shape.layers).size(),
            [&](std::size_t i) {
              return make_gpt_child(i, config.shape, tp_, config.activation_checkpointing);
            },
            dp_,
            ddp::FsdpOptions{.sharding_strategy = ddp::ShardingStrategy::kFullShard,
                             .min_num_params = 1,
                             .low_memory_backward = config.fsdp_low_memory},
            gpt_child_names(config.shape.layers))),
        optimizer_(model_->parameters(), torch::optim::AdamWOptions(config.lr)),
        state_(*model_, optimizer_, ddp::TrainStateOptions{.tag = "train-gpt --fsdp"}) {
    if (!config.checkpoint.empty()) {
      dir_ = config.checkpoint / fmt::format("tp-{}-of-{}", tp_->rank(), tp_->size());
    }
  }

  double step(const torch::Tensor& inputs, const torch::Tensor& targets) override {
    optimizer_.zero_grad();
    // As the pipeline does: each micro-batch's mean loss / micro-batches, gradients summed over
    // the micro-batches (reduced once, after the last), then averaged over dp.
    const auto micro = config_.microbatches;
    const auto parts_in = inputs.split(inputs.size(0) / micro);
    const auto parts_target = targets.split(targets.size(0) / micro);
    double loss = 0.0;
    for (int m = 0; m < micro; ++m) {
      std::optional<ddp::FsdpNoSyncGuard> accumulate;
      if (m + 1 < micro) accumulate.emplace(model_->no_sync());
      const auto scaled =
          vocabulary_loss(model_->forward(parts_in[m]), parts_target[m], tp_, config_.shape.vocab) /
          micro;
      scaled.backward();
      loss += scaled.item<double>();
    }
    optimizer_.step();
    auto mean = torch::tensor({loss}, torch::kFloat64);
    ddp::all_reduce(mean, ddp::ReduceOp::kSum, *dp_);
    return mean.item<double>() / dp_->size();
  }

  // The DCP folder both trainers write (so it resumes at any dp x tp, with or without --fsdp);
  // a folder of an earlier train-gpt --fsdp (a ShardedTrainState per tp rank) still resumes at
  // the --tp it was saved with.
  ddp::TrainProgress load() override {
    if (fs::exists(config_.checkpoint / ".metadata")) {
      return load_train_gpt_dcp(config_.checkpoint, [&](const ddp::DcpReader&) {
        model_->load_dcp_state(config_.checkpoint, &optimizer_, {}, layout());
      });
    }
    if (!fs::exists(dir_)) {
      const auto other = saved_layout(config_.checkpoint);
      throw ddp::ConfigError(fmt::format(
          "--resume --fsdp: '{}' has no checkpoint train-gpt saved (no .metadata, and no {} for "
          "tp rank {} of {}){}",
          config_.checkpoint.string(), dir_.filename().string(), tp_->rank(), tp_->size(),
          other.empty() ? std::string(" (nothing was saved there)")
                        : fmt::format("; it was saved {} (resume with the --tp and --fsdp it was "
                                      "saved with; --dp may differ)",
                                      other)));
    }
    return state_.load(dir_);
  }

  void save(const ddp::TrainProgress& progress) override {
    ddp::DcpStateDict state = model_->dcp_state(&optimizer_, layout());
    state.add_value(kTagEntry, std::string(kTag));
    state.add_value(kStepEntry, progress.global_step);
    ddp::save_dcp(state, config_.checkpoint);
  }

  double parameter_sum() override {
    // One child gathered at a time (each is a wrapper of its own): the whole model gathered at
    // once is what no rank of a model larger than one process can hold.
    double sum = 0.0;
    for (const auto& child : model_->module()->children()) {
      auto* wrapper = child->as<ddp::FullyShardedDataParallelImpl>();
      if (wrapper == nullptr) {
        throw ddp::Error("train-gpt --fsdp: a child of the model is not sharded on its own");
      }
      wrapper->summon_full_params([&] { sum += child_parameter_sum(child); });
    }
    return sum;
  }

 private:
  TrainerConfig config_;
  std::shared_ptr<ddp::ProcessGroup> tp_, dp_;
  ddp::FullyShardedDataParallel model_;
  torch::optim::AdamW optimizer_;
  ddp::ShardedTrainState state_;
  fs::path dir_;

  // Each split parameter's place in the whole model's tensor, under the names dcp_state gives
  // the parameters (the wrapped model's: each child's name, then the name inside it).
  ddp::DcpModelLayout layout() const {
    ddp::DcpModelLayout out;
    for (const auto& child : model_->wrapped_module()->named_children()) {
      const auto* wrapper = child.value()->as<ddp::FullyShardedDataParallelImpl>();
      const torch::nn::Module& inner =
          wrapper != nullptr ? *wrapper->wrapped_module() : *child.value();
      for (const auto& [name, spec] : ddp::tensor_parallel_dcp_layout(inner).shards)
        out.shards.emplace(child.key() + "." + name, spec);
    }
    return out;
  }
};

}  // namespace

std::unique_ptr<Trainer> make_pipeline_trainer(const ddp::DeviceMesh& mesh,
                                               const TrainerConfig& config) {
  return std::make_unique<PipelineTrainer>(mesh, config);
}

std::unique_ptr<Trainer> make_fsdp_trainer(const ddp::DeviceMesh& mesh,
                                           const TrainerConfig& config) {
  return std::make_unique<FsdpTrainer>(mesh, config);
}

}  // namespace train_gpt
