// ZeroRedundancyOptimizer: ZeRO stage 1 (PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer)
// for libtorch. Wraps any torch::optim optimizer so that each rank keeps the optimizer state of
// its shard of the parameters only: with Adam in fp32 that is 8 bytes per parameter divided by
// the world size instead of 8 on every rank (docs/sharding.md).
//
//   auto pg = ddp::init_process_group();
//   auto model = ddp::DistributedDataParallel(std::make_shared<Net>(), pg);
//   ddp::ZeroRedundancyOptimizer opt(model->parameters(), torch::optim::AdamOptions(1e-3), pg);
//   for (...) { opt.zero_grad(); loss(model->forward(x)).backward(); opt.step(); }
//
// Partition (as PyTorch): per parameter group, the parameters sorted by size (largest first,
// ties in registration order), each given to the rank with the fewest elements so far (counted
// over all groups). Each rank builds, with the factory, a local optimizer over its shard (the
// same groups, with the same options, holding only its parameters), so only it holds state.
// step() steps the local optimizer (running the closure, if any, once on every rank: with DDP the
// closure's backward averages the gradients) and then every owner broadcasts its updated
// parameters, packed into buckets of at most `bucket_cap_mb` (a larger parameter goes alone), the
// next bucket packed while the previous one is on the wire. After step() every rank holds the
// same parameters. With DDP, DDP averages the gradients and this optimizer steps: the parameters
// equal those of DDP with the full optimizer (bit for bit, for element-wise optimizers).
//
// param_groups() holds every parameter; change their options (lr, ...) there: step() copies them
// to the local optimizer. zero_grad() clears every parameter's gradient.
//
// Devices: the parameters are on one device, the CPU or a CUDA device (the buckets' buffers live
// there). On a host group (ring, mpi) the broadcasts of CUDA parameters stage them through host
// memory (distributed.h); a CUDA group (nccl) broadcasts device memory. Parameters on two
// devices, or CPU ones on a CUDA group: ConfigError.
//
// Checkpoints: consolidate_state_dict(to) (collective) gathers every rank's state on rank `to`;
// there, save() writes the archive a plain optimizer of the same kind over every parameter would
// write (it loads into one with load(), and ddp::save_checkpoint takes this optimizer). load()
// reads such an archive (from this optimizer or a plain one, at any world size) on every rank;
// each rank keeps its shard's part. The archive must fit: the same number of groups and
// parameters, state tensors of each parameter's shape (checked for SGD, Adam, AdamW, Adagrad and
// RMSprop states), the same optimizer kind when the archive says which; otherwise Error naming
// what differs, and nothing is changed.
//
// Construction is collective: every rank passes the same parameters (count, shapes, dtypes, in
// the same groups) and a factory of the same optimizer kind; one small allgather checks it, and
// otherwise every rank throws Error naming the first difference and the ranks. So does a factory
// or bad argument that fails on some rank only. LBFGS is refused (its step is a global line
// search, not element-wise).
//
// Uneven inputs: a Joinable of ddp::Join (as PyTorch's), listed after the DistributedDataParallel:
//   ddp::Join join({*model, opt}); ... join.finish();
// While a rank that ran out of data shadows the others' steps, DDP hands it each step's averaged
// gradients and this optimizer steps its shard with them and broadcasts it, so the shards it owns
// keep training; the parameters then equal those of DDP + the full optimizer under the same Join.
//
// Threads: use it from one training thread. Lifetime: keeps the group alive when given as a
// shared_ptr; the parameters must outlive it. Errors: ConfigError for bad arguments, Error for
// ranks or checkpoints that differ, CommError/TimeoutError from the group (a rank whose local
// step throws leaves the others to fail at the broadcast's deadline).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/formats/optimizer_wrapper.h"
#include "ddp/torch/formats/state_dict.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// Builds the local optimizer over the given groups (each without options takes the factory's
// defaults). Must not return null.
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::optim::OptimizerParamGroup>)>;

// A factory for OptimizerT (e.g. torch::optim::Adam) with `defaults` (e.g. AdamOptions(1e-3)).
template <class OptimizerT, class OptionsT>
OptimizerFactory optimizer_factory(OptionsT defaults) {
  return [defaults](std::vector<torch::optim::OptimizerParamGroup> groups) {
    return std::make_unique<OptimizerT>(std::move(groups), defaults);
  };
}

