// Tensor parallelism (Megatron-LM's tensor model parallel; PyTorch's
// torch.distributed.tensor.parallel): layers whose weights are split across the ranks of a tp
// group, the conjugate autograd functions that move activations between replicated and split
// regions, a vocab-parallel cross-entropy and the RNG tracker that keeps dropout consistent.
//
//   ddp::DeviceMesh mesh({{"dp", 2}, {"tp", 2}});
//   auto tp = mesh.group("tp");
//   ddp::ColumnParallelLinear fc(ddp::ColumnParallelLinearOptions{.in_features = 64,
//                                                                 .out_features = 256}, tp);
//   ddp::RowParallelLinear out(ddp::RowParallelLinearOptions{.in_features = 256,
//                                                            .out_features = 64}, tp);
//   auto y = out(torch::gelu(fc(x)));   // x, y replicated on the tp ranks; the middle is split
//
// Regions. An activation is replicated (every tp rank holds all of it) or split (each holds a
// part, along the last dimension for tensor parallelism or along the sequence dimension for
// sequence parallelism). The functions below move between them; each is a
// torch::autograd::Function whose backward is its forward's conjugate:
//
//   function (Megatron's name without "model")       forward                 backward
//   copy_to_tensor_parallel_region                   identity                all-reduce
//   reduce_from_tensor_parallel_region               all-reduce              identity
//   scatter_to_tensor_parallel_region                keep own last-dim part  all-gather last dim
//   gather_from_tensor_parallel_region               all-gather last dim     keep own part
//   scatter_to_sequence_parallel_region              keep own seq part       all-gather seq dim
//   gather_from_sequence_parallel_region             all-gather seq dim      reduce-scatter
//   reduce_scatter_to_sequence_parallel_region       reduce-scatter seq dim  all-gather
//
// Parts go to ranks in rank order of the group (rank r holds part r). The group is kept alive
// by the autograd graph until backward has run. Collective: every rank of the group calls the
// same functions in the same order with tensors of the same shape, and runs backward; a rank
// whose shape differs fails with the engine's mismatch CommError (the ring backend checks every
// call's fingerprint), a dimension that does not divide by the group's size is a ConfigError on
// every rank that finds it (after a barrier in place of the refused collective, so that ranks
// which did not find it fail at once instead of waiting). CPU tensors of float32/64, float16,
// bfloat16.
//
// Layers. Each holds this rank's shard as `weight` (and `bias`), named as torch::nn::Linear's and
// Embedding's. Exactness with one process: the full weight is built on every rank, then this
// rank keeps its shard; built from `seed` by initial_linear_parameters/initial_embedding_weight
// (the distributions of torch::nn::Linear and Embedding), or taken from a given full tensor
// (which must be the same on every rank). A TP model built from a seed therefore holds exactly the
// split of the one-process model built from the same seed, and trains to the same numbers.
// Construction is collective over the group: one small allgather compares what every rank was
// given (sizes, seed or a hash of the given weights), so a bad size (not divisible by the group's
// size) or ranks that disagree are a ConfigError on every rank, naming the layer, the value and
// what to do. gather_full() (collective) returns the full, unsplit parameters.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// ---- Regions (autograd functions; table above) ----------------------------------------------
torch::Tensor copy_to_tensor_parallel_region(const torch::Tensor& input,
                                             const std::shared_ptr<ProcessGroup>& group);
torch::Tensor reduce_from_tensor_parallel_region(const torch::Tensor& input,
                                                 const std::shared_ptr<ProcessGroup>& group);
// The last dimension must divide by the group's size.
torch::Tensor scatter_to_tensor_parallel_region(const torch::Tensor& input,
                                                const std::shared_ptr<ProcessGroup>& group);
torch::Tensor gather_from_tensor_parallel_region(const torch::Tensor& input,
                                                 const std::shared_ptr<ProcessGroup>& group);
// Sequence parallelism, along `sequence_dim` (Megatron's layout [sequence, batch, hidden] has it
// first; pass 1 for [batch, sequence, hidden]). Scatter and reduce-scatter need that dimension to
// divide by the group's size.
torch::Tensor scatter_to_sequence_parallel_region(const torch::Tensor& input,
                                                  const std::shared_ptr<ProcessGroup>& group,
                                                  std::int64_t sequence_dim = 0);
torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& input,
                                                   const std::shared_ptr<ProcessGroup>& group,
                                                   std::int64_t sequence_dim = 0);
torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& input,
                                                         const std::shared_ptr<ProcessGroup>& group,
                                                         std::int64_t sequence_dim = 0);

// ---- Full initial weights (the same on every rank for the same seed) ------------------------
struct LinearParameters {
  torch::Tensor weight;  // [out_features, in_features]
  torch::Tensor bias;    // [out_features]; undefined without a bias
};
// torch::nn::Linear's distribution (uniform in +-1/sqrt(in_features), weight then bias) drawn
// from a CPU generator seeded with `seed`.
LinearParameters initial_linear_parameters(std::int64_t in_features, std::int64_t out_features,
                                           bool bias, std::uint64_t seed,
                                           torch::Dtype dtype = torch::kFloat32);
// torch::nn::Embedding's distribution (standard normal), [num_embeddings, embedding_dim].
torch::Tensor initial_embedding_weight(std::int64_t num_embeddings, std::int64_t embedding_dim,
                                       std::uint64_t seed, torch::Dtype dtype = torch::kFloat32);

// How a layer is split (PyTorch's ColwiseParallel / RowwiseParallel styles; a plan's values:
// parallelize_module of a GptBlock, gpt_block.h, or of any Sequential tree, parallelize.h).
enum class ParallelStyle {
  kColwise,  // ColumnParallelLinear: output features split, input replicated
  kRowwise,  // RowParallelLinear: input features split, output all-reduced
  kVocab,    // VocabParallelEmbedding: the table's rows (the vocabulary) split
};

// ---- ColumnParallelLinear -------------------------------------------------------------------
// Y = X A^T + b with A split by rows (output features): rank r holds rows r of every one of
// `fused_blocks` equal blocks of A (1: a plain split; 3: a fused q|k|v projection, so that each
// rank gets q, k and v of the same heads). Input replicated (copy_to: its gradient is
// all-reduced); output split along the last dimension, or gathered with gather_output (in the
// full layer's order).
struct ColumnParallelLinearOptions {
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;  // divisible by group size x fused_blocks
  bool bias = true;
  bool gather_output = false;
  std::int64_t fused_blocks = 1;
  std::uint64_t seed = 0;  // of the full weight, when none is given
  torch::Dtype dtype = torch::kFloat32;
};

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                           std::shared_ptr<ProcessGroup> group);
  // Shards the given full parameters (weight [out, in], bias [out] or undefined for none; the
  // options' sizes and bias must match them; their dtype is kept, the options' seed and dtype are
  // unused).
  ColumnParallelLinearImpl(ColumnParallelLinearOptions options, std::shared_ptr<ProcessGroup> group,
                           const LinearParameters& full);

  torch::Tensor forward(const torch::Tensor& input);
  // Collective over the group: the full weight and bias.
  LinearParameters gather_full() const;

  const ColumnParallelLinearOptions& options() const { return options_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

  torch::Tensor weight;  // [out_features / size, in_features]
  torch::Tensor bias;    // [out_features / size], or undefined

 private:
  // Checks (with every rank), then keeps this rank's shard of `given` or of the seed's weights.
  void build(const LinearParameters* given);

  ColumnParallelLinearOptions options_;
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(ColumnParallelLinear);

// ---- RowParallelLinear ----------------------------------------------------------------------
// Y = X A^T + b with A split by columns (input features). Input split along the last dimension
// (input_is_parallel, e.g. a ColumnParallelLinear's output) or replicated (then scattered here);
// the partial products are all-reduced (reduce_from), then the bias, which is replicated, is
// added: output replicated.
struct RowParallelLinearOptions {
  std::int64_t in_features = 0;  // divisible by the group's size
  std::int64_t out_features = 0;
  bool bias = true;
  bool input_is_parallel = true;
  std::uint64_t seed = 0;
  torch::Dtype dtype = torch::kFloat32;
};

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(RowParallelLinearOptions options, std::shared_ptr<ProcessGroup> group);
  RowParallelLinearImpl(RowParallelLinearOptions options, std::shared_ptr<ProcessGroup> group,
                        const LinearParameters& full);

  torch::Tensor forward(const torch::Tensor& input);
  LinearParameters gather_full() const;  // collective

  const RowParallelLinearOptions& options() const { return options_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }

  torch::Tensor weight;  // [out_features, in_features / size]
  torch::Tensor bias;    // [out_features] (replicated), or undefined

 private:
  // Checks (with every rank), then keeps this rank's shard of `given` or of the seed's weights.
  void build(const LinearParameters* given);

  RowParallelLinearOptions options_;
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(RowParallelLinear);

// ---- VocabParallelEmbedding -----------------------------------------------------------------
// An embedding table split by rows (the vocabulary): rank r holds ids [r*V/size, (r+1)*V/size).
// Each rank looks up the ids in its range (zeros elsewhere) and the results are all-reduced:
// output replicated. Ids outside [0, num_embeddings) are a ConfigError on every rank.
struct VocabParallelEmbeddingOptions {
  std::int64_t num_embeddings = 0;  // divisible by the group's size
  std::int64_t embedding_dim = 0;
  std::uint64_t seed = 0;
  torch::Dtype dtype = torch::kFloat32;
};

class VocabParallelEmbeddingImpl : public torch::nn::Module {
 public:
  VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                             std::shared_ptr<ProcessGroup> group);
  // Shards the given full table [num_embeddings, embedding_dim].
  VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                             std::shared_ptr<ProcessGroup> group, const torch::Tensor& full);

  torch::Tensor forward(const torch::Tensor& ids);  // int64 ids -> [..., embedding_dim]
  torch::Tensor gather_full() const;                // collective

  const VocabParallelEmbeddingOptions& options() const { return options_; }
  const std::shared_ptr<ProcessGroup>& group() const { return group_; }
  std::int64_t vocab_start() const;  // this rank's first id

  torch::Tensor weight;  // [num_embeddings / size, embedding_dim]

 private:
  // Checks (with every rank), then keeps this rank's shard of `given` or of the seed's weights.
  void build(const torch::Tensor* given);

  VocabParallelEmbeddingOptions options_;
  std::shared_ptr<ProcessGroup> group_;
};
TORCH_MODULE(VocabParallelEmbedding);

