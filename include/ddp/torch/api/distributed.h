// The tensor-level torch.distributed API: PyTorch's collectives, with PyTorch's names and
// semantics, on torch::Tensors, over any ddp::ProcessGroup.
//
//   auto pg = ddp::init_process_group();                 // also becomes the default group
//   ddp::all_reduce(grad);                               // sum over ranks, in place
//   ddp::broadcast(weights, /*src=*/0);
//   std::vector<torch::Tensor> parts(ddp::get_world_size(), torch::empty({4}));
//   ddp::all_gather(parts, torch::full({4}, ddp::get_rank()));
//   auto work = ddp::all_reduce_async(loss_sum, ddp::ReduceOp::kSum, *sub);  // async_op=True
//   work->wait();  work->result_as<std::vector<torch::Tensor>>();            // the outputs
//
// Groups. Every call takes the group last, as PyTorch's `group=`: a ProcessGroup& or a
// shared_ptr to one (GroupRef converts from both), or nothing for the default group (the one the
// last init_process_group made; ConfigError when there is none). Ranks (src, dst, peer) are ranks
// of that group.
//
// Calls are collective (point to point aside): every rank of the group makes the same calls in the
// same order, with tensors of matching dtypes and shapes. The blocking form waits; the `_async`
// form returns the Work at once (PyTorch's async_op=True): its result (Work::result_as) is the
// std::vector<torch::Tensor> of output tensors, filled once it has completed. Calls with uneven
// sizes (all_gather / reduce_scatter lists of different sizes, all_to_all lists, all_to_all_single
// with split sizes) exchange the sizes first and wait for that at the call, also in the `_async`
// form (ProcessGroup::allgather_v); the data then moves asynchronously. Until it completes, the
// Work keeps references to the tensors (a temporary input is fine); do not modify them meanwhile.
//
// Tensors are dense, contiguous CPU or CUDA tensors of float32/64, float16, bfloat16, (u)int8,
// int32 or int64; outputs are written in place (a `const torch::Tensor&` output is still written:
// a tensor is a handle). CUDA tensors on a group of host memory (ring, mpi) are staged as gloo
// does: the call runs on host copies made after the current stream's work, and its outputs are
// copied back to the device before wait() returns (nothing is copied back when it fails). On a
// CUDA group (nccl) the single-tensor calls hand the engine the tensor's device memory, ordered
// after the current stream; the list and coalesced forms, which pack on the host, are staged
// there too and their packed buffers reach NCCL through device copies (correct, not fast). Bad
// arguments throw ConfigError naming the call, the argument and the fix: wrong dtype, device
// (meta), layout, non-contiguous, a list of the wrong
// length, shapes that don't fit, split sizes that don't add up. So that no other rank waits for a
// call that this rank refused, the refusing rank first issues a barrier in its place: ranks that
// did make the call then fail at once with a CommError naming the mismatch (ring backend, which
// checks every call's fingerprint; the group is poisoned; the mpi backend needs the same check),
// and ranks that all refused the same way all throw the ConfigError with the group intact. Sizes
// that differ across ranks are a ConfigError on every rank (uneven calls exchange their sizes
// first) or the engine's mismatch CommError (equal-size calls). Thread-safety as for ProcessGroup.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// The default group for tensors on `device`: default_cuda_process_group() for a CUDA device where
// init_process_group made one (DDP_BACKEND=auto), else default_process_group() (null before
// init_process_group).
std::shared_ptr<ProcessGroup> default_process_group_for(const c10::Device& device);

