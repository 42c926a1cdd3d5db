#include "gpt_trainer.h"

#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/mesh/mesh_train_state.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"

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

// Names what a checkpoint folder holds when it is the other trainer's, so that a resume with
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

class PipelineTrainer final : public Trainer {
 public:
  PipelineTrainer(const ddp::DeviceMesh& mesh, const TrainerConfig& config) : config_(config) {
    // The whole model on every rank (the split layers are cut for this tp rank); the pipeline
    // keeps this rank's stage.
    const auto tp = mesh.group("tp");
    torch::nn::Sequential model;
    const auto names = gpt_child_names(config.shape.layers);
    for (std::size_t i = 0; i < names.size(); ++i)
      model->push_back(names[i],
                       make_gpt_child(i, config.shape, tp, config.activation_checkpointing));
    pipe_.emplace(
        model, mesh.group("pp"),
        [tp, vocab = config.shape.vocab](const torch::Tensor& logits, const torch::Tensor& target) {
          return vocabulary_loss(logits, target, tp, vocab);
        },
        ddp::PipelineOptions{.schedule = ddp::pipeline_schedule_from_name(config.schedule),
                             .micro_batches = config.microbatches,
                             .dp_group = mesh.group("dp")});
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

  ddp::TrainProgress load() override {
    const auto other = saved_layout(config_.checkpoint);
    if (!fs::exists(config_.checkpoint / "mesh.pt") && !other.empty()) {
      throw ddp::ConfigError(
          fmt::format("--resume: the checkpoint in '{}' was saved {}; resume it with --fsdp",
                      config_.checkpoint.string(), other));
    }
    return state_->load(config_.checkpoint);
  }

  void save(const ddp::TrainProgress& progress) override {
    state_->save(config_.checkpoint, progress);
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
                             .min_num_params = 1},
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

  ddp::TrainProgress load() override {
    if (!fs::exists(dir_)) {
      const auto other = saved_layout(config_.checkpoint);
      throw ddp::ConfigError(fmt::format(
          "--resume --fsdp: '{}' has no {} for tp rank {} of {}{}", config_.checkpoint.string(),
          dir_.filename().string(), tp_->rank(), tp_->size(),
          other.empty() ? std::string(" (nothing was saved there)")
                        : fmt::format("; it was saved {} (resume with the --tp and --fsdp it was "
                                      "saved with; --dp may differ)",
                                      other)));
    }
    return state_.load(dir_);
  }

  void save(const ddp::TrainProgress& progress) override {
    fs::create_directories(dir_);
    state_.save(dir_, progress, dp_->size());
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
