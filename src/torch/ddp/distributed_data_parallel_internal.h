// Private to DistributedDataParallel's sources (distributed_data_parallel.cc, ddp_forward.cc,
// ddp_join.cc, ddp_logging_data.cc): the step plan of a Join, and the helpers they share, defined
// in distributed_data_parallel.cc.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/ddp/distributed_data_parallel.h"

namespace ddp {

// What the ranks do in one training step under Join, agreed by one allreduce (max) in which a
// joined rank contributes zeros.
struct DistributedDataParallelBase::StepPlan {
  bool sync = false;               // gradients of this step are synchronised
  bool broadcast_buffers = false;  // buffers are broadcast before forward
  bool rebuild = false;            // buckets are rebuilt before forward
  int buffer_root = 0;             // the highest rank still training
  bool loaded = false;             // some rank loaded or replaced parameters (divergence guard)
};

namespace detail {

// The parameters that train, each once (a parameter shared by two submodules appears twice), in
// registration order: what the Reducer works on.
void collect_trainable(const WrappedModuleTensors& module, std::vector<torch::Tensor>& params,
                       std::vector<std::string>& names);

// Every parameter (trainable or not) and every buffer: what rank 0 sends at construction and
// after a Join.
std::vector<torch::Tensor> parameters_and_buffers(const WrappedModuleTensors& module);

// The data pointers of `params`: a load that gives a parameter new storage changes them.
std::vector<const void*> storage_of(const std::vector<torch::Tensor>& params);

}  // namespace detail
}  // namespace ddp
