// train-gpt's model (train_gpt.cc): a token embedding split over the vocabulary
// (VocabParallelEmbedding) plus a learned position embedding, `layers` GptBlocks parallelised by
// Megatron's plan, a final LayerNorm and a column-parallel head over the vocabulary. Every part
// comes from a fixed seed, so every layout builds the same numbers (each tp rank its parts).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"

namespace train_gpt {

struct GptShape {
  std::int64_t vocab = 0;  // padded: divisible by tp
  std::int64_t hidden = 0, heads = 0, block_size = 0;
  int layers = 0;
  torch::Dtype dtype = torch::kFloat32;
  // A mixture of experts in every block's place of the MLP when moe_experts > 0 (GptBlockOptions'
  // moe fields), over the groups make_gpt_child is given.
  std::int64_t moe_experts = 0, top_k = 1;
  double capacity_factor = 0.0, aux_weight = 0.0;
};

// Token embedding (split over the vocabulary on tp) plus a learned position embedding; with a cp
// group, the ids are this rank's positions of each window (context_parallel_positions).
struct EmbeddingsImpl : torch::nn::Module {
  EmbeddingsImpl(const GptShape& shape, const std::shared_ptr<ddp::ProcessGroup>& tp,
                 const std::shared_ptr<ddp::ProcessGroup>& cp = nullptr);
  torch::Tensor forward(const torch::Tensor& ids);
  ddp::VocabParallelEmbedding token{nullptr};
  torch::Tensor position;
  torch::Tensor positions;  // with cp: this rank's (int64), else undefined (0, 1, ...)
};
TORCH_MODULE(Embeddings);

// The final LayerNorm and the head, split over the vocabulary (its output is this rank's part).
struct HeadImpl : torch::nn::Module {
  HeadImpl(const GptShape& shape, const std::shared_ptr<ddp::ProcessGroup>& tp);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::LayerNorm norm{nullptr};
  ddp::ColumnParallelLinear proj{nullptr};
};
TORCH_MODULE(Head);

// The model's children in order: "embeddings", "block0" ... "block<layers-1>", "head".
std::vector<std::string> gpt_child_names(int layers);

// Child `index` of the model (collective over tp: the split layers agree on their shapes; and
// over `moe`'s groups for a block with experts). A block is parallelised over tp (its attention
// only, with experts), context-parallel over `cp` when given (the embeddings then take this rank's
// positions), and with `checkpointed` runs under ddp::checkpoint.
torch::nn::AnyModule make_gpt_child(std::size_t index, const GptShape& shape,
                                    const std::shared_ptr<ddp::ProcessGroup>& tp, bool checkpointed,
                                    const ddp::MoeGroups& moe = {},
                                    const std::shared_ptr<ddp::ProcessGroup>& cp = nullptr);

// The sum of every element of one child's parameters, the split ones gathered over tp
// (collective over tp, in the same order on every tp rank). The child may be under
// ddp::checkpoint or FullyShardedDataParallel (then call it inside its summon_full_params).
double child_parameter_sum(std::shared_ptr<torch::nn::Module> child);
// The same over every child of a stage.
double full_parameter_sum(torch::nn::Sequential& stage);

}  // namespace train_gpt