// The parameters of `module` and its descendants that ddp's tensor-parallel layers split (each
// tp rank holds a different part): ColumnParallelLinear's weight and bias, RowParallelLinear's
// weight (its bias is replicated) and VocabParallelEmbedding's weight; in the order of
// module.modules(). What a norm over the whole model sums over tp (FullyShardedDataParallel's
// clip_grad_norm_ with TensorParallelNorm).
std::vector<torch::Tensor> tensor_parallel_split_parameters(const torch::nn::Module& module);

// ---- Vocab-parallel cross-entropy -----------------------------------------------------------
// Megatron's vocab_parallel_cross_entropy: `logits` [..., V/size] are this rank's part of the
// vocabulary (a ColumnParallelLinear's split output), `target` [...] int64 ids in [0, V). Returns
// the per-element loss [...] (take .mean() for torch::cross_entropy's default), equal to
// cross_entropy over the gathered logits without ever gathering them: two all-reduces of
// [...] values (the max; the target logit and the sum of exponentials together). Backward is
// local: softmax minus the one-hot target, on this rank's part. Collective over the group;
// targets out of range are a ConfigError on every rank.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits, const torch::Tensor& target,
                                           const std::shared_ptr<ProcessGroup>& group);

// ---- RNG tracker ----------------------------------------------------------------------------
// Megatron's model-parallel RNG tracker, on CPU generators of its own (the global generator is
// left alone). Dropout on a replicated activation must drop the same elements on every tp rank
// (or the replicas diverge): it draws from the replicated generator, seeded with `seed` on every
// rank. Dropout on a split activation (attention heads, a column-parallel output) must draw
// independent masks for the different parts: it draws from the split generator, seeded with
// seed + kSplitSeedOffset + tp_rank (Megatron's 2718). Use the same seed on every tp rank (and,
// as Megatron, a different one per pipeline stage). Not thread-safe: one tracker per thread.
class TensorParallelRng {
 public:
  static constexpr std::uint64_t kSplitSeedOffset = 2718;
  enum class Region { kReplicated, kSplit };

  TensorParallelRng(std::uint64_t seed, int tp_rank);

  // Inverted dropout as torch::dropout (zeroes with probability p, scales the rest by 1/(1-p)),
  // with the mask drawn from `region`'s generator; the input itself when !training or p == 0.
  torch::Tensor dropout(const torch::Tensor& input, double p, bool training, Region region);
  torch::Generator& generator(Region region);

  std::uint64_t seed() const { return seed_; }
  int tp_rank() const { return tp_rank_; }

 private:
  std::uint64_t seed_;
  int tp_rank_;
  torch::Generator replicated_;
  torch::Generator split_;
};

}  // namespace ddp
#pragma GCC visibility pop