// The group a call runs on: a given one, or (default-constructed) the default group, looked up
// when the call runs. Under DDP_BACKEND=auto (ddp/runtime/init.h) the calls that take one tensor
// (all_reduce, broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor,
// all_to_all_single, isend/irecv/send/recv, batch_isend_irecv) send CUDA tensors to the nccl
// group where there is one; the list forms, the coalesced forms and the object collectives run on
// the default (ring) group, which stages CUDA tensors through host copies; recv_any_source with a
// CUDA tensor is a ConfigError there (nccl has no receive from any source).
class GroupRef {
 public:
  GroupRef() = default;
  GroupRef(ProcessGroup& group) : group_(&group) {}     // NOLINT: implicit, as PyTorch's group=
  GroupRef(const std::shared_ptr<ProcessGroup>& group)  // NOLINT
      : group_(group.get()), holder_(group), holder_given_(true) {}
  // The group; ConfigError when none was given and there is no default group, or a null pointer.
  ProcessGroup& get() const;
  // As get(), but the default group is the one for `tensor`'s device
  // (default_process_group_for): under DDP_BACKEND=auto, the nccl group for a CUDA tensor.
  ProcessGroup& get_for(const torch::Tensor& tensor) const;

 private:
  ProcessGroup* group_ = nullptr;
  mutable std::shared_ptr<ProcessGroup> holder_;
  bool holder_given_ = false;  // a shared_ptr was passed (null: this rank is not a member)
};

// The reduction of a tensor call: one of ReduceOp's (it converts implicitly, as c10d::ReduceOp
// from its RedOpType), or PyTorch's PREMUL_SUM, made by make_premul_sum: every rank's input
// multiplied by that rank's factor, then summed (NCCL's ncclRedOpCreatePreMulSum, PyTorch's
// _make_nccl_premul_sum), on every backend. The inputs are left as they were (the scaled copy is
// what the engine reduces); floating-point tensors only (as NCCL): any other dtype is a
// ConfigError on every rank.
class TensorReduceOp {
 public:
  TensorReduceOp(ReduceOp op) : op_(op) {}  // NOLINT: implicit, as c10d::ReduceOp
  // What the engine runs: kSum for PREMUL_SUM.
  ReduceOp op() const { return op_; }
  bool is_premul_sum() const { return premul_factor_.has_value(); }
  // The factor of PREMUL_SUM; ConfigError for any other op.
  double premul_factor() const;

 private:
  friend TensorReduceOp make_premul_sum(double factor);
  ReduceOp op_;
  std::optional<double> premul_factor_;
};
// PREMUL_SUM with `factor` (finite; this rank's, it may differ across ranks).
TensorReduceOp make_premul_sum(double factor);
// The same with a one-element tensor's value, read now (PyTorch's tensor form).
TensorReduceOp make_premul_sum(const torch::Tensor& factor);

// ---- Group information ---------------------------------------------------------------------
int get_rank(GroupRef group = {});
int get_world_size(GroupRef group = {});
// This rank's index among the group's ranks on its host, and their number (the backend's
// ProcessGroup::local_rank/local_size; ConfigError where the backend does not know them).
int get_local_rank(GroupRef group = {});
int get_local_world_size(GroupRef group = {});
// Whether init_process_group has made a default group (PyTorch's is_initialized()).
bool is_initialized();

// ---- Collectives (PyTorch's signatures, group last) ----------------------------------------
void all_reduce(const torch::Tensor& tensor, TensorReduceOp op = ReduceOp::kSum,
                GroupRef group = {});
std::shared_ptr<Work> all_reduce_async(const torch::Tensor& tensor,
                                       TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});

void broadcast(const torch::Tensor& tensor, int src, GroupRef group = {});
std::shared_ptr<Work> broadcast_async(const torch::Tensor& tensor, int src, GroupRef group = {});

// `tensor` on `dst` becomes the reduction; on the other ranks it is left unchanged.
void reduce(const torch::Tensor& tensor, int dst, TensorReduceOp op = ReduceOp::kSum,
            GroupRef group = {});
std::shared_ptr<Work> reduce_async(const torch::Tensor& tensor, int dst,
                                   TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});

