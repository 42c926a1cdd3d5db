// The DcpModelLayout (checkpoint/dcp_model_state.h) of a module holding ddp's tensor-parallel
// layers: each split parameter is this tp rank's part of the whole layer's tensor, so a
// checkpoint saved at one tp size (and pipeline split) loads at any other:
//
//   ddp::DcpModelLayout layout = ddp::tensor_parallel_dcp_layout(*stage);
//   layout.part_of_model = true;  layout.per_parameter_groups = true;   // a pipeline stage
//   ddp::save_dcp(ddp::dcp_model_state(*stage, &optimizer, layout), dir);
//   ddp::load_dcp_model_state(dir, *stage, &optimizer, {}, layout);     // at another split
//
// ColumnParallelLinear: weight [out / tp, in] at rows r * out / tp of [out, in], its bias alike;
// with fused_blocks f (a fused q|k|v) the weight is viewed as [f, out / (f * tp), in], rank r's
// rows of each block, in a tensor [f, out / f, in] saved as [out, in] (DcpShardSpec::saved_shape:
// what PyTorch's nn.Linear holds, and what any tp size saves, one chunk per block and rank; a
// GptBlock that is not split, at tp 1, saves its attn_qkv the same way; a checkpoint that recorded
// [f, out / f, in] loads too). RowParallelLinear: weight
// [out, in / tp] at columns r * in / tp (its bias is whole). VocabParallelEmbedding: weight
// [V / tp, D] at rows r * V / tp. Names are `module`'s state_dict names.
#pragma once

#include <torch/torch.h>

#include "ddp/torch/checkpoint/dcp_model_state.h"

#pragma GCC visibility push(default)
namespace ddp {

DcpModelLayout tensor_parallel_dcp_layout(const torch::nn::Module& module);

}  // namespace ddp
#pragma GCC visibility pop
