// Mixture of experts with expert parallelism (Megatron-core's MoE layer with its all-to-all token
// dispatcher, DeepSpeed-MoE, torchtitan's ExpertParallel): a top-k router sends each token to k of
// E feed-forward experts, the experts are split over the ranks of an `ep` group, and the tokens
// travel to their experts and back by uneven all-to-alls whose counts are exchanged first.
//
//   ddp::DeviceMesh mesh({{"dp", 2}, {"ep", 2}});     // the batch's rows split over all 4 ranks
//   ddp::MoeLayer moe(ddp::MoeOptions{.hidden = 64, .experts = 8, .top_k = 2, .seed = 1},
//                     ddp::MoeGroups{.ep = mesh.group("ep"), .tokens = ddp::default_group()});
//   auto y = moe(x);                                  // x, y: [..., hidden], this rank's tokens
//   auto loss = task_loss(y) + 0.01 * moe->aux_loss();
//
// The routing (one process's, on any layout). probs = softmax(x · routerᵀ); each token takes its k
// largest probabilities (gates, renormalised to sum to 1 when normalize_top_k) and their experts.
// With capacity_factor > 0 each expert takes at most capacity = ceil(factor · T · k / E) of the T
// tokens of the whole batch (every rank of `tokens`), first choices before second choices, and
// within a choice in the batch's row order (rank order of `tokens`, then this rank's rows): the
// rest are dropped (their slot adds nothing; the residual around the layer carries the token) and
// counted. The decision is made from counts all-gathered over `tokens`, so a layout drops exactly
// the tokens one process would. The output is Σ over a token's kept slots of gate × expert(x),
// expert(x) = W2 · gelu(W1 · x + b1) + b2.
//
// Load balancing (Switch Transformer's auxiliary loss): aux = E · Σ_e f_e · P_e, f_e the share of
// the batch's k·T assignments (before drops) that chose e, P_e the batch's mean probability of e.
// aux_loss() holds the whole batch's value on every rank; its gradient is this rank's share scaled
// by the size of `tokens`, so that averaging the replicated parameters' gradients over `tokens` (as
// data parallelism does) gives the one-process gradient.
//
// Gradients. The router is replicated: average its gradient over `tokens` (with the rest of the
// model). Expert e lives on ep rank e / (E / ep) and receives the tokens of every ep rank: its
// gradient is scaled by 1 / ep in backward (the mean of the ep ranks' losses), so averaging it over
// the ranks that hold the same expert (the dp replicas; none when tokens == ep) gives the
// one-process gradient. expert_parameters() / replicated_parameters() split the two.
//
// Initial values: the router from `seed`, expert e from seed + 1 + e (the distributions of
// torch::nn::Linear), whichever rank holds it, so every layout starts from one process's numbers.
//
// Collective. Construction agrees over ep and tokens (a ConfigError on every rank for top_k outside
// [1, E], E not divisible by ep, ranks passing other options). Each forward all-gathers the routing
// counts over `tokens` and runs three all-to-alls over `ep` (counts, tokens, and back; two more in
// backward): every rank of both groups calls forward, and backward, in the same order. An input
// whose last dimension is not `hidden`, of another dtype, or ranks whose capacity factors differ,
// are a ConfigError on every rank at that all-gather, before any token moves. CPU tensors of
// float32 or float64.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct MoeOptions {
  std::int64_t hidden = 0;
  std::int64_t ffn_hidden = 0;   // 0: 4 x hidden
  std::int64_t experts = 0;      // E, divisible by the ep group's size
  std::int64_t top_k = 1;        // in [1, E]
  double capacity_factor = 0.0;  // 0: no capacity (nothing is dropped)
  bool normalize_top_k = true;   // the k gates of a token sum to 1
  // > 0: the layer adds this weight x aux_loss() to the loss's gradient itself, in backward
  // (Megatron's MoEAuxLossAutoScaler), for a model whose loss cannot see the layer (a pipeline's
  // earlier stages); with M micro-batches averaged, pass the weight / M.
  double aux_loss_weight = 0.0;
  std::uint64_t seed = 0;
  torch::Dtype dtype = torch::kFloat32;
};

struct MoeGroups {
  std::shared_ptr<ProcessGroup> ep;      // the experts' split; null: every expert on this rank
  std::shared_ptr<ProcessGroup> tokens;  // the batch's row split; null: the ep group (or none)
};

// What the last forward decided, the same on every rank of `tokens`.
struct MoeRouting {
  std::int64_t tokens = 0;               // T, the whole batch's
  std::int64_t capacity = -1;            // per expert; -1: none
  std::int64_t dropped = 0;              // of the k·T assignments
  std::vector<std::int64_t> per_expert;  // assignments (before drops), by expert
};

class MoeLayerImpl : public torch::nn::Module {
 public:
  explicit MoeLayerImpl(MoeOptions options, MoeGroups groups = {});

  // x: [..., hidden] -> the same shape (collective, above).
  torch::Tensor forward(const torch::Tensor& x);
  // The last forward's load-balancing loss (a scalar in its graph); ConfigError before any.
  torch::Tensor aux_loss() const;
  const MoeRouting& last_routing() const { return routing_; }
  // Takes effect at the next forward; every rank of `tokens` must set the same.
  void set_capacity_factor(double factor);

  const MoeOptions& options() const { return options_; }
  // The ep group (null without one) and the token group.
  const std::shared_ptr<ProcessGroup>& ep_group() const { return ep_; }
  const std::shared_ptr<ProcessGroup>& token_group() const { return tokens_; }
  // The experts this rank holds: [first_expert(), first_expert() + local_experts()).
  std::int64_t first_expert() const { return first_expert_; }
  std::int64_t local_experts() const { return w1.size(0); }
  std::vector<torch::Tensor> expert_parameters() const { return {w1, b1, w2, b2}; }
  std::vector<torch::Tensor> replicated_parameters() const { return {router}; }
  // Every parameter whole, by name: the router, and each of w1 b1 w2 b2 with every expert
  // ([E, ...], gathered over ep: collective).
  std::vector<std::pair<std::string, torch::Tensor>> full_named_parameters() const;

  // "router" [E, hidden]; "w1" [local, ffn, hidden], "b1" [local, ffn], "w2" [local, hidden, ffn],
  // "b2" [local, hidden]: this rank's experts, stacked.
  torch::Tensor router, w1, b1, w2, b2;

 private:
  MoeOptions options_;
  std::shared_ptr<ProcessGroup> ep_, tokens_;
  std::int64_t first_expert_ = 0;
  MoeRouting routing_;
  torch::Tensor aux_loss_;
};
TORCH_MODULE(MoeLayer);

// Differentiable uneven all-to-all of rows (all_to_all_single with split sizes): input's first
// input_split_sizes[j] rows go to rank j, and output_split_sizes[j] rows come from rank j. Its
// backward is the reverse exchange of the gradient. Collective over `group`, forward and backward.
torch::Tensor all_to_all_rows(const torch::Tensor& input,
                              std::vector<std::int64_t> output_split_sizes,
                              std::vector<std::int64_t> input_split_sizes,
                              const std::shared_ptr<ProcessGroup>& group);

}  // namespace ddp
#pragma GCC visibility pop