// tensor_list[r] = `tensor` of rank r. tensor_list has one tensor per rank, of `tensor`'s dtype;
// their sizes may differ (uneven all_gather), tensor_list[rank] has as many elements as `tensor`,
// and every rank passes the same sizes.
void all_gather(const std::vector<torch::Tensor>& tensor_list, const torch::Tensor& tensor,
                GroupRef group = {});
std::shared_ptr<Work> all_gather_async(const std::vector<torch::Tensor>& tensor_list,
                                       const torch::Tensor& tensor, GroupRef group = {});

// output = the concatenation of every rank's input (output has world_size x input.numel()
// elements, e.g. shape [world_size * n, ...] or [world_size, n, ...]).
void all_gather_into_tensor(const torch::Tensor& output, const torch::Tensor& input,
                            GroupRef group = {});
std::shared_ptr<Work> all_gather_into_tensor_async(const torch::Tensor& output,
                                                   const torch::Tensor& input, GroupRef group = {});

// output on rank r = reduction over ranks of input_list[r]. input_list has one tensor per rank;
// sizes may differ (the same on every rank); output has input_list[rank]'s element count.
void reduce_scatter(const torch::Tensor& output, const std::vector<torch::Tensor>& input_list,
                    TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});
std::shared_ptr<Work> reduce_scatter_async(const torch::Tensor& output,
                                           const std::vector<torch::Tensor>& input_list,
                                           TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});

// output on rank r = block r of the reduction of `input` (input has world_size x output.numel()).
void reduce_scatter_tensor(const torch::Tensor& output, const torch::Tensor& input,
                           TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});
std::shared_ptr<Work> reduce_scatter_tensor_async(const torch::Tensor& output,
                                                  const torch::Tensor& input,
                                                  TensorReduceOp op = ReduceOp::kSum,
                                                  GroupRef group = {});

// The coalesced forms (PyTorch's all_reduce_coalesced, all_gather_into_tensor_coalesced and
// reduce_scatter_tensor_coalesced): the same results as one call per tensor, in one engine call
// (one message schedule, one call record) over the tensors taken together. The tensors of a
// reduction share a dtype (a gather's pairs may differ); tensors[i] of one rank matches
// tensors[i] of the others.
void all_reduce_coalesced(const std::vector<torch::Tensor>& tensors,
                          TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});
std::shared_ptr<Work> all_reduce_coalesced_async(const std::vector<torch::Tensor>& tensors,
                                                 TensorReduceOp op = ReduceOp::kSum,
                                                 GroupRef group = {});
// outputs[i] = the concatenation of every rank's inputs[i] (world_size x inputs[i].numel()).
void all_gather_into_tensor_coalesced(const std::vector<torch::Tensor>& outputs,
                                      const std::vector<torch::Tensor>& inputs,
                                      GroupRef group = {});
std::shared_ptr<Work> all_gather_into_tensor_coalesced_async(
    const std::vector<torch::Tensor>& outputs, const std::vector<torch::Tensor>& inputs,
    GroupRef group = {});
// outputs[i] on rank r = block r of the reduction of inputs[i] (world_size x outputs[i].numel()).
void reduce_scatter_tensor_coalesced(const std::vector<torch::Tensor>& outputs,
                                     const std::vector<torch::Tensor>& inputs,
                                     TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});
std::shared_ptr<Work> reduce_scatter_tensor_coalesced_async(
    const std::vector<torch::Tensor>& outputs, const std::vector<torch::Tensor>& inputs,
    TensorReduceOp op = ReduceOp::kSum, GroupRef group = {});

// output_list[j] on rank r = input_list[r] of rank j; sizes may differ per pair (output_list[j]
// on rank r must have input_list[r]'s element count on rank j).
void all_to_all(const std::vector<torch::Tensor>& output_list,
                const std::vector<torch::Tensor>& input_list, GroupRef group = {});
std::shared_ptr<Work> all_to_all_async(const std::vector<torch::Tensor>& output_list,
                                       const std::vector<torch::Tensor>& input_list,
                                       GroupRef group = {});

