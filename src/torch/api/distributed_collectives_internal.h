// Private to the tensor collectives of the tensor-level API (distributed_collectives.cc,
// distributed_gather_scatter.cc, distributed_coalesced.cc, distributed_all_to_all.cc): the
// helpers they share, defined in distributed_collectives.cc where not inline.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/comm/work.h"
#include "ddp/torch/api/distributed.h"
#include "torch/core/distributed_checks.h"

namespace ddp::detail {

using Tensors = std::vector<torch::Tensor>;
using ByteBuffer = std::vector<std::byte>;

inline Tensors joined(Tensors a, const Tensors& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline constexpr CallOptions kBlocking{.blocking = true};

inline std::size_t bytes_of(const torch::Tensor& t) {
  return element_count(t) * t.element_size();
}

// Marks `work`'s result as `outputs` (the Work then keeps them alive until it is destroyed), and
// keeps `inputs` alive until the operation has completed: the caller may drop its handles (e.g. a
// temporary) before the engine has read them.
std::shared_ptr<Work> with_result(std::shared_ptr<Work> work, Tensors outputs, Tensors inputs = {});

// The tensors of `list` one after the other in one buffer.
std::shared_ptr<ByteBuffer> pack(const Tensors& list);

// Copies `flat` into the tensors of `list` once `work` has succeeded (plain memcpy: callbacks run
// on the group's thread, where no autograd state is wanted).
void unpack_on_success(Work& work, std::shared_ptr<ByteBuffer> flat, Tensors list);

std::vector<std::size_t> counts_of(const Tensors& list);

inline bool all_same(const std::vector<std::size_t>& counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

void check_list(const Tensors& list, std::size_t want, const std::string& name,
                const torch::Tensor& reference, const std::string& reference_name,
                const std::string& why);

inline std::size_t world(ProcessGroup& g) {
  return static_cast<std::size_t>(g.size());
}

// PREMUL_SUM's own check, inside check_collective's: floating-point tensors only (as NCCL).
void check_reduce_op(const TensorReduceOp& op, const torch::Tensor& tensor,
                     const std::string& what);

// What the engine reduces: `t` itself, or for PREMUL_SUM a copy of it times the factor (in t's
// dtype, as NCCL multiplies), so that `t` keeps its value whatever the call does.
torch::Tensor premultiplied(const torch::Tensor& t, const TensorReduceOp& op);
Tensors premultiplied(const Tensors& list, const TensorReduceOp& op);

// Copies `from[i]` into `to[i]` (same sizes) once `work` has succeeded: at once for a blocking
// call, which has completed (and thrown its error) when it returns.
void copy_back_on_success(Work& work, const CallOptions& options, Tensors from, Tensors to);

}  // namespace ddp::detail
