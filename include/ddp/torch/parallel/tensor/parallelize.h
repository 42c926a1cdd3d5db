// parallelize_module for a Sequential (PyTorch's
// torch.distributed.tensor.parallel.parallelize_module with a plan): the torch::nn::Linear and
// torch::nn::Embedding children a plan names become ddp's tensor-parallel layers over `tp`, cut
// from their current weights (the same on every rank: built from one seed, or loaded alike), and
// the parts a plan names of a GptBlock child are split by GptBlock's own parallelize_module.
//
//   torch::nn::Sequential model(torch::nn::Embedding(vocab, 64), torch::nn::Linear(64, 256),
//                               torch::nn::GELU(), torch::nn::Linear(256, 64), block, head);
//   model = ddp::parallelize_module(model, mesh.group("tp"),
//                                   {{"0", ddp::ParallelStyle::kVocab},
//                                    {"1", ddp::ParallelStyle::kColwise},
//                                    {"3", ddp::ParallelStyle::kRowwise},
//                                    {"*.attn_qkv", ddp::ParallelStyle::kColwise}, ...});
//
// Plan keys (each must match at least one module, and no module may be matched twice):
// - a module path as named_modules() writes it: "1", "fc", "4.mlp_fc";
// - a path pattern whose '*' stands for one whole segment: "*.mlp_fc";
// - "type:" and a module type as Module::name() writes it: "type:torch::nn::EmbeddingImpl".
// Styles: kColwise and kRowwise for a Linear (ColumnParallelLinear, RowParallelLinear), kVocab for
// an Embedding (VocabParallelEmbedding; one without padding_idx, max_norm or sparse gradients).
//
// Activations stay right without the caller saying where they are split. A colwise child's output
// is split along the last dimension; it is left split only when what follows it in the Sequential,
// up to a rowwise child, is elementwise (ReLU, GELU, SiLU, Tanh, Sigmoid, ... and Identity), and
// that rowwise child then takes the split input as it is (Megatron's MLP: one all-reduce forward,
// one backward per pair). Anywhere else the colwise child gathers its output (gather_output), and a
// rowwise child whose input is not split scatters it first, so a LayerNorm or a reshape never sees
// a part.
//
// libtorch's modules hold their children in C++ fields that cannot be swapped (and a Sequential
// cannot hold a Sequential), so the Sequential is rebuilt with its named children replaced (every
// other child shared, every name kept); a named module inside any other module than a GptBlock is
// a ConfigError naming its parent (give that module tensor-parallel layers itself, as GptBlock
// does). Collective over `tp`: every rank's plan and matches are compared first, then each new
// layer agrees on its sizes. ConfigError on every rank for a key that matches nothing, a module
// matched twice, a style its type does not take, ranks given different plans, and a size not
// divisible by tp.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Module path, path pattern or "type:<name>" -> how that module is split.
using ModuleParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

torch::nn::Sequential parallelize_module(const torch::nn::Sequential& model,
                                         std::shared_ptr<ProcessGroup> tp,
                                         const ModuleParallelizePlan& plan);

}  // namespace ddp
#pragma GCC visibility pop
