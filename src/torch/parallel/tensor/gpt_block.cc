// GptBlock and parallelize_module (gpt_block.h).
#include "ddp/torch/parallel/tensor/gpt_block.h"

#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/parallel/context/ring_attention.h"
#include "torch/api/rank_agreement.h"
#include "torch/parallel/tensor/tensor_parallel_internal.h"

namespace ddp {

namespace {

const char* style_name(ParallelStyle style) {
  return style == ParallelStyle::kColwise   ? "colwise"
         : style == ParallelStyle::kRowwise ? "rowwise"
                                            : "vocab";
}

torch::nn::Linear make_linear(std::int64_t in, std::int64_t out, std::uint64_t seed,
                              torch::Dtype dtype) {
  // Built 1 x 1, then given the seed's values at their size: a Linear built at its size would
  // allocate and initialise a weight only to drop it (a block of a model larger than one process
  // is built while the shards of all the others are held: that copy was its peak).
  torch::nn::Linear linear(torch::nn::LinearOptions(1, 1));
  const auto full = initial_linear_parameters(in, out, true, seed, dtype);
  torch::NoGradGuard no_grad;
  linear->weight.set_data(full.weight);
  linear->bias.set_data(full.bias);
  linear->options.in_features(in).out_features(out);
  return linear;
}

// The first problem of `plan` for `options` on a group of `tp` ranks; "" when none.
std::string plan_problem(const ParallelizePlan& plan, const GptBlockOptions& options,
                         std::int64_t tp) {
  const auto& names = GptBlockImpl::linear_part_names();
  // The one style each part can take: its neighbour in the pair must be split the other way.
  const std::map<std::string, ParallelStyle> only_style = {{"attn_qkv", ParallelStyle::kColwise},
                                                           {"attn_proj", ParallelStyle::kRowwise},
                                                           {"mlp_fc", ParallelStyle::kColwise},
                                                           {"mlp_proj", ParallelStyle::kRowwise}};
  std::map<std::string, ParallelStyle> given;
  for (const auto& [name, style] : plan) {
    if (options.moe_experts > 0 && (name == "mlp_fc" || name == "mlp_proj")) {
      return fmt::format(
          "parallelize_module: the plan names \"{}\", but the block has a mixture of experts in "
          "place of its MLP (moe_experts {}), which stays whole on every tp rank; split the "
          "attention only (attn_qkv colwise, attn_proj rowwise)",
          name, options.moe_experts);
    }
    if (!only_style.contains(name)) {
      return fmt::format(
          "parallelize_module: the plan names \"{}\", which is not a part of "
          "GptBlock; its parts are {}",
          name, fmt::join(names, ", "));
    }
    if (!given.emplace(name, style).second) {
      return fmt::format("parallelize_module: the plan names \"{}\" twice; name each part once",
                         name);
    }
    if (style != only_style.at(name)) {
      return fmt::format(
          "parallelize_module: \"{}\" can only be {} (attn_qkv and mlp_fc colwise, attn_proj and "
          "mlp_proj rowwise, as Megatron), the plan says {}",
          name, style_name(only_style.at(name)), style_name(style));
    }
  }
  const std::pair<std::string, std::string> pairs[] = {{"attn_qkv", "attn_proj"},
                                                       {"mlp_fc", "mlp_proj"}};
  for (const auto& [first, second] : pairs) {
    if (given.contains(first) != given.contains(second)) {
      return fmt::format(
          "parallelize_module: the plan splits \"{}\" but not \"{}\"; split both (colwise then "
          "rowwise) or neither",
          given.contains(first) ? first : second, given.contains(first) ? second : first);
    }
  }
  if (given.contains("attn_qkv") && options.heads % tp != 0) {
    return fmt::format(
        "parallelize_module: the block's {} attention heads do not divide among the tp group's {} "
        "ranks; use a head count that is a multiple of {}, or another tp size",
        options.heads, tp, tp);
  }
  if (given.contains("mlp_fc") && options.mlp_hidden % tp != 0) {
    return fmt::format(
        "parallelize_module: the block's MLP size {} is not divisible by the tp group's {} ranks; "
        "use an MLP size that is a multiple of {}, or another tp size",
        options.mlp_hidden, tp, tp);
  }
  return {};
}

}  // namespace

const std::vector<std::string>& GptBlockImpl::linear_part_names() {
  static const std::vector<std::string> names = {"attn_qkv", "attn_proj", "mlp_fc", "mlp_proj"};
  return names;
}

GptBlockImpl::GptBlockImpl(GptBlockOptions options, MoeGroups moe_groups) : options_(options) {
  auto& o = options_;
  if (o.mlp_hidden == 0) o.mlp_hidden = 4 * o.hidden;
  if (o.hidden < 1 || o.heads < 1 || o.mlp_hidden < 1) {
    throw ConfigError(
        fmt::format("GptBlock: hidden {}, heads {} and mlp_hidden {} must be at "
                    "least 1",
                    o.hidden, o.heads, o.mlp_hidden));
  }
  if (o.hidden % o.heads != 0) {
    throw ConfigError(
        fmt::format("GptBlock: the hidden size {} is not divisible by the {} heads; "
                    "make it a multiple of the head count",
                    o.hidden, o.heads));
  }
  if (o.dropout < 0.0 || o.dropout >= 1.0) {
    throw ConfigError(
        fmt::format("GptBlock: dropout is {}; pass a probability in [0, 1)", o.dropout));
  }
  ln_1_ = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden})));
  auto qkv = register_module("attn_qkv", make_linear(o.hidden, 3 * o.hidden, o.seed, o.dtype));
  auto proj = register_module("attn_proj", make_linear(o.hidden, o.hidden, o.seed + 1, o.dtype));
  ln_2_ = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.hidden})));
  if (o.moe_experts > 0) {
    moe_ = register_module("moe", MoeLayer(MoeOptions{.hidden = o.hidden,
                                                      .ffn_hidden = o.mlp_hidden,
                                                      .experts = o.moe_experts,
                                                      .top_k = o.moe_top_k,
                                                      .capacity_factor = o.moe_capacity_factor,
                                                      .aux_loss_weight = o.moe_aux_weight,
                                                      .seed = o.seed + 2,
                                                      .dtype = o.dtype},
                                           std::move(moe_groups)));
  } else {
    mlp_fc_ = torch::nn::AnyModule(
        register_module("mlp_fc", make_linear(o.hidden, o.mlp_hidden, o.seed + 2, o.dtype)));
    mlp_proj_ = torch::nn::AnyModule(
        register_module("mlp_proj", make_linear(o.mlp_hidden, o.hidden, o.seed + 3, o.dtype)));
  }
  ln_1_->to(o.dtype);
  ln_2_->to(o.dtype);
  attn_qkv_ = torch::nn::AnyModule(qkv);
  attn_proj_ = torch::nn::AnyModule(proj);
  rng_ = std::make_shared<TensorParallelRng>(o.seed, 0);
}

