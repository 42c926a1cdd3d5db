// Everything of ddp's torch layer in one include: the torch.distributed calls, DDP and its comm
// hooks, samplers, ZeRO, FSDP, activation checkpointing, checkpoints, state dicts, and tensor and
// pipeline parallelism (docs/README.md). Each component's headers are in
// include/ddp/torch/<component>/, in the layer's dependency order (docs/architecture.md, "The
// torch layer"); a program that wants to compile faster includes only the ones it uses.
#pragma once

// core
#include "ddp/torch/core/output_tensors.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/core/version.h"
// recompute
#include "ddp/torch/recompute/activation_checkpoint.h"
// formats
#include "ddp/torch/formats/optimizer_mismatch_error.h"
#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/optimizer_wrapper.h"
#include "ddp/torch/formats/state_dict.h"
// c10d
#include "ddp/torch/c10d/c10d_process_group.h"
// api
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/api/json_codec.h"
// samplers
#include "ddp/torch/samplers/data_loader_sampler.h"
#include "ddp/torch/samplers/distributed_sampler.h"
// ddp/hooks
#include "ddp/torch/ddp/hooks/comm_hook_by_name.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/ddp/hooks/local_sgd.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "ddp/torch/ddp/hooks/quantized_hook.h"
// ddp
#include "ddp/torch/ddp/ddp_logging_data.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/grad_scaler.h"
#include "ddp/torch/ddp/reducer.h"
#include "ddp/torch/ddp/script_distributed_data_parallel.h"
#include "ddp/torch/ddp/sync_batch_norm.h"
// zero
#include "ddp/torch/zero/chunked_adam.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
// checkpoint
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/checkpoint/train_state.h"
// fsdp
#include "ddp/torch/fsdp/fsdp_memory.h"
#include "ddp/torch/fsdp/fully_sharded_data_parallel.h"
// parallel/mesh
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "ddp/torch/parallel/mesh/mesh_train_state.h"
// parallel/expert
#include "ddp/torch/parallel/expert/mixture_of_experts.h"
// parallel/tensor
#include "ddp/torch/parallel/tensor/gpt_block.h"
#include "ddp/torch/parallel/tensor/tensor_parallel.h"
#include "ddp/torch/parallel/tensor/tensor_parallel_dcp_layout.h"
// parallel/pipeline
#include "ddp/torch/parallel/pipeline/pipeline.h"

#include "ddp/torch/rpc/dist_autograd.h"
#include "ddp/torch/rpc/distributed_optimizer.h"
#include "ddp/torch/rpc/remote_module.h"
#include "ddp/torch/rpc/rpc.h"
#include "ddp/torch/rpc/rref.h"