struct ZeroOptions {
  // As PyTorch's parameters_as_bucket_view: each rank's parameters of one dtype live in one flat
  // buffer (their data become views into it), so the broadcasts after step() copy nothing.
  bool parameters_as_bucket_view = false;
  // Largest broadcast after step(), in MiB.
  double bucket_cap_mb = 16.0;
  // PyTorch's overlap_with_ddp: the step runs inside DistributedDataParallel's comm hook, bucket
  // by bucket, as each bucket's average arrives; register hook_with_zero_step(hook, *this) on the
  // DDP model. See hook_with_zero_step for what step() does then.
  bool overlap_with_ddp = false;
};

class ZeroRedundancyOptimizer;

// PyTorch's hook_with_zero_step: a comm hook for the DistributedDataParallel whose parameters
// `zero` (constructed with ZeroOptions::overlap_with_ddp = true) optimizes. Each bucket is reduced
// by `hook` (e.g. allreduce_hook(), fp16_compress_hook(), powersgd_hook(...)); once its average is
// there, each rank steps the parameters of the bucket it owns with it and starts the broadcast of
// each owner's updated parameters, so the step of bucket k overlaps the reductions of the
// buckets after it, and the broadcasts overlap the later steps. zero.step() then only waits for
// the broadcasts (and returns an undefined tensor): every rank holds the updated parameters
// after it, equal to DDP + a plain ZeroRedundancyOptimizer.
//   model->register_comm_hook(ddp::hook_with_zero_step(ddp::allreduce_hook(), opt), "zero");
// The step uses the bucket's averaged gradients (a parameter no rank used in this pass, with
// find_unused_parameters, is stepped with zeros, as in PyTorch). ConfigError: `zero` without
// overlap_with_ddp, an empty hook, a DDP group that is not the optimizer's; Error when a bucket
// holds a parameter the optimizer does not have.
CommHook hook_with_zero_step(CommHook hook, ZeroRedundancyOptimizer& zero);

