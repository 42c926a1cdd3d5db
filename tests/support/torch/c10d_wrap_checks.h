// Checks of a ddp::ProcessGroup that wraps a c10d group (ddp::wrap_c10d), shared by
// c10d_process_group_test.cc (c10d's gloo built in C++, where gloo's headers exist) and the Python
// extension tests/python/c10d_wrap_check_ext.cc (c10d's gloo built by PyTorch's Python, whose
// wheel ships no gloo headers). Each throws std::runtime_error naming what differed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::test {

// Throws naming `what`, both values, unless got equals want (compared in double).
void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what);

// Every ProcessGroup operation (allreduce of every dtype and op, the block and uneven
// collectives, send/recv with tags) against values worked out here; at any world size.
void check_every_operation(ProcessGroup& pg);

// What is trained: plain DDP with SGD, DDP with ZeRO (Adam), a model with SyncBatchNorm, or DDP
// under Join with rank r training 4 + r steps.
enum class C10dTraining { kDdp, kZero, kSyncBatchNorm, kJoin };

// The model every training starts from (fixed values, no seed).
torch::nn::Sequential make_c10d_check_model(bool batch_norm);

// Trains on this rank of `pg` (world 2) and returns the model's parameters then buffers, after
// checking every rank holds the same parameters.
std::vector<at::Tensor> train_c10d_check_model(const std::shared_ptr<ProcessGroup>& pg,
                                               C10dTraining training);

}  // namespace ddp::test
