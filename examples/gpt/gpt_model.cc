#include "gpt_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
#include "ddp/torch/parallel/context/ring_attention.h"
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/recompute/activation_checkpoint.h"

namespace train_gpt {

EmbeddingsImpl::EmbeddingsImpl(const GptShape& shape, const std::shared_ptr<ddp::ProcessGroup>& tp,
                               const std::shared_ptr<ddp::ProcessGroup>& cp) {
  if (cp) positions = ddp::context_parallel_positions(shape.block_size, *cp);
  token = register_module(
      "token",
      ddp::VocabParallelEmbedding(ddp::VocabParallelEmbeddingOptions{.num_embeddings = shape.vocab,
                                                                     .embedding_dim = shape.hidden,
                                                                     .seed = 1000,
                                                                     .dtype = shape.dtype},
                                  tp));
  auto generator = at::detail::createCPUGenerator(1001);
  position =
      register_parameter("position", torch::randn({shape.block_size, shape.hidden}, generator,
                                                  torch::TensorOptions().dtype(shape.dtype)) *
                                         0.02);
}

torch::Tensor EmbeddingsImpl::forward(const torch::Tensor& ids) {
  if (positions.defined()) return token(ids) + position.index_select(0, positions);
  return token(ids) + position.narrow(0, 0, ids.size(1));
}

HeadImpl::HeadImpl(const GptShape& shape, const std::shared_ptr<ddp::ProcessGroup>& tp) {
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({shape.hidden})));
  norm->to(shape.dtype);
  proj = register_module("proj", ddp::ColumnParallelLinear(
                                     ddp::ColumnParallelLinearOptions{.in_features = shape.hidden,
                                                                      .out_features = shape.vocab,
                                                                      .bias = false,
                                                                      .seed = 2000,
                                                                      .dtype = shape.dtype},
                                     tp));
}

torch::Tensor HeadImpl::forward(const torch::Tensor& x) {
  return proj(norm(x));
}

std::vector<std::string> gpt_child_names(int layers) {
  std::vector<std::string> names = {"embeddings"};
  for (int layer = 0; layer < layers; ++layer)
    names.push_back(fmt::format("block{}", layer));
  names.push_back("head");
  return names;
}

torch::nn::AnyModule make_gpt_child(std::size_t index, const GptShape& shape,
                                    const std::shared_ptr<ddp::ProcessGroup>& tp, bool checkpointed,
                                    const ddp::MoeGroups& moe,
                                    const std::shared_ptr<ddp::ProcessGroup>& cp) {
  if (index == 0) return torch::nn::AnyModule(Embeddings(shape, tp, cp));
  if (index == static_cast<std::size_t>(shape.layers) + 1) {
    return torch::nn::AnyModule(Head(shape, tp));
  }
  const auto layer = static_cast<std::uint64_t>(index - 1);
  ddp::GptBlock block(ddp::GptBlockOptions{.hidden = shape.hidden,
                                           .heads = shape.heads,
                                           .seed = 100 + 10 * layer,
                                           .dtype = shape.dtype,
                                           .moe_experts = shape.moe_experts,
                                           .moe_top_k = shape.top_k,
                                           .moe_capacity_factor = shape.capacity_factor,
                                           .moe_aux_weight = shape.aux_weight},
                      moe);
  // At tp 1 the split layers would be copies of the whole ones (twice the block while it is cut).
  // The experts stay whole on every tp rank.
  auto plan = ddp::gpt_block_tensor_parallel_plan();
  if (shape.moe_experts > 0) plan.resize(2);  // attn_qkv, attn_proj
  if (tp->size() > 1) ddp::parallelize_module(block, tp, plan);
  if (cp) block->context_parallel(cp);
  if (!checkpointed) return torch::nn::AnyModule(block);
  // The block keeps its input only; its activations are recomputed in backward (with the
  // tensor-parallel collectives inside it, on every tp rank alike).
  torch::nn::Sequential one;
  one->push_back(block);
  return *ddp::apply_activation_checkpointing(one, ddp::checkpoint_every_child())->begin();
}

double child_parameter_sum(std::shared_ptr<torch::nn::Module> child) {
  double sum = 0.0;
  const auto add = [&](const torch::Tensor& t) {
    sum += t.to(torch::kFloat64).sum().item<double>();
  };
  if (auto* wrapper = child->as<ddp::FullyShardedDataParallelImpl>()) {
    child = wrapper->wrapped_module();  // full inside summon_full_params
  }
  child = ddp::checkpointed_module(child);
  if (auto* embeddings = child->as<EmbeddingsImpl>()) {
    add(embeddings->token->gather_full());
    add(embeddings->position.detach());
  } else if (auto* block = child->as<ddp::GptBlockImpl>()) {
    for (const auto& [name, value] : block->full_named_parameters())
      add(value);
  } else if (auto* head = child->as<HeadImpl>()) {
    for (const auto& p : head->norm->parameters())
      add(p.detach());
    add(head->proj->gather_full().weight);
  }
  return sum;
}

double full_parameter_sum(torch::nn::Sequential& stage) {
  double sum = 0.0;
  for (const auto& child : stage->children())
    sum += child_parameter_sum(child);
  return sum;
}

}  // namespace train_gpt
