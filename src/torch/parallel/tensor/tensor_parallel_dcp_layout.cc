// tensor_parallel_dcp_layout (ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h): each
// split parameter's place in its whole tensor, from the layer's options and its group.
#include "ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h"

#include <cstdint>
#include <string>

#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"

namespace ddp {
namespace {

std::string join(const std::string& prefix, const char* name) {
  return prefix.empty() ? std::string(name) : prefix + "." + name;
}

// The part of rank `rank` of `parts` equal parts along dimension `dim` of `global`.
DcpShardSpec part_of(std::vector<std::int64_t> global, std::size_t dim, std::int64_t rank,
                     std::int64_t parts, std::vector<std::int64_t> view = {}) {
  DcpShardSpec spec;
  spec.offsets.assign(global.size(), 0);
  spec.offsets[dim] = rank * (global[dim] / parts);
  spec.local_view = std::move(view);
  spec.global_shape = std::move(global);
  return spec;
}

// A fused weight or bias [blocks, rows, ...] split along its rows, saved as PyTorch's nn.Linear
// holds it: [blocks * rows, ...].
DcpShardSpec fused_part_of(std::vector<std::int64_t> global, std::int64_t rank,
                           std::int64_t parts) {
  std::vector<std::int64_t> view = global;
  view[1] /= parts;
  DcpShardSpec spec = part_of(global, 1, rank, parts, std::move(view));
  spec.saved_shape = {global[0] * global[1]};
  spec.saved_shape.insert(spec.saved_shape.end(), global.begin() + 2, global.end());
  return spec;
}

// The specs of `m`'s own parameters, if it is one of ddp's split layers, under `prefix`.
void add_specs(const torch::nn::Module& m, const std::string& prefix, DcpModelLayout& layout) {
  if (const auto* column = m.as<ColumnParallelLinearImpl>()) {
    const auto& o = column->options();
    const std::int64_t tp = column->group()->size(), r = column->group()->rank();
    const std::int64_t f = o.fused_blocks, rows = o.out_features / f;
    if (f == 1) {
      layout.shards.emplace(join(prefix, "weight"), part_of({rows, o.in_features}, 0, r, tp));
      if (column->bias.defined())
        layout.shards.emplace(join(prefix, "bias"), part_of({rows}, 0, r, tp));
    } else {
      layout.shards.emplace(join(prefix, "weight"), fused_part_of({f, rows, o.in_features}, r, tp));
      if (column->bias.defined())
        layout.shards.emplace(join(prefix, "bias"), fused_part_of({f, rows}, r, tp));
    }
  } else if (m.as<GptBlockImpl>() != nullptr) {
    // A GptBlock not split (tp 1) holds its fused q|k|v as one nn.Linear, which is how the
    // split one saves it ([3 * h, in]); its spec (one part of one) lets a checkpoint that
    // recorded [3, h, in] (before ddp saved the merged shape) load too.
    for (const auto& child : m.named_children()) {
      const auto* linear = child.value()->as<torch::nn::LinearImpl>();
      if (child.key() != "attn_qkv" || linear == nullptr) continue;
      const std::int64_t rows = linear->weight.size(0) / 3, in = linear->weight.size(1);
      layout.shards.emplace(join(prefix, "attn_qkv.weight"), fused_part_of({3, rows, in}, 0, 1));
      if (linear->bias.defined())
        layout.shards.emplace(join(prefix, "attn_qkv.bias"), fused_part_of({3, rows}, 0, 1));
    }
  } else if (const auto* row = m.as<RowParallelLinearImpl>()) {
    const auto& o = row->options();
    layout.shards.emplace(
        join(prefix, "weight"),
        part_of({o.out_features, o.in_features}, 1, row->group()->rank(), row->group()->size()));
  } else if (const auto* vocab = m.as<VocabParallelEmbeddingImpl>()) {
    const auto& o = vocab->options();
    layout.shards.emplace(join(prefix, "weight"),
                          part_of({o.num_embeddings, o.embedding_dim}, 0, vocab->group()->rank(),
                                  vocab->group()->size()));
  }
}

}  // namespace

DcpModelLayout tensor_parallel_dcp_layout(const torch::nn::Module& module) {
  DcpModelLayout layout;
  // The module itself apart: named_modules(include_self) needs it held by a shared_ptr.
  add_specs(module, "", layout);
  for (const auto& item : module.named_modules("", /*include_self=*/false))
    add_specs(*item.value(), item.key(), layout);
  return layout;
}

}  // namespace ddp
