// GptBlock: a small pre-LayerNorm GPT transformer block (minGPT/nanoGPT's Block: causal
// self-attention with a fused q|k|v projection, then a GELU MLP, each in a residual branch), and
// parallelize_module, which splits one across a tp group from a plan, in the spirit of PyTorch's
// torch.distributed.tensor.parallel.parallelize_module.
//
//   ddp::GptBlock block(ddp::GptBlockOptions{.hidden = 64, .heads = 4, .seed = 1});  // every rank
//   ddp::parallelize_module(block, mesh.group("tp"), ddp::gpt_block_tensor_parallel_plan());
//   auto y = block(x);   // x, y: [batch, sequence, hidden], replicated on the tp ranks
//
// Megatron's plan (gpt_block_tensor_parallel_plan): attn_qkv column-parallel (each rank computes
// q, k, v of heads/tp heads: fused_blocks 3), attention on those heads, attn_proj row-parallel;
// mlp_fc column-parallel, mlp_proj row-parallel. Two all-reduces forward, two backward. The
// LayerNorms and the row-parallel biases stay replicated. The parts are cut from the block's
// current full weights, which must be the same on every rank (the same seed, or loaded the same).
//
// Dropout (options.dropout > 0, in training mode) goes through a TensorParallelRng: on the
// attention probabilities in the split region (the heads differ per rank), on each residual branch
// in the replicated region (the same mask on every tp rank).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Part name -> style. Parts not named stay replicated (every rank computes them whole).
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

struct GptBlockOptions {
  std::int64_t hidden = 0;  // divisible by heads
  std::int64_t heads = 0;
  std::int64_t mlp_hidden = 0;  // 0: 4 x hidden
  double dropout = 0.0;
  std::uint64_t seed = 0;  // the four linear layers draw from seed, seed+1, seed+2, seed+3
  torch::Dtype dtype = torch::kFloat32;
  // A mixture of experts in place of the MLP (mixture_of_experts.h) when moe_experts > 0: a
  // MoeLayer "moe" of that many experts of mlp_hidden each, drawn from seed + 2, over the groups
  // given to the constructor; its auxiliary loss enters backward with weight moe_aux_weight. It
  // stays whole on every tp rank (a plan may split the attention only).
  std::int64_t moe_experts = 0;
  std::int64_t moe_top_k = 1;
  double moe_capacity_factor = 0.0;
  double moe_aux_weight = 0.0;
};

class GptBlockImpl : public torch::nn::Module {
 public:
  // The parts, by name (the keys of a plan, and of named_parameters: "attn_qkv.weight", ...).
  static const std::vector<std::string>& linear_part_names();  // attn_qkv attn_proj mlp_fc mlp_proj

  // Collective over moe_groups' ep and tokens groups when options.moe_experts > 0.
  explicit GptBlockImpl(GptBlockOptions options, MoeGroups moe_groups = {});
  // x: [batch, sequence, hidden] -> the same shape.
  torch::Tensor forward(const torch::Tensor& x);

  // The full, unsplit parameters by name, in named_parameters' order (collective over the tp
  // group once parallelised; local copies before).
  std::vector<std::pair<std::string, torch::Tensor>> full_named_parameters() const;

  const GptBlockOptions& options() const { return options_; }
  // The mixture of experts in place of the MLP (null without one).
  const MoeLayer& moe() const { return moe_; }
  // The tp group (nullptr until parallelised) and the dropout generator.
  const std::shared_ptr<ProcessGroup>& tp_group() const { return tp_group_; }
  TensorParallelRng& rng() { return *rng_; }

  // Context parallelism (ring_attention.h): the block then takes this rank's positions of each
  // sequence (context_parallel_shard along dim 1) and attends over the whole sequence by
  // ring_attention over `cp` (collective over it). ConfigError with dropout (the ring computes the
  // attention probabilities block by block, never whole) or twice.
  void context_parallel(std::shared_ptr<ProcessGroup> cp);
  const std::shared_ptr<ProcessGroup>& cp_group() const { return cp_group_; }

  // parallelize_module(block, ...) below.
  void parallelize(std::shared_ptr<ProcessGroup> tp_group, const ParallelizePlan& plan,
                   std::shared_ptr<TensorParallelRng> rng);

 private:
  torch::nn::AnyModule& part(const std::string& name);

  GptBlockOptions options_;
  torch::nn::LayerNorm ln_1_{nullptr}, ln_2_{nullptr};
  torch::nn::AnyModule attn_qkv_, attn_proj_, mlp_fc_, mlp_proj_;
  MoeLayer moe_{nullptr};
  std::shared_ptr<ProcessGroup> tp_group_, cp_group_;
  std::shared_ptr<TensorParallelRng> rng_;
};
TORCH_MODULE(GptBlock);

// Megatron's: {attn_qkv colwise, attn_proj rowwise, mlp_fc colwise, mlp_proj rowwise}.
ParallelizePlan gpt_block_tensor_parallel_plan();

// Replaces the block's linear parts named in `plan` by their tensor-parallel forms over
// `tp_group`, cut from the block's current weights. Collective over tp_group (each layer checks
// with every rank that they agree). `rng` (default: a TensorParallelRng with the block's seed and
// this rank's tp rank) draws the block's dropout masks. ConfigError on every rank for: an unknown
// part name or one named twice; a pair split one way only (attn_qkv colwise needs attn_proj
// rowwise and the reverse, likewise mlp_fc/mlp_proj); another style than those; a head count, or
// an MLP size, not divisible by the group's size; a block already parallelised.
void parallelize_module(GptBlock& block, std::shared_ptr<ProcessGroup> tp_group,
                        const ParallelizePlan& plan,
                        std::shared_ptr<TensorParallelRng> rng = nullptr);

}  // namespace ddp
#pragma GCC visibility pop
