// ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding and the full initial weights
// they are cut from (tensor_parallel.h).
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdint>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "torch/api/rank_agreement.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/fingerprint.h"
#include "torch/core/split_parameters.h"
#include "torch/parallel/tensor/tensor_parallel_internal.h"

namespace ddp {

namespace detail {

ProcessGroup& tp_group_or_throw(const std::shared_ptr<ProcessGroup>& group,
                                const std::string& call) {
  if (!group) {
    throw ConfigError(fmt::format(
        "{}: the group is null (this rank is not a member of it); pass this rank's tp group, e.g. "
        "DeviceMesh::group(\"tp\")",
        call));
  }
  return *group;
}

void agree_on_layer(ProcessGroup& group, const std::string& layer, const std::string& description,
                    const std::string& local_error) {
  const auto agreement = compare_across_ranks(group, description, local_error);
  if (agreement.failed_rank >= 0) {
    if (!local_error.empty()) throw ConfigError(local_error);
    throw ConfigError(fmt::format("{}: rank {} of the tp group could not build it: {}", layer,
                                  agreement.failed_rank, agreement.failure));
  }
  if (!agreement.difference.empty()) {
    throw ConfigError(fmt::format(
        "{}: the ranks of the tp group were given different layers: {}; build it with the same "
        "sizes and seed (or the same full weights) on every rank",
        layer, agreement.difference));
  }
}

std::uint64_t tensor_fingerprint(const torch::Tensor& tensor) {
  if (!tensor.defined()) return 0;
  const auto bytes = tensor.detach().contiguous();
  return fingerprint(bytes.data_ptr(),
                     static_cast<std::size_t>(bytes.numel()) * bytes.element_size());
}

}  // namespace detail

namespace {

std::string dtype_name(torch::Dtype dtype) {
  return std::string(c10::toString(dtype));
}

// Sizes of `full` against the layer's; "" when they match.
std::string full_linear_problem(const char* layer, const LinearParameters& full, std::int64_t in,
                                std::int64_t out, bool bias) {
  if (!full.weight.defined() || full.weight.dim() != 2 || full.weight.size(0) != out ||
      full.weight.size(1) != in) {
    return fmt::format(
        "{}: the given full weight has shape [{}], expected [{}, {}] (out, in)", layer,
        full.weight.defined() ? fmt::format("{}", fmt::join(full.weight.sizes(), ", "))
                              : "undefined",
        out, in);
  }
  if (bias != full.bias.defined() || (bias && (full.bias.dim() != 1 || full.bias.size(0) != out))) {
    return fmt::format("{}: the options say bias={} but the given full bias is {}", layer, bias,
                       full.bias.defined()
                           ? fmt::format("of shape [{}]", fmt::join(full.bias.sizes(), ", "))
                           : "undefined");
  }
  return {};
}

std::string weights_description(const LinearParameters& full) {
  return fmt::format("weights={:016x}/{:016x} dtype={}", detail::tensor_fingerprint(full.weight),
                     detail::tensor_fingerprint(full.bias), dtype_name(full.weight.scalar_type()));
}

}  // namespace

LinearParameters initial_linear_parameters(std::int64_t in_features, std::int64_t out_features,
                                           bool bias, std::uint64_t seed, torch::Dtype dtype) {
  if (in_features < 1 || out_features < 1) {
    throw ConfigError(fmt::format(
        "initial_linear_parameters: in_features {} and out_features {} must be at least 1",
        in_features, out_features));
  }
  auto generator = at::detail::createCPUGenerator(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  LinearParameters full;
  full.weight = torch::empty({out_features, in_features}, torch::dtype(dtype))
                    .uniform_(-bound, bound, generator);
  if (bias)
    full.bias =
        torch::empty({out_features}, torch::dtype(dtype)).uniform_(-bound, bound, generator);
  return full;
}

torch::Tensor initial_embedding_weight(std::int64_t num_embeddings, std::int64_t embedding_dim,
                                       std::uint64_t seed, torch::Dtype dtype) {
  if (num_embeddings < 1 || embedding_dim < 1) {
    throw ConfigError(fmt::format(
        "initial_embedding_weight: num_embeddings {} and embedding_dim {} must be at least 1",
        num_embeddings, embedding_dim));
  }
  auto generator = at::detail::createCPUGenerator(seed);
  return torch::empty({num_embeddings, embedding_dim}, torch::dtype(dtype))
      .normal_(0.0, 1.0, generator);
}

// ---- ColumnParallelLinear -------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                                                   std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  build(nullptr);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options,
                                                   std::shared_ptr<ProcessGroup> group,
                                                   const LinearParameters& full)
    : options_(options), group_(std::move(group)) {
  build(&full);
}

void ColumnParallelLinearImpl::build(const LinearParameters* given) {
  constexpr const char* layer = "ColumnParallelLinear";
  auto& group = detail::tp_group_or_throw(group_, layer);
  const std::int64_t tp = group.size();
  const auto& o = options_;
  std::string error;
  if (o.in_features < 1 || o.out_features < 1 || o.fused_blocks < 1) {
    error =
        fmt::format("{}: in_features {}, out_features {} and fused_blocks {} must be at least 1",
                    layer, o.in_features, o.out_features, o.fused_blocks);
  } else if (o.out_features % (tp * o.fused_blocks) != 0) {
    error = fmt::format(
        "{}: out_features {} is not divisible by the tp group's {} ranks{}; make the output size "
        "(e.g. the hidden size or the number of heads) a multiple of {}, or use another tp size",
        layer, o.out_features, tp,
        o.fused_blocks > 1 ? fmt::format(" x {} fused blocks", o.fused_blocks) : "",
        tp * o.fused_blocks);
  } else if (given != nullptr) {
    error = full_linear_problem(layer, *given, o.in_features, o.out_features, o.bias);
  }
  const std::string description =
      fmt::format("in_features={} out_features={} bias={} fused_blocks={} gather_output={} {}",
                  o.in_features, o.out_features, o.bias, o.fused_blocks, o.gather_output,
                  given != nullptr && error.empty()
                      ? weights_description(*given)
                      : fmt::format("seed={} dtype={}", o.seed, dtype_name(o.dtype)));
  detail::agree_on_layer(group, layer, description, error);

  const auto full = given != nullptr ? *given
                                     : initial_linear_parameters(o.in_features, o.out_features,
                                                                 o.bias, o.seed, o.dtype);
  options_.dtype = full.weight.scalar_type();
  // Rows r of each fused block: [fused, out / fused, in] -> this rank's [fused, part, in].
  const auto part = o.out_features / (tp * o.fused_blocks);
  const auto first = part * group.rank();
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight",
                              full.weight.detach()
                                  .reshape({o.fused_blocks, o.out_features / o.fused_blocks, -1})
                                  .narrow(1, first, part)
                                  .reshape({o.out_features / tp, o.in_features})
                                  .clone());
  if (o.bias) {
    bias = register_parameter("bias", full.bias.detach()
                                          .reshape({o.fused_blocks, -1})
                                          .narrow(1, first, part)
                                          .reshape({o.out_features / tp})
                                          .clone());
  }
  for (const auto& p : {weight, bias})
    if (p.defined())
      detail::note_split_parameter(p, {.part = group.rank(), .parts = static_cast<int>(tp)});
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& input) {
  auto output = torch::linear(copy_to_tensor_parallel_region(input, group_), weight, bias);
  if (!options_.gather_output) return output;
  output = gather_from_tensor_parallel_region(output, group_);
  if (options_.fused_blocks == 1) return output;
  // Gathered rank by rank ([tp, fused, part]); the full layer's order is [fused, tp, part].
  const auto full_sizes = output.sizes().vec();
  auto split_sizes = full_sizes;
  split_sizes.back() = group_->size();
  split_sizes.push_back(options_.fused_blocks);
  split_sizes.push_back(-1);
  return output.reshape(split_sizes).transpose(-3, -2).reshape(full_sizes);
}