class ZeroRedundancyOptimizer : public torch::optim::Optimizer,
                                public Joinable,
                                public OptimizerWrapper {
 public:
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                          OptimizerFactory factory, GroupRef group = {}, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, OptimizerFactory factory,
                          GroupRef group = {}, ZeroOptions options = {});
  // Convenience: the local optimizers are SGD, or Adam or AdamW with libtorch's state and a step
  // without parameter-sized temporaries (ChunkedAdam, ChunkedAdamW: chunked_adam.h), with these
  // defaults. For libtorch's own Adam: optimizer_factory<torch::optim::Adam>(defaults).
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults,
                          GroupRef group = {}, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults,
                          GroupRef group = {}, ZeroOptions options = {});
  ZeroRedundancyOptimizer(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults,
                          GroupRef group = {}, ZeroOptions options = {});
  ~ZeroRedundancyOptimizer() override;

  // Steps this rank's shard, then broadcasts every shard from its owner (collective). Returns the
  // closure's loss (undefined without a closure). With overlap_with_ddp the backward's comm hook
  // stepped already: this waits for its broadcasts; ConfigError with a closure, under ddp::Join,
  // or when no backward ran hook_with_zero_step since the last step().
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Gathers every rank's optimizer state on rank `to` (collective; the others send theirs and
  // keep nothing). A snapshot: later steps do not change it. REQUIRES: 0 <= to < world size.
  void consolidate_state_dict(int to = 0);
  // On the rank that consolidated last: a plain optimizer of the local kind over every parameter,
  // holding the consolidated state. Error elsewhere or before consolidate_state_dict.
  const torch::optim::Optimizer& state_dict() const;
  // Writes state_dict() (the plain optimizer's archive, plus the optimizer kind). Error when this
  // rank holds no consolidated state.
  void save(torch::serialize::OutputArchive& archive) const override;
  // Loads a full optimizer archive (see above); not collective, call it on every rank.
  void load(torch::serialize::InputArchive& archive) override;

  // PyTorch's distributed checkpoint (DCP) of `model` (the module DDP wraps, holding every
  // parameter of this optimizer) and this optimizer, in dcp_model_state's layout
  // (checkpoint/dcp_model_state.h): every rank adds the model (replicated: written once) and the
  // state of the parameters it owns, so no rank gathers another's state and each writes its own.
  // Not collective; save_dcp is. The checkpoint loads as any dcp_model_state checkpoint does
  // (a plain optimizer, PyTorch's get_state_dict, ZeRO at another world size).
  DcpStateDict dcp_state(const torch::nn::Module& model) const;
  // Loads `model` and this optimizer from such a checkpoint, or from any checkpoint of that
  // layout (a plain optimizer's, PyTorch's, ZeRO's at any world size): the model, the groups'
  // options, and the state of the parameters this rank owns (the only state it reads). Not
  // collective. Errors as load_dcp_model_state's; nothing changes on error.
  StateDictLoadReport load_dcp_state(const std::filesystem::path& folder, torch::nn::Module& model,
                                     StateDictLoadOptions options = {});

  ProcessGroup& process_group() const { return *group_; }
  const ZeroOptions& options() const { return options_; }
  // The local optimizer over this rank's shard.
  const torch::optim::Optimizer& local_optimizer() const { return *local_; }
  // OptimizerWrapper: checkpoints describe and check the local optimizer's kind.
  const torch::optim::Optimizer& wrapped_optimizer() const override { return *local_; }
  // The optimizer's kind, e.g. "torch::optim::Adam".
  const std::string& kind() const { return kind_; }
  // The rank that owns parameter `index` (counted over param_groups() in order).
  int owner_of(std::size_t index) const { return owner_.at(index); }
  // The parameters `rank` owns, in its local optimizer's order.
  std::vector<torch::Tensor> shard_parameters(int rank) const;
  // Bytes of the tensors in this rank's optimizer state (SGD, Adam, AdamW, Adagrad, RMSprop;
  // Error for other kinds, whose state ddp cannot look into).
  std::int64_t local_state_bytes() const;
  // How many broadcasts each step() makes (one per bucket).
  std::size_t bucket_count() const;

  // Joinable (ddp/torch/api/join.h): a joined rank steps its shard with the gradients DDP's shadow
  // step handed it, and takes part in the broadcasts.
  void join_main_hook() override;
  void join_post_hook(bool is_last_joiner) override;
  ProcessGroup& join_process_group() override { return *group_; }
  std::string join_description() const override;
  bool join_needs_gradients() const override { return true; }

 private:
  friend CommHook hook_with_zero_step(CommHook hook, ZeroRedundancyOptimizer& zero);
  struct Bucket;
  // overlap_with_ddp (zero_overlap_hook.cc): steps the bucket's parameters this rank owns with
  // their averaged gradients and starts each owner's broadcast of its updated parameters.
  void step_bucket(const std::vector<torch::Tensor>& params,
                   const std::vector<torch::Tensor>& gradients);
  // Copies what the overlapped broadcasts brought into the parameters: of every one (waiting for
  // each), or (all = false) of those completed in order so far.
  void finish_overlap_broadcasts(bool all);
  struct OverlapBroadcast {
    std::shared_ptr<Work> work;
    torch::Tensor buffer;
    std::vector<torch::Tensor> params;  // another owner's: unpacked from buffer when done
  };
  std::vector<OverlapBroadcast> overlap_pending_;
  bool overlap_stepped_ = false;  // a bucket was stepped since the last step()
  void build(std::vector<torch::optim::OptimizerParamGroup> param_groups);
  void check_across_ranks(const std::string& description, const std::string& local_error);
  void build_buckets();
  void broadcast_shards();
  torch::Tensor step_shard(LossClosure closure);  // step() without the Join notification
  // A fresh optimizer of the local kind over `rank`'s shard (every rank when rank < 0), with the
  // current group options.
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(int rank) const;
  // Takes `full`'s group options and (moved out of it) the state of the parameters this rank
  // owns: the end of a load, once `full` (make_optimizer(-1)) holds the checked state.
  void adopt_full_state(torch::optim::Optimizer& full);

  GroupRef group_ref_;
  ProcessGroup* group_ = nullptr;
  OptimizerFactory factory_;
  ZeroOptions options_;
  std::string kind_;
  std::vector<torch::Tensor> params_;                  // every parameter, group by group
  std::vector<std::size_t> group_of_;                  // params_ index -> group
  std::vector<int> owner_;                             // params_ index -> owning rank
  std::vector<std::vector<std::size_t>> shard_order_;  // rank -> its params_ indices, local order
  std::unique_ptr<torch::optim::Optimizer> local_;
  std::unique_ptr<torch::optim::Optimizer> consolidated_;
  std::vector<Bucket> buckets_;
  std::vector<torch::Tensor> flat_;     // parameters_as_bucket_view: the flat buffers
  std::vector<torch::Tensor> staging_;  // two per dtype, for buckets of several parameters
  torch::Device device_{torch::kCPU};   // every parameter's; the buffers above live there
};

}  // namespace ddp
#pragma GCC visibility pop
