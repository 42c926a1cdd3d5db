// Tensors as the raw buffers ddp's ProcessGroup takes: which DType and ReduceOp a c10d call maps
// to, and the checks that refuse what the engine cannot take, each a RuntimeError (c10::Error)
// naming the call, the tensor and the fix, thrown before anything is sent.
//
// Data movement (broadcast, gathers, scatter, all-to-all, send/recv) takes any dense CPU dtype:
// the eight ddp reduces natively move as themselves, the others (bool, int16, complex, ...) as
// bytes. Reductions take ddp's eight dtypes, bool (SUM and BOR as MAX, PRODUCT and BAND as MIN)
// and complex (SUM and AVG over the real view, as c10d allows); PREMUL_SUM as SUM over a scaled
// copy (premultiplied). Non-contiguous tensors work
// through a contiguous copy written back on success (tensor_buffers.cc says why).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include "ddp/comm/types.h"

namespace torch_ddp {

// A dtype as Python spells it ("torch.int16"), for messages.
std::string dtype_name(at::ScalarType type);

// A tensor's elements as (pointer, count, dtype) for the engine.
struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;
  ddp::DType dtype = ddp::DType::kUInt8;
};

// The engine's view of `contiguous` (a contiguous CPU tensor) for moving data: its own DType when
// ddp has one, else its bytes.
Buffer movement_buffer(const at::Tensor& contiguous);

// For reductions: the DType to reduce `contiguous` in and the op, or a RuntimeError naming
// `call`, the dtype or op and what ddp reduces.
struct Reduction {
  Buffer buffer;
  ddp::ReduceOp op = ddp::ReduceOp::kSum;
};
Reduction reduction_buffer(const at::Tensor& contiguous, const c10d::ReduceOp& op,
                           const std::string& call);

// PREMUL_SUM (torch.distributed._make_nccl_premul_sum(factor)): a new contiguous tensor holding
// `input` times the op's factor (a float or a one-element tensor, in input's dtype, as NCCL
// multiplies), which the engine then sums; reduction_buffer maps PREMUL_SUM to SUM. Any other op:
// `input` itself. Floating-point tensors only (as NCCL), else a RuntimeError naming `call`.
at::Tensor premultiplied(const at::Tensor& input, const c10d::ReduceOp& op,
                         const std::string& call);

// Refuses a tensor ddp cannot take: not on the CPU, sparse or another layout. `what` names it in
// the message ("allreduce's tensor", "all_gather's output 2").
void check_cpu_dense(const at::Tensor& tensor, const std::string& what);

// Both tensors pass check_cpu_dense and `output` has `input`'s dtype, else a RuntimeError naming
// `call` ("all_to_all_single") and both dtypes.
void check_output_matches_input(const at::Tensor& output, const at::Tensor& input,
                                const std::string& call);

// The number of tensors a call takes (c10d passes lists; ddp, like gloo for CPU tensors, takes
// one per rank).
void check_count(const std::vector<at::Tensor>& tensors, std::size_t expected,
                 const std::string& what);

// Every tensor of `tensors` has `like`'s dtype and number of elements.
void check_same_type_and_size(const std::vector<at::Tensor>& tensors, const at::Tensor& like,
                              const std::string& what);

// A contiguous tensor for `tensor` (itself when it is contiguous) and whether it is a copy that
// must be written back.
struct Contiguous {
  at::Tensor tensor;
  bool is_copy = false;
};
Contiguous contiguous_of(const at::Tensor& tensor);

}  // namespace torch_ddp