LinearParameters ColumnParallelLinearImpl::gather_full() const {
  const std::int64_t tp = group_->size();
  const auto& o = options_;
  auto gathered = torch::empty({tp, o.out_features / tp, o.in_features}, weight.options());
  all_gather_into_tensor(gathered, weight.detach().contiguous(), *group_);
  LinearParameters full;
  full.weight = gathered.reshape({tp, o.fused_blocks, -1, o.in_features})
                    .transpose(0, 1)
                    .reshape({o.out_features, o.in_features});
  if (bias.defined()) {
    auto gathered_bias = torch::empty({tp, o.out_features / tp}, bias.options());
    all_gather_into_tensor(gathered_bias, bias.detach().contiguous(), *group_);
    full.bias = gathered_bias.reshape({tp, o.fused_blocks, -1}).transpose(0, 1).reshape({-1});
  }
  return full;
}

// ---- RowParallelLinear ----------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options,
                                             std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  build(nullptr);
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options,
                                             std::shared_ptr<ProcessGroup> group,
                                             const LinearParameters& full)
    : options_(options), group_(std::move(group)) {
  build(&full);
}

void RowParallelLinearImpl::build(const LinearParameters* given) {
  constexpr const char* layer = "RowParallelLinear";
  auto& group = detail::tp_group_or_throw(group_, layer);
  const std::int64_t tp = group.size();
  const auto& o = options_;
  std::string error;
  if (o.in_features < 1 || o.out_features < 1) {
    error = fmt::format("{}: in_features {} and out_features {} must be at least 1", layer,
                        o.in_features, o.out_features);
  } else if (o.in_features % tp != 0) {
    error = fmt::format(
        "{}: in_features {} is not divisible by the tp group's {} ranks; make the input size "
        "(e.g. the hidden or MLP size) a multiple of {}, or use another tp size",
        layer, o.in_features, tp, tp);
  } else if (given != nullptr) {
    error = full_linear_problem(layer, *given, o.in_features, o.out_features, o.bias);
  }
  const std::string description =
      fmt::format("in_features={} out_features={} bias={} input_is_parallel={} {}", o.in_features,
                  o.out_features, o.bias, o.input_is_parallel,
                  given != nullptr && error.empty()
                      ? weights_description(*given)
                      : fmt::format("seed={} dtype={}", o.seed, dtype_name(o.dtype)));
  detail::agree_on_layer(group, layer, description, error);

  const auto full = given != nullptr ? *given
                                     : initial_linear_parameters(o.in_features, o.out_features,
                                                                 o.bias, o.seed, o.dtype);
  options_.dtype = full.weight.scalar_type();
  const auto part = o.in_features / tp;
  torch::NoGradGuard no_grad;
  weight = register_parameter(
      "weight", full.weight.detach().narrow(1, part * group.rank(), part).contiguous().clone());
  if (o.bias) bias = register_parameter("bias", full.bias.detach().clone());
  detail::note_split_parameter(
      weight, {.part = group.rank(), .parts = static_cast<int>(tp)});  // the bias is whole
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& input) {
  const auto parallel_input =
      options_.input_is_parallel ? input : scatter_to_tensor_parallel_region(input, group_);
  auto output = reduce_from_tensor_parallel_region(torch::linear(parallel_input, weight), group_);
  // The bias is added once, after the reduction (adding it on every rank would count it tp times).
  return bias.defined() ? output + bias : output;
}

