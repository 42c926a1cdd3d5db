// train-gpt's two ways to train the model of gpt_model.h on a DeviceMesh of pp x dp x tp ranks:
// - the pipeline: every dp replica builds its stages whole; ddp::Pipeline runs --microbatches
//   through the pp stages (GPipe or 1F1B) and averages the gradients over dp; checkpoints in
//   PyTorch's distributed checkpoint format (DCP), which resume at any dp x tp x pp (a
//   MeshTrainState folder, DIR/mesh.pt, of an earlier train-gpt resumes on its own split).
// - FSDP (--fsdp, pp = 1): the model is built child by child, each child sharded over dp
//   (FULL_SHARD) before the next is built (fsdp_build_sharded); micro-batches accumulate
//   gradients under no_sync; ShardedTrainState checkpoints one folder per tp rank
//   (DIR/tp-<r>-of-<T>/), which resumes at any dp.
// Both train with AdamW and take the same batches: every layout of one run ends at the same
// numbers.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "ddp/torch/checkpoint/train_state.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "gpt_model.h"

namespace train_gpt {

struct TrainerConfig {
  GptShape shape;
  double lr = 3e-3;
  std::string schedule = "1f1b";  // the pipeline's
  int virtual_stages = 1;         // chunks per pipeline rank ("interleaved")
  int microbatches = 1;
  bool activation_checkpointing = false;
  bool fsdp_low_memory = false;      // FsdpOptions::low_memory_backward
  std::filesystem::path checkpoint;  // empty: no checkpoints
  // With experts (shape.moe_experts > 0, the pipeline only): the mesh has an "ep" dimension, and
  // `data` is the group of the dp x ep ranks that split the batch's rows.
  std::shared_ptr<ddp::ProcessGroup> data;
  // With context parallelism (the pipeline only): the mesh's "cp" group, and `data` the dp x cp
  // ranks.
  std::shared_ptr<ddp::ProcessGroup> cp;
};

class Trainer {
 public:
  virtual ~Trainer() = default;
  // One optimizer step on this dp rank's rows of the batch ([rows, block_size] ids and their
  // next ids); returns the loss averaged over dp (the same on every rank of a dp group's stage).
  virtual double step(const torch::Tensor& inputs, const torch::Tensor& targets) = 0;
  // The checkpoint in config.checkpoint (ConfigError where there is none, or it is another
  // layout's), and save into it (collective).
  virtual ddp::TrainProgress load() = 0;
  virtual void save(const ddp::TrainProgress& progress) = 0;
  // The sum of every element of every parameter of the whole model, the same on every rank
  // (collective).
  virtual double parameter_sum() = 0;
};

std::unique_ptr<Trainer> make_pipeline_trainer(const ddp::DeviceMesh& mesh,
                                               const TrainerConfig& config);
std::unique_ptr<Trainer> make_fsdp_trainer(const ddp::DeviceMesh& mesh,
                                           const TrainerConfig& config);

}  // namespace train_gpt