torch::nn::AnyModule& GptBlockImpl::part(const std::string& name) {
  if (name == "attn_qkv") return attn_qkv_;
  if (name == "attn_proj") return attn_proj_;
  if (name == "mlp_fc") return mlp_fc_;
  return mlp_proj_;
}

torch::Tensor GptBlockImpl::forward(const torch::Tensor& x) {
  using Region = TensorParallelRng::Region;
  if (x.dim() != 3 || x.size(2) != options_.hidden) {
    throw ConfigError(fmt::format("GptBlock: the input has shape [{}]; pass [batch, sequence, {}]",
                                  fmt::join(x.sizes(), ", "), options_.hidden));
  }
  const auto batch = x.size(0);
  const auto sequence = x.size(1);
  const auto head_dim = options_.hidden / options_.heads;
  const double p = options_.dropout;

  // Attention over this rank's heads (all of them unless split): q|k|v blocks of heads x head_dim.
  const auto qkv = attn_qkv_.forward(ln_1_(x)).chunk(3, -1);
  const auto local_heads = qkv[0].size(-1) / head_dim;
  const auto by_head = [&](const torch::Tensor& t) {
    return t.reshape({batch, sequence, local_heads, head_dim}).transpose(1, 2);
  };
  torch::Tensor attended;
  if (cp_group_) {
    // This rank's positions against every rank's keys, around the cp ring.
    attended = ring_attention(by_head(qkv[0]), by_head(qkv[1]), by_head(qkv[2]), cp_group_);
  } else {
    auto scores = torch::matmul(by_head(qkv[0]), by_head(qkv[1]).transpose(-2, -1)) /
                  std::sqrt(static_cast<double>(head_dim));
    const auto future = torch::ones({sequence, sequence}, torch::kBool).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    const auto probs = rng_->dropout(torch::softmax(scores, -1), p, is_training(), Region::kSplit);
    attended = torch::matmul(probs, by_head(qkv[2]));
  }
  const auto heads_out =
      attended.transpose(1, 2).reshape({batch, sequence, local_heads * head_dim});
  auto h = x + rng_->dropout(attn_proj_.forward(heads_out), p, is_training(), Region::kReplicated);

  const auto mlp =
      moe_ ? moe_(ln_2_(h)) : mlp_proj_.forward(torch::gelu(mlp_fc_.forward(ln_2_(h))));
  return h + rng_->dropout(mlp, p, is_training(), Region::kReplicated);
}