LinearParameters RowParallelLinearImpl::gather_full() const {
  const std::int64_t tp = group_->size();
  const auto& o = options_;
  auto gathered = torch::empty({tp, o.out_features, o.in_features / tp}, weight.options());
  all_gather_into_tensor(gathered, weight.detach().contiguous(), *group_);
  LinearParameters full;
  full.weight = gathered.permute({1, 0, 2}).reshape({o.out_features, o.in_features});
  if (bias.defined()) full.bias = bias.detach().clone();
  return full;
}

// ---- VocabParallelEmbedding -----------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                                                       std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)) {
  build(nullptr);
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options,
                                                       std::shared_ptr<ProcessGroup> group,
                                                       const torch::Tensor& full)
    : options_(options), group_(std::move(group)) {
  build(&full);
}

void VocabParallelEmbeddingImpl::build(const torch::Tensor* given) {
  constexpr const char* layer = "VocabParallelEmbedding";
  auto& group = detail::tp_group_or_throw(group_, layer);
  const std::int64_t tp = group.size();
  const auto& o = options_;
  std::string error;
  if (o.num_embeddings < 1 || o.embedding_dim < 1) {
    error = fmt::format("{}: num_embeddings {} and embedding_dim {} must be at least 1", layer,
                        o.num_embeddings, o.embedding_dim);
  } else if (o.num_embeddings % tp != 0) {
    error = fmt::format(
        "{}: the vocabulary size (num_embeddings) {} is not divisible by the tp group's {} ranks; "
        "pad the vocabulary to a multiple of {} (as Megatron does), or use another tp size",
        layer, o.num_embeddings, tp, tp);
  } else if (given != nullptr &&
             (!given->defined() || given->dim() != 2 || given->size(0) != o.num_embeddings ||
              given->size(1) != o.embedding_dim)) {
    error = fmt::format(
        "{}: the given full table has shape [{}], expected [{}, {}]", layer,
        given->defined() ? fmt::format("{}", fmt::join(given->sizes(), ", ")) : "undefined",
        o.num_embeddings, o.embedding_dim);
  }
  const std::string description =
      fmt::format("num_embeddings={} embedding_dim={} {}", o.num_embeddings, o.embedding_dim,
                  given != nullptr && error.empty()
                      ? fmt::format("weights={:016x} dtype={}", detail::tensor_fingerprint(*given),
                                    dtype_name(given->scalar_type()))
                      : fmt::format("seed={} dtype={}", o.seed, dtype_name(o.dtype)));
  detail::agree_on_layer(group, layer, description, error);

  const auto full = given != nullptr ? *given
                                     : initial_embedding_weight(o.num_embeddings, o.embedding_dim,
                                                                o.seed, o.dtype);
  options_.dtype = full.scalar_type();
  const auto part = o.num_embeddings / tp;
  torch::NoGradGuard no_grad;
  weight = register_parameter("weight", full.detach().narrow(0, part * group.rank(), part).clone());
  detail::note_split_parameter(weight, {.part = group.rank(), .parts = static_cast<int>(tp)});
}

