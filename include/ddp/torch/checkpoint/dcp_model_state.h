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
#pragma once

#include <filesystem>

#include <torch/torch.h>

#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"

#pragma GCC visibility push(default)
namespace ddp {

// The entries of `model` (under "model.") and, if given, `optimizer` (under "optim."), as
// replicated tensors and values. The tensors are the model's own (save_dcp copies as it writes).
DcpStateDict dcp_model_state(const torch::nn::Module& model,
                             const torch::optim::Optimizer* optimizer = nullptr);

// Loads the model's parameters and buffers, and the optimizer's state and options if given, from
// the checkpoint in `folder` (saved at any world size, by ddp or by PyTorch's dcp.save of
// get_state_dict's dicts). Not collective: every rank reads it. All of it is read and checked
// before the model or the optimizer changes. Returns what the model load found (with strict =
// false, the entries that fit are loaded and the rest reported).
StateDictLoadReport load_dcp_model_state(const std::filesystem::path& folder,
                                         torch::nn::Module& model,
                                         torch::optim::Optimizer* optimizer = nullptr,
                                         StateDictLoadOptions options = {});

}  // namespace ddp
#pragma GCC visibility pop
