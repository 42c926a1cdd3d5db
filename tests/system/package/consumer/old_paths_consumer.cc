// A program written against the torch layer's headers before they moved into component folders
// (issue 50): every old path must still compile, without a warning under -Werror, through the
// forwarding headers at include/ddp/torch/*.h; the umbrella header compiles beside them.
// clang-format off
#include "ddp/torch/c10d_process_group.h"
#include "ddp/torch/checkpoint.h"
#include "ddp/torch/chunked_adam.h"
#include "ddp/torch/comm_hook_by_name.h"
#include "ddp/torch/comm_hooks.h"
#include "ddp/torch/data_loader_sampler.h"
#include "ddp/torch/ddp_logging_data.h"
#include "ddp/torch/device_mesh.h"
#include "ddp/torch/distributed.h"
#include "ddp/torch/distributed_data_parallel.h"
#include "ddp/torch/distributed_objects.h"
#include "ddp/torch/distributed_sampler.h"
#include "ddp/torch/fsdp_memory.h"
#include "ddp/torch/fully_sharded_data_parallel.h"
#include "ddp/torch/gpt_block.h"
#include "ddp/torch/grad_scaler.h"
#include "ddp/torch/join.h"
#include "ddp/torch/json_codec.h"
#include "ddp/torch/local_sgd.h"
#include "ddp/torch/mesh_train_state.h"
#include "ddp/torch/optimizer_state_dict.h"
#include "ddp/torch/output_tensors.h"
#include "ddp/torch/pipeline.h"
#include "ddp/torch/powersgd_hook.h"
#include "ddp/torch/quantized_hook.h"
#include "ddp/torch/reducer.h"
#include "ddp/torch/script_distributed_data_parallel.h"
#include "ddp/torch/state_dict.h"
#include "ddp/torch/sync_batch_norm.h"
#include "ddp/torch/tensor_collectives.h"
#include "ddp/torch/tensor_parallel.h"
#include "ddp/torch/train_state.h"
#include "ddp/torch/version.h"
#include "ddp/torch/zero_redundancy_optimizer.h"
// clang-format on
#include "ddp/torch.h"

#include <iostream>

int main() {
  ddp::DistributedSampler sampler(10, /*rank=*/0, /*world_size=*/2);
  std::cout << "old paths: " << sampler.size() << " samples of 10 on rank 0 of 2\n";
  return sampler.size() == 5 ? 0 : 1;
}