std::int64_t VocabParallelEmbeddingImpl::vocab_start() const {
  return options_.num_embeddings / group_->size() * group_->rank();
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  detail::check_collective(*group_, [&] {
    if (!ids.defined() || ids.scalar_type() != torch::kInt64) {
      throw ConfigError("VocabParallelEmbedding: the ids must be a defined int64 tensor");
    }
    if (ids.numel() > 0) {
      const auto low = ids.min().item<std::int64_t>();
      const auto high = ids.max().item<std::int64_t>();
      if (low < 0 || high >= options_.num_embeddings) {
        throw ConfigError(fmt::format(
            "VocabParallelEmbedding: ids range over [{}, {}], outside the vocabulary [0, {})", low,
            high, options_.num_embeddings));
      }
    }
  });
  const auto start = vocab_start();
  const auto outside = (ids < start) | (ids >= start + weight.size(0));
  const auto local_ids = (ids - start).masked_fill(outside, 0);
  // Rows of other ranks' ids are zero here; the all-reduce fills them in from their owners.
  auto rows = torch::embedding(weight, local_ids).masked_fill(outside.unsqueeze(-1), 0.0);
  return reduce_from_tensor_parallel_region(rows, group_);
}

torch::Tensor VocabParallelEmbeddingImpl::gather_full() const {
  auto gathered = torch::empty({options_.num_embeddings, options_.embedding_dim}, weight.options());
  all_gather_into_tensor(gathered, weight.detach().contiguous(), *group_);
  return gathered;
}

std::vector<torch::Tensor> tensor_parallel_split_parameters(const torch::nn::Module& module) {
  std::vector<torch::Tensor> split;
  const auto add = [&split](const torch::Tensor& t) {
    if (t.defined()) split.push_back(t);
  };
  for (const auto& m : module.modules()) {
    if (const auto* column = m->as<ColumnParallelLinearImpl>()) {
      add(column->weight);
      add(column->bias);
    } else if (const auto* row = m->as<RowParallelLinearImpl>()) {
      add(row->weight);
    } else if (const auto* vocab = m->as<VocabParallelEmbeddingImpl>()) {
      add(vocab->weight);
    }
  }
  return split;
}

}  // namespace ddp