// Splits `input` along dim 0 into blocks of input_split_sizes[j] rows (equal blocks when empty:
// dim 0 must then divide by world_size), sends block j to rank j, and writes what rank j sends
// into rows of `output` (output_split_sizes[j] rows from rank j; equal when empty). Rows of input
// and output have the same shape; the split sizes add up to dim 0 of their tensor.
void all_to_all_single(const torch::Tensor& output, const torch::Tensor& input,
                       std::vector<std::int64_t> output_split_sizes = {},
                       std::vector<std::int64_t> input_split_sizes = {}, GroupRef group = {});
std::shared_ptr<Work> all_to_all_single_async(const torch::Tensor& output,
                                              const torch::Tensor& input,
                                              std::vector<std::int64_t> output_split_sizes = {},
                                              std::vector<std::int64_t> input_split_sizes = {},
                                              GroupRef group = {});

// On `dst`, gather_list[r] = `tensor` of rank r (one tensor per rank, each of tensor's dtype and
// element count); elsewhere gather_list must be empty.
void gather(const torch::Tensor& tensor, const std::vector<torch::Tensor>& gather_list = {},
            int dst = 0, GroupRef group = {});
std::shared_ptr<Work> gather_async(const torch::Tensor& tensor,
                                   const std::vector<torch::Tensor>& gather_list = {}, int dst = 0,
                                   GroupRef group = {});

// `tensor` on rank r = scatter_list[r] of `src` (one per rank, each of tensor's dtype and element
// count); scatter_list must be empty elsewhere.
void scatter(const torch::Tensor& tensor, const std::vector<torch::Tensor>& scatter_list = {},
             int src = 0, GroupRef group = {});
std::shared_ptr<Work> scatter_async(const torch::Tensor& tensor,
                                    const std::vector<torch::Tensor>& scatter_list = {},
                                    int src = 0, GroupRef group = {});

void barrier(GroupRef group = {});
std::shared_ptr<Work> barrier_async(GroupRef group = {});

struct MonitoredBarrierOptions {
  // How long rank 0 waits for the others (and they for rank 0's release); 0 = 30 s.
  std::chrono::milliseconds timeout{0};
  // PyTorch's wait_all_ranks. true: rank 0 waits the whole timeout and names every rank that has
  // not arrived by then; false: it names the first missing rank (in rank order) as soon as the
  // deadline passes.
  bool wait_all_ranks = false;
};
// A barrier that names the missing ranks: every rank reports to rank 0 (point to point) and
// waits for its release. Rank 0 throws TimeoutError naming the ranks that did not arrive within
// the timeout; the others throw TimeoutError when rank 0 has not released them within twice the
// timeout. For debugging hangs, as PyTorch's; after a failure the group should be abandoned
// (a pending receive poisons it at its deadline). Do not have point-to-point operations pending
// between the same ranks when calling it (they match in issue order).
void monitored_barrier(MonitoredBarrierOptions options = {}, GroupRef group = {});

// ---- Point to point -----------------------------------------------------------------------
// Matches the peer's recv/send with the same tag, in issue order (ProcessGroup::send/recv).
void send(const torch::Tensor& tensor, int dst, int tag = 0, GroupRef group = {});
// Returns the sender's rank (`src`).
int recv(const torch::Tensor& tensor, int src, int tag = 0, GroupRef group = {});
// Receives the first message with `tag` from any rank (PyTorch's recv with src=None) and returns
// its sender (ProcessGroup::recv_any_source: the ring and mpi backends).
int recv_any_source(const torch::Tensor& tensor, int tag = 0, GroupRef group = {});
std::shared_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag = 0, GroupRef group = {});
std::shared_ptr<Work> irecv(const torch::Tensor& tensor, int src, int tag = 0, GroupRef group = {});

