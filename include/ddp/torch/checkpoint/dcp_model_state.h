// A replicated model (DDP's) and its optimizer in a distributed checkpoint, in the layout of
// PyTorch's torch.distributed.checkpoint.state_dict (get_state_dict / set_state_dict), so a C++
// job and a Python job resume from each other's checkpoints:
//
//   ddp::save_dcp(ddp::dcp_model_state(*model, &optimizer), "ckpt/step_1000");   // every rank
//   ddp::load_dcp_model_state("ckpt/step_1000", *model, &optimizer);             // any world size
//
//   # Python, the same folder:
//   model_sd, optim_sd = get_state_dict(model, optimizer)
//   dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt/step_1000")
//   set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
//
// Layout: "model.<name>" for each parameter and buffer under Python's names (state_dict()), and
// "optim.state.<parameter name>.<key>" (Adam's step, exp_avg, exp_avg_sq; SGD's
// momentum_buffer) and "optim.param_groups.<i>.<option>" with "params" listing parameter names,
// as get_state_dict keys an optimizer's state by name instead of by index
// (optimizer_state_dict.h says which optimizers and options). Every rank adds every entry
// (replicated): save_dcp writes each once and refuses ranks whose copies differ.
//
// Pass the module DistributedDataParallel wraps (its module()), so names carry no "module.".
//
// Errors: ConfigError for an optimizer parameter the model does not name, or an optimizer other
// than SGD, Adam or AdamW; on load, StateDictMismatchError (strict, the default) naming the
// missing, unexpected and mismatched (shape, dtype) model entries, and OptimizerMismatchError /
// StateDictFormatError as load_optimizer_state_dict throws them, before anything changes; the
// DcpReader's errors (a folder that is no checkpoint, damaged data).
//
// A model split across ranks (tensor-parallel layers, pipeline stages) saves and loads through a
// DcpModelLayout: each split tensor is this rank's part of the whole model's tensor of the same
// name (parallel/tensor/tensor_parallel.h's tensor_parallel_dcp_layout describes ddp's layers),
// so a checkpoint saved at one split loads at any other; each rank reads only the regions of the
// saved chunks its parts overlap. A pipeline stage is part_of_model: the checkpoint's entries of
// other stages are not unexpected. With per_parameter_groups the optimizer's options are saved
// per parameter ("optim.param_groups.<name>.lr", PyTorch's flatten_optimizer_state_dict), so
// stages that hold different parameters agree on every entry; a load reads either layout.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"

#pragma GCC visibility push(default)
namespace ddp {

// Where this rank's tensor lies in the whole model's tensor of the same name: viewed as
// `local_view` (a reshape of it; empty: its own shape), it is the region at `offsets` of a tensor
// of shape `global_shape`. E.g. a column-parallel weight [out / tp, in] of tp rank r: global
// {out, in}, offsets {r * out / tp, 0}; a fused q|k|v one [3 * h / tp, in]: local_view
// {3, h / tp, in}, global {3, h, in}, offsets {0, r * h / tp, 0}, saved {3 * h, in}.
struct DcpShardSpec {
  std::vector<std::int64_t> local_view;
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> global_shape;
  // The shape the checkpoint records, where it is not global_shape (empty): global_shape with
  // its first two dimensions merged, as PyTorch's nn.Linear holds a fused q|k|v ([3 * h, in]).
  // The part is then saved as one chunk per index of its first dimension (each rank's rows of
  // each block); a load also reads a checkpoint that recorded global_shape itself.
  std::vector<std::int64_t> saved_shape;
};

struct DcpModelLayout {
  // By state_dict name; the optimizer's state tensors of the parameter's shape follow it. A name
  // not here is held whole (replicated).
  std::map<std::string, DcpShardSpec> shards;
  // This rank's model is a part (a pipeline stage): on load, the checkpoint's model and optimizer
  // entries for parameters it does not hold are neither read nor unexpected.
  bool part_of_model = false;
  // Save the optimizer's options per parameter ("optim.param_groups.<name>.<option>") instead of
  // per group ("optim.param_groups.<i>.<option>" and "params"): needed where ranks hold
  // different parameters (pipeline stages), whose groups would differ.
  bool per_parameter_groups = false;
};

// The entries of `model` (under "model.") and, if given, `optimizer` (under "optim."), as
// replicated tensors and values, or as parts where `layout` says so. The tensors are the model's
// own (save_dcp copies as it writes). ConfigError also for a shard spec that does not fit its
// tensor (a view of another element count, offsets or sizes outside the global shape).
DcpStateDict dcp_model_state(const torch::nn::Module& model,
                             const torch::optim::Optimizer* optimizer = nullptr,
                             const DcpModelLayout& layout = {});

// Loads the model's parameters and buffers, and the optimizer's state and options if given, from
// the checkpoint in `folder` (saved at any world size, by ddp or by PyTorch's dcp.save of
// get_state_dict's dicts). Not collective: every rank reads it. All of it is read and checked
// before the model or the optimizer changes. Returns what the model load found (with strict =
// false, the entries that fit are loaded and the rest reported).
// With a layout, each split tensor is read as the region of the saved tensor its spec names
// (StateDictMismatchError naming the entry and both global shapes where they differ).
StateDictLoadReport load_dcp_model_state(const std::filesystem::path& folder,
                                         torch::nn::Module& model,
                                         torch::optim::Optimizer* optimizer = nullptr,
                                         StateDictLoadOptions options = {},
                                         const DcpModelLayout& layout = {});

}  // namespace ddp
#pragma GCC visibility pop
