// A program written against the headers' paths before they moved into folders (issue 50): every
// old path must still compile, without a warning under -Werror, through the forwarding headers at
// include/ddp/*.h (the engine's, now in ddp/{store,launch,comm,runtime}) and include/ddp/torch/*.h
// (the torch layer's components); the umbrella header compiles beside them.
// clang-format off
#include "ddp/comm_error.h"
#include "ddp/external_backend.h"
#include "ddp/init.h"
#include "ddp/job_secret.h"
#include "ddp/launch_environment.h"
#include "ddp/mpi_process_group.h"
#include "ddp/nccl_process_group.h"
#include "ddp/prefix_store.h"
#include "ddp/process_group.h"
#include "ddp/rendezvous.h"
#include "ddp/ring_process_group.h"
#include "ddp/store.h"
#include "ddp/tcp_store.h"
#include "ddp/tcp_store_server.h"
#include "ddp/trace.h"
#include "ddp/types.h"
#include "ddp/work.h"
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
  ddp::LaunchOptions options;
  options.rank = 1;
  options.world_size = 2;
  const auto env = ddp::resolve_launch_environment(options);
  std::cout << "old paths: " << sampler.size() << " samples of 10 on rank 0 of 2; rank " << env.rank
            << " of " << env.world_size << "\n";
  return sampler.size() == 5 && env.rank == 1 ? 0 : 1;
}