// One operation of batch_isend_irecv (PyTorch's P2POp).
struct P2POp {
  enum class Kind { kIsend, kIrecv };
  Kind op = Kind::kIsend;
  torch::Tensor tensor;
  int peer = 0;
  GroupRef group;  // default: the default group
  int tag = 0;
};
// Starts every operation (in list order) and returns their Works. ConfigError before starting
// any when an operation is invalid or the operations name different groups.
std::vector<std::shared_ptr<Work>> batch_isend_irecv(const std::vector<P2POp>& ops);

// ---- Groups -------------------------------------------------------------------------------
// A subgroup of `group` made of `ranks` (ranks of `group`, any order, no duplicates; sorted
// here). Collective over `group`: every member calls it with the same ranks. Returns nullptr on
// ranks that are not in it (PyTorch returns GroupMember.NON_GROUP_MEMBER); a call on a null group
// is a ConfigError that says so.
std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, GroupRef group = {});

// Splits `group` into subgroups of consecutive ranks. group_size 0 = one subgroup per host (the
// backend's local_size(); every host must hold the same number of consecutive ranks, as
// ddprun/torchrun/mpirun --map-by core start them). Returns this rank's subgroup and every
// subgroup's rank list (PyTorch returns the subgroup objects; only members can hold a ddp group).
// ConfigError when group_size does not divide the group's size, or is not positive when given.
struct Subgroups {
  std::shared_ptr<ProcessGroup> mine;
  std::vector<std::vector<int>> ranks;
};
Subgroups new_subgroups(int group_size = 0, GroupRef group = {});

// Splits `group` into the disjoint subgroups `split_ranks` lists (PyTorch's split_group): each
// list holds ranks of `group` (any order; sorted here), no rank in two lists, and ranks in no
// list are in no subgroup. Collective over `group`: every rank passes the same lists, which is
// checked first (one small allgather), so that a rank with other lists, or lists that overlap or
// name a rank outside the group, is a ConfigError on every rank, before any subgroup is made.
// Returns this rank's subgroup, nullptr on a rank in no list. (PyTorch names ranks by their
// global rank; for the default group the two are the same.)
std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& split_ranks,
                                          GroupRef group = {});

// The world rank (ProcessGroup::world_ranks: the rank in the group at the top of the new_group
// chain) of each rank of `group`, in group order (PyTorch's get_process_group_ranks).
std::vector<int> get_process_group_ranks(GroupRef group = {});
// The world rank of `group_rank` of `group` (PyTorch's get_global_rank); ConfigError when it is
// not a rank of the group.
int get_global_rank(GroupRef group, int group_rank);
// The rank in `group` of world rank `global_rank` (PyTorch's get_group_rank); ConfigError naming
// the group's ranks when it is not in the group.
int get_group_rank(GroupRef group, int global_rank);

// ---- Convenience --------------------------------------------------------------------------
// Whether this is rank 0 of the group (true when there is no default group: a single process).
bool is_main_process(GroupRef group = {});

// Mean of `value` over the group's ranks (one float64 allreduce): e.g. a loss or an accuracy.
double average_across_ranks(double value, GroupRef group = {});
// `value` reduced over the group's ranks with `op`, in float64.
double all_reduce_scalar(double value, ReduceOp op, GroupRef group = {});

// On rank 0 of the default group (or in a process without one), writes `line` and a newline to
// stdout and flushes, so that the line shows at once even through a pipe (ddprun). Elsewhere
// does nothing. Not collective.
void print_main_line(const std::string& line);
// As Python's print on the main process only: the arguments (anything with operator<<),
// separated by spaces.   ddp::print_main("epoch", epoch, "loss", loss);
template <class... Args>
void print_main(const Args&... args) {
  if (!is_main_process()) return;
  std::ostringstream line;
  const char* separator = "";
  ((line << separator << args, separator = " "), ...);
  print_main_line(line.str());
}

}  // namespace ddp
#pragma GCC visibility pop