std::vector<std::pair<std::string, torch::Tensor>> GptBlockImpl::full_named_parameters() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& child : named_children()) {
    const auto& name = child.key();
    const auto& module = child.value();
    LinearParameters full;
    if (const auto column = std::dynamic_pointer_cast<ColumnParallelLinearImpl>(module)) {
      full = column->gather_full();
    } else if (const auto row = std::dynamic_pointer_cast<RowParallelLinearImpl>(module)) {
      full = row->gather_full();
    } else if (const auto moe = std::dynamic_pointer_cast<MoeLayerImpl>(module)) {
      for (auto& [part, value] : moe->full_named_parameters())
        out.emplace_back(name + "." + part, std::move(value));
      continue;
    } else {
      for (const auto& param : module->named_parameters())
        out.emplace_back(name + "." + param.key(), param.value().detach().clone());
      continue;
    }
    out.emplace_back(name + ".weight", full.weight);
    out.emplace_back(name + ".bias", full.bias);
  }
  return out;
}

void GptBlockImpl::parallelize(std::shared_ptr<ProcessGroup> tp_group, const ParallelizePlan& plan,
                               std::shared_ptr<TensorParallelRng> rng) {
  auto& group = detail::tp_group_or_throw(tp_group, "parallelize_module");
  std::string error;
  if (tp_group_) {
    error = "parallelize_module: the block is already parallelised; parallelise a block once";
  } else {
    error = plan_problem(plan, options_, group.size());
  }
  std::vector<std::string> plan_text;
  for (const auto& [name, style] : plan)
    plan_text.push_back(fmt::format("{}={}", name, style_name(style)));
  // One agreement up front, so that ranks given different plans all fail here, before any of
  // them builds a layer the others do not.
  detail::agree_on_layer(
      group, "parallelize_module",
      fmt::format("GptBlock hidden={} heads={} mlp_hidden={} moe_experts={} plan: {}",
                  options_.hidden, options_.heads, options_.mlp_hidden, options_.moe_experts,
                  fmt::join(plan_text, ", ")),
      error);

  for (const auto& [name, style] : plan) {
    auto& slot = part(name);
    const auto linear = std::dynamic_pointer_cast<torch::nn::LinearImpl>(slot.ptr());
    const LinearParameters full{linear->weight.detach(), linear->bias.detach()};
    const auto in = full.weight.size(1);
    const auto out = full.weight.size(0);
    if (style == ParallelStyle::kColwise) {
      ColumnParallelLinear column(
          ColumnParallelLinearOptions{
              .in_features = in, .out_features = out, .fused_blocks = name == "attn_qkv" ? 3 : 1},
          tp_group, full);
      slot = torch::nn::AnyModule(replace_module(name, column));
    } else {
      RowParallelLinear row(RowParallelLinearOptions{.in_features = in, .out_features = out},
                            tp_group, full);
      slot = torch::nn::AnyModule(replace_module(name, row));
    }
  }
  tp_group_ = std::move(tp_group);
  rng_ = rng ? std::move(rng) : std::make_shared<TensorParallelRng>(options_.seed, group.rank());
}

void GptBlockImpl::context_parallel(std::shared_ptr<ProcessGroup> cp) {
  if (!cp) throw ConfigError("GptBlock::context_parallel: the cp group is null");
  if (cp_group_) {
    throw ConfigError("GptBlock::context_parallel: the block is context-parallel already");
  }
  if (options_.dropout > 0.0) {
    throw ConfigError(fmt::format(
        "GptBlock::context_parallel: the block has dropout {}; ring attention never holds the "
        "attention probabilities whole, so it cannot drop them: build the block without dropout",
        options_.dropout));
  }
  cp_group_ = std::move(cp);
}

ParallelizePlan gpt_block_tensor_parallel_plan() {
  return {{"attn_qkv", ParallelStyle::kColwise},
          {"attn_proj", ParallelStyle::kRowwise},
          {"mlp_fc", ParallelStyle::kColwise},
          {"mlp_proj", ParallelStyle::kRowwise}};
}

void parallelize_module(GptBlock& block, std::shared_ptr<ProcessGroup> tp_group,
                        const ParallelizePlan& plan, std::shared_ptr<TensorParallelRng> rng) {
  block->parallelize(std::move(tp_group), plan, std::move(rng));
}

}  // namespace ddp
