// FullyShardedDataParallel: ZeRO stages 2 and 3 (PyTorch's torch.distributed.fsdp) for libtorch.
// Each rank keeps 1/W of the parameters, of their gradients and (with an optimizer built over
// parameters()) of the optimizer state; the full parameters of a unit exist only while it needs
// them (docs/sharding.md).
//
//   auto pg = ddp::init_process_group();
//   ddp::FullyShardedDataParallel model(net /* a torch::nn::Sequential */, pg,
//       ddp::FsdpOptions{.sharding_strategy = ddp::ShardingStrategy::kFullShard,
//                        .min_num_params = 1'000'000});
//   torch::optim::Adam opt(model->parameters(), 1e-3);   // the shards
//   for (...) { opt.zero_grad(); loss(model->forward(x)).backward(); opt.step(); }
//
// Any module, and nesting (PyTorch's FSDP1): libtorch modules have no forward hooks, so the
// wrapper is the hook: it runs the forward itself, gathering before and freeing after.
// - A torch::nn::Sequential is run child by child, its children grouped into units (below).
// - Any other module is one unit: FullyShardedDataParallel(Block(...), pg) runs Block's
//   forward(Tensor) through forward(), and any other signature through
//   forward_as<BlockImpl>(args...) (the arguments and return type of BlockImpl::forward; the
//   return value must be a Tensor, or a std::vector, std::tuple or std::pair of Tensors, so the
//   wrapper sees what backward starts from).
// - Nesting: a module may hold FSDP wrappers of its submodules (fc1 = register_module("fc1",
//   ddp::FullyShardedDataParallel(torch::nn::Linear(...), pg))). A wrapper around it shards only
//   the parameters outside those nested wrappers (each nested one shards its own), and
//   parameters() returns every shard of the tree (the nested wrappers are registered as its
//   children, named by their path with '.' as '_'), so one optimizer over the outermost
//   wrapper's parameters() trains the whole model; full_state_dict() gathers the whole tree
//   under the unwrapped model's names. fsdp_call<M>(module, args...) calls a module that may or
//   may not be wrapped (a ModuleList element); fsdp_auto_wrap wraps by parameter count.
// Units: consecutive children whose parameters are flattened into one buffer of their dtype (fp32
// or fp64, one dtype per wrapper), padded to a multiple of W; rank r owns elements [r·S, (r+1)·S)
// of it (S = padded/W) as a leaf tensor, its "shard", which is what parameters() returns. Units
// come from `units` (explicit [begin, end) child ranges) or else from `min_num_params` (PyTorch's
// size_based_auto_wrap_policy: children are added to a unit until it holds at least min_num_params
// parameters). Parameter-free children join the neighbouring unit (explicit ranges may leave them
// between units; a child with parameters outside every unit is a ConfigError).
//
// Devices: the parameters (fp32 or fp64) are on the CPU or on one CUDA device, and the flat
// buffers, shards and gradients live there (on CUDA, from the device's caching allocator, freed to
// it between uses as the CPU's mappings are unmapped; the shards and their gradients on the CPU
// with FsdpOptions::cpu_offload). Over a host group (ring, mpi) the collectives of CUDA buffers are
// staged through host copies (the tensor API); over nccl they take the device memory, and
// parameters off the group's GPU are a ConfigError.
//
// Strategies (PyTorch's ShardingStrategy):
// - kFullShard (ZeRO 3): before a unit's forward its full parameters are all-gathered (the next
//   unit's all-gather runs while this one computes), and freed after it; a gradient hook on the
//   unit's output all-gathers them again before the unit's backward (prefetching the unit before
//   it), and they are freed once the unit's gradients are handed to the reduce-scatter.
// - kShardGradOp (ZeRO 2): full parameters stay allocated from forward through backward (gathered
//   again at each forward, after the optimizer changed the shards); gradients reduce-scattered.
// - kNoShard (as DDP): every rank holds every parameter (the "shard" is the whole unit) and the
//   gradients are all-reduced.
// In every strategy, once every parameter of a unit has its gradient, the unit's flat gradient is
// reduce-scattered (all-reduced for kNoShard) asynchronously, so the earlier units' backward
// overlaps it; at the end of backward (autograd's final callback, nothing to call) every
// collective is waited for and each shard's .grad() holds the gradient averaged over the ranks
// (added to what was there, so gradients accumulate over backward passes as in PyTorch).
//
// One forward per backward: a second forward through the same units before backward would count
// gradients twice toward "every parameter of the unit has its gradient".
//
// While freed (kFullShard, outside a unit's forward/backward), the wrapped module's parameters
// have no storage: read them only through full_state_dict(). Buffers (BatchNorm statistics) are
// broadcast from rank 0 at construction and otherwise stay local.
//
// Construction is collective: every rank passes the same model (children, unit boundaries,
// parameter shapes and dtypes) and options; one small allgather checks it, and otherwise every
// rank throws Error naming the first difference. Bad arguments (a null module, bad unit ranges or
// units for a module that is not a Sequential, a parameter that is not fp32 or fp64, parameters
// of two dtypes in one wrapper, mixed precision over fp64 parameters, a parameter shared by two
// units or with a nested wrapper or already sharded by another wrapper, a wrapper of a wrapper, a
// mixed-precision dtype that is not one of those listed at FsdpMixedPrecision) throw ConfigError
// on every rank.
//
// Threads: use it from one training thread. Lifetime: keeps the group alive when given as a
// shared_ptr. Errors: ConfigError, Error as above; CommError/TimeoutError from the group, thrown
// from forward or from backward.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/join.h"
#include "ddp/torch/checkpoint/dcp_model_state.h"
#include "ddp/torch/checkpoint/distributed_checkpoint_save.h"
#include "ddp/torch/core/output_tensors.h"
#include "ddp/torch/formats/state_dict.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

enum class ShardingStrategy {
  kFullShard,    // parameters, gradients and optimizer state sharded (ZeRO stage 3)
  kShardGradOp,  // gradients and optimizer state sharded, full parameters kept (ZeRO stage 2)
  kNoShard,      // nothing sharded: all-reduce, as DistributedDataParallel
  // kFullShard inside a shard group (by default the ranks of this host), each shard replicated
  // over a replicate group (by default the ranks at the same place in the other hosts' groups):
  // gradients are reduce-scattered inside the shard group, then all-reduced over the replicas.
  kHybridShard,
};

// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD" (PyTorch's names).
const char* to_string(ShardingStrategy strategy);

// PyTorch's FSDP MixedPrecision. Each rank keeps its shards (what the optimizer steps on) and
// their gradients in fp32; the gathered parameters that forward and backward compute with are in
// param_dtype, gathered from the shard cast to it (half the bytes on the wire), and the gradients
// are reduce-scattered in reduce_dtype, then upcast into the shard's fp32 .grad(). A root wrapper
// casts a floating-point input to param_dtype, so its output is in param_dtype too.
struct FsdpMixedPrecision {
  // torch::kBFloat16 or torch::kHalf (or torch::kFloat: as unset). nullopt: fp32.
  std::optional<torch::ScalarType> param_dtype;
  // torch::kBFloat16, torch::kHalf or torch::kFloat. nullopt: param_dtype's (fp32 if unset).
  // Low-precision sums are pre-divided by a power of two (PyTorch's gradient_predivide_factor)
  // so that they do not overflow; the rest of the average is divided in fp32.
  std::optional<torch::ScalarType> reduce_dtype;
  // The dtype of the wrapped module's floating-point buffers (BatchNorm statistics) from
  // construction on; full_state_dict() returns them in their original dtype. nullopt: unchanged.
  std::optional<torch::ScalarType> buffer_dtype;
};

// PyTorch's FSDP CPUOffload. With offload_params, a wrapper whose parameters are on a CUDA device
// keeps each unit's shard (the fp32 parameters the optimizer steps on) and its gradient in host
// memory (the shard pinned): a gather copies the shard to the device first, and each unit's
// reduced gradient comes back to the host, so parameters() are CPU tensors and the optimizer
// (and its state) steps on the CPU; the device holds only the gathered units and the gradients
// being reduced. On the CPU it changes nothing (the shards are host memory already). kNoShard
// with offload_params is a ConfigError (every rank holds the whole model there: use
// DistributedDataParallel).
struct FsdpCpuOffload {
  bool offload_params = false;
};

struct FsdpOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  // Auto-wrap policy: a unit closes once it holds at least this many parameters (PyTorch's
  // size_based_auto_wrap_policy default is 1e8). Used when `units` is empty.
  std::int64_t min_num_params = 100'000'000;
  // Explicit units: [begin, end) ranges of child indices, sorted, not overlapping, not empty.
  std::vector<std::pair<std::size_t, std::size_t>> units;
  // kHybridShard's groups (PyTorch's process_group=(intra-node, inter-node)): the group a unit is
  // sharded over and the group its shards are replicated over, whose sizes multiply to the
  // group's. Give both or neither; neither: this host's ranks (new_subgroups) and the ranks at the
  // same place in the other hosts' subgroups (split_group), made collectively at construction.
  std::shared_ptr<ProcessGroup> shard_group;
  std::shared_ptr<ProcessGroup> replicate_group;
  FsdpMixedPrecision mixed_precision;
  FsdpCpuOffload cpu_offload;
  // Hand the heap's free memory back to the system (malloc_trim) at construction, at each forward
  // and at the end of each backward, so that the memory FSDP saves is not kept by malloc (ddprun
  // tells glibc to keep freed memory, for speed). Process-wide; kNoShard never does.
  bool release_free_heap = true;
  // Backward's memory against its overlap. false (default): the next unit's all-gather runs
  // while a unit computes (forward and backward), and a unit's gradients accumulate in one flat
  // buffer that is reduce-scattered while the units before it compute: beyond its shards a rank
  // holds up to two units' parameters and two units' gradients. true: nothing is prefetched or in
  // flight, and each parameter's gradient is reduced (to the ranks whose shards it spans, in place)
  // and freed as soon as autograd has produced it and every parameter after it in the unit: a rank
  // holds one unit's parameters and the gradients autograd is producing, at the cost of every
  // collective blocking the pass (PyTorch's backward_prefetch=None with limit_all_gathers, with
  // the gradients reduced per parameter). Results are the same; the sums may round differently.
  // Inside no_sync() the flat buffer is still used (it holds the accumulation).
  bool low_memory_backward = false;
};

// What clip_grad_norm_ needs to know of a tensor-parallel model inside the wrapper: the group its
// layers are split over and the parameters that are split (each tp rank holds a different part;
// ddp::tensor_parallel_split_parameters(module) lists those of ddp's tensor-parallel layers).
struct TensorParallelNorm {
  std::shared_ptr<ProcessGroup> group;
  std::vector<torch::Tensor> split_parameters;
};

// FullyShardedDataParallelImpl::no_sync()'s guard: gradients accumulate unreduced until it is
// destroyed (movable, not copyable).
class [[nodiscard]] FsdpNoSyncGuard {
 public:
  FsdpNoSyncGuard(FsdpNoSyncGuard&& other) noexcept : restore_(std::exchange(other.restore_, {})) {}
  FsdpNoSyncGuard(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(const FsdpNoSyncGuard&) = delete;
  FsdpNoSyncGuard& operator=(FsdpNoSyncGuard&&) = delete;
  ~FsdpNoSyncGuard() {
    if (restore_) restore_();
  }

 private:
  friend class FullyShardedDataParallelImpl;
  explicit FsdpNoSyncGuard(std::function<void()> restore) : restore_(std::move(restore)) {}
  std::function<void()> restore_;
};

class FullyShardedDataParallelImpl : public torch::nn::Module, public Joinable {
 public:
  FullyShardedDataParallelImpl(torch::nn::Sequential module, GroupRef group = {},
                               FsdpOptions options = {});
  // Any module as one unit (a SequentialImpl: as above). forward() runs its forward(Tensor)
  // where it has one; forward_as<ModuleType>() runs any forward.
  template <typename ModuleType>
  FullyShardedDataParallelImpl(torch::nn::ModuleHolder<ModuleType> module, GroupRef group = {},
                               FsdpOptions options = {})
      : FullyShardedDataParallelImpl(module.ptr(), tensor_forward_of(module.ptr()),
                                     std::move(group), std::move(options)) {}
  template <typename ModuleType>
  requires std::derived_from<ModuleType, torch::nn::Module> FullyShardedDataParallelImpl(
      std::shared_ptr<ModuleType> module, GroupRef group = {}, FsdpOptions options = {})
      : FullyShardedDataParallelImpl(module, tensor_forward_of(module), std::move(group),
                                     std::move(options)) {}
  // A Sequential element as it is stored (forward(Tensor) through the AnyModule).
  FullyShardedDataParallelImpl(torch::nn::AnyModule module, GroupRef group = {},
                               FsdpOptions options = {});
  // Of unknown type: forward_as<ModuleType>() only (forward() throws ConfigError).
  FullyShardedDataParallelImpl(std::shared_ptr<torch::nn::Module> module, GroupRef group = {},
                               FsdpOptions options = {});
  ~FullyShardedDataParallelImpl() override;

  // Runs the children unit by unit (gathering and freeing as the strategy says), or the wrapped
  // module's forward(Tensor). With mixed_precision.param_dtype, a floating-point input is cast
  // to it first.
  torch::Tensor forward(torch::Tensor input);

  // The wrapped module's own forward, with any arguments and result: gathers this wrapper's
  // parameters, calls ModuleType::forward(args...) (floating-point Tensor arguments cast to
  // param_dtype), arranges the gather before its backward, frees (kFullShard), and returns the
  // result. ConfigError when the wrapped module is not a ModuleType.
  template <typename ModuleType, typename... Args>
  auto forward_as(Args&&... args) {
    auto* wrapped = dynamic_cast<ModuleType*>(wrapped_.get());
    if (wrapped == nullptr) throw_not_a(typeid(ModuleType).name());
    begin_forward(/*tensor_forward=*/false);
    auto output = wrapped->forward(cast_input(std::forward<Args>(args))...);
    std::vector<torch::Tensor> outputs;
    detail::OutputTensors</*kStrict=*/true>::collect(output, outputs);
    end_forward(outputs);
    return output;
  }

  // PyTorch's FSDP.no_sync(): while the guard lives, backward passes reduce nothing; each unit's
  // full (unsharded) gradient accumulates on this rank, in this wrapper and every nested one,
  // and the first backward after it reduce-scatters the sum of all of them into the shards'
  // .grad(). Costs a full flat gradient per unit (in param_dtype) while accumulating, as
  // PyTorch's. Use the same passes on every rank.
  FsdpNoSyncGuard no_sync();

  // PyTorch's FSDP.clip_grad_norm_(max_norm, norm_type): the norm of the whole model's gradient
  // (every shard's .grad() in this wrapper and the nested ones, combined over the ranks that
  // shard them: collective), and every shard gradient scaled by max_norm / (norm + 1e-6) when
  // that is below 1. Returns the norm (before clipping), the same on every rank. norm_type: any
  // positive p or INFINITY. Use it instead of torch::nn::utils::clip_grad_norm_, which would see
  // only this rank's shards. ConfigError for a max_norm or norm_type that is not positive.
  torch::Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);
  // The same over a model whose layers are also split over a tensor-parallel group (FSDP x TP:
  // this wrapper over a DeviceMesh's dp group, the layers over its tp group): the parameters in
  // tp.split_parameters are parts of larger ones (each tp rank holds other elements: their
  // contributions are summed over tp.group too), the others are replicated over tp (counted
  // once). So every rank clips by the norm of the one-process model's gradient. Collective over
  // the shard groups and tp.group. ConfigError for a split parameter this tree does not hold.
  torch::Tensor clip_grad_norm_(double max_norm, double norm_type, const TensorParallelNorm& tp);

  // PyTorch's FSDP.summon_full_params(): gathers every unit of this wrapper and the nested ones
  // (collective), runs `body` with the wrapped module's parameters holding their full values
  // (read them, or evaluate the module directly), then frees them again (kFullShard). With
  // writeback, what `body` wrote into the parameters is kept (each rank takes its shard's part);
  // without, changes are lost at the next gather. Not inside forward/backward. ConfigError:
  // writeback with a 16-bit param_dtype (the gathered copy is rounded; change the model through
  // the shards).
  void summon_full_params(const std::function<void()>& body, bool writeback = false);

  // The module this wrapper runs (the Sequential, or any module).
  const std::shared_ptr<torch::nn::Module>& wrapped_module() const { return wrapped_; }
  // Wrappers nested inside the wrapped module, outermost ones only, with their paths in it.
  std::vector<std::pair<std::string, std::shared_ptr<FullyShardedDataParallelImpl>>>
  nested_wrappers() const {
    return nested_;
  }

  // parameters() returns the shards, one per unit (what the optimizer steps on).
  // Waits for the collectives of the current backward pass; called by autograd at its end, so
  // there is no need to call it.
  void finish_backward();

  // Gathers the full model on rank `to` (collective): the wrapped module's named parameters and
  // buffers, as plain tensors, in the format of torch::nn::Module::named_parameters() /
  // named_buffers() of the unwrapped Sequential (loadable into one). Empty on other ranks.
  torch::OrderedDict<std::string, torch::Tensor> full_state_dict(int to = 0);

  // Sharded checkpoint (fsdp_sharded_checkpoint.cc), of this wrapper and the nested ones (which
  // must have its strategy and group). Collective: each rank writes its shards'
  // elements (padding left out) and their optimizer state to DIR/shard-<rank>-of-<W>.pt
  // atomically (checksummed, as save_archive_atomically), then, once every rank has written,
  // rank 0 writes DIR/manifest.pt (world size, each unit's parameter count, the optimizer kind),
  // so a manifest means a complete checkpoint (an old manifest in DIR is removed first). A rank
  // that cannot write its file makes every rank throw Error naming it. `optimizer` is a
  // torch::optim SGD, Adam or AdamW built over parameters() (ConfigError otherwise).
  void save_sharded_checkpoint(const std::filesystem::path& dir,
                               const torch::optim::Optimizer& optimizer) const;
  // Loads a sharded checkpoint saved at any world size: each rank reads the manifest and the
  // files that hold elements of its shards, and replaces its shards' values and optimizer state
  // (the optimizer's options are left as they are). Not collective. Error naming the path and
  // what differs when the units' sizes or the optimizer kind are not the checkpoint's, or a file
  // is missing or damaged; nothing is changed then.
  void load_sharded_checkpoint(const std::filesystem::path& dir,
                               torch::optim::Optimizer& optimizer);

  // PyTorch's distributed checkpoint (DCP): this rank's part of the whole tree's model and, if
  // given, its optimizer (built over parameters(): SGD, Adam or AdamW), for save_dcp
  // (checkpoint/distributed_checkpoint_save.h), in dcp_model_state's layout
  // (checkpoint/dcp_model_state.h): "model.<name>" under the wrapped model's own names,
  // "optim.state.<name>.<key>" and "optim.param_groups.<name>.<option>" per parameter. Each rank
  // adds the elements it owns of each parameter (padding left out) as chunks of it: a flat shard
  // that starts or ends inside a row is up to 2 * dims - 1 chunks; rank 0 adds the buffers
  // (theirs are full_state_dict(0)'s: a BatchNorm's statistics may differ across ranks). So the
  // checkpoint loads here at any world size, strategy or wrapping, into a replicated model
  // (load_dcp_model_state), and into PyTorch (dcp.load of get_state_dict's dicts, with
  // StateDictOptions(flatten_optimizer_state_dict=True) for the options' layout). Not
  // collective; save_dcp is.
  // FSDP over the dp dimension of a mesh whose tp dimension splits layers: `layout` says where
  // each split parameter (by its name in the wrapped model) lies in the whole model's tensor
  // (parallel/tensor/tensor_parallel_dcp_layout.h for ddp's layers, under each nested wrapper's
  // name); its flat range is then cut in the local view and placed at the spec's offsets, so the
  // checkpoint holds whole tensors and loads at any dp x tp. Only `layout.shards` is used.
  // ConfigError for a spec that does not fit its parameter.
  DcpStateDict dcp_state(const torch::optim::Optimizer* optimizer = nullptr,
                         const DcpModelLayout& layout = {}) const;
  // Loads a checkpoint of that layout, saved from any layout (FSDP at any world size, a
  // replicated or tensor-parallel model, PyTorch): each rank reads only the rows that hold its
  // shards' elements. Not collective. Everything is read and checked before the shards, buffers
  // or optimizer change: StateDictMismatchError (strict, the default) naming the missing,
  // unexpected and mismatched (shape, dtype) entries; OptimizerMismatchError and
  // StateDictFormatError as load_dcp_model_state throws them; ConfigError for an optimizer over
  // other parameters. A kShardGradOp or kNoShard model's gathered parameters follow at the next
  // forward (kNoShard's at once). With a layout (as dcp_state's), each split parameter reads its
  // flat range of the region of the saved tensor the spec names; shapes are checked against the
  // specs' global shapes.
  StateDictLoadReport load_dcp_state(const std::filesystem::path& folder,
                                     torch::optim::Optimizer* optimizer = nullptr,
                                     StateDictLoadOptions options = {},
                                     const DcpModelLayout& layout = {});

  struct UnitInfo {
    std::size_t begin = 0, end = 0;  // children [begin, end)
    std::int64_t numel = 0;          // parameters in the unit
    std::int64_t padded_numel = 0;   // numel rounded up to a multiple of W (kNoShard: numel)
    std::int64_t shard_numel = 0;    // elements of each rank's shard
  };
  std::size_t unit_count() const { return units_.size(); }
  UnitInfo unit_info(std::size_t unit) const;
  // Bytes of full (gathered) parameter buffers allocated now, over every unit (2 bytes per
  // element with a 16-bit param_dtype).
  std::int64_t gathered_parameter_bytes() const;
  // How many all-gathers of a unit have been started since construction (for tests).
  std::int64_t all_gather_count() const { return all_gather_count_; }

  // The wrapped Sequential (empty when the wrapped module is not one).
  const torch::nn::Sequential& module() const { return module_; }
  ProcessGroup& process_group() const { return *group_; }
  const FsdpOptions& options() const { return options_; }

  void train(bool on = true) override;

  // Uneven inputs (ddp::Join, join.h): `ddp::Join join({*model});` around the training loop, and
  // the optimizer over parameters() given here first. A rank that has run out of data shadows each
  // step the others still make: a forward and backward of an empty batch (the shape of its last
  // input with 0 rows), so it makes the same all-gathers and reduce-scatters with zero gradients,
  // then `optimizer.step()` on its shards with the averaged gradients, so the shards it owns (which
  // the others gather) stay those of a rank that trains; gradients are averaged over every rank
  // (JoinOptions::divide_by_initial_world_size = true; false is a ConfigError). The joined rank
  // steps with its optimizer's current options (a per-step schedule is not advanced while it
  // shadows). Without an optimizer here, or with a model that cannot run an empty batch, the first
  // forward inside the Join throws ConfigError / the shadow step throws on the joined rank.
  void set_join_optimizer(torch::optim::Optimizer& optimizer) { join_optimizer_ = &optimizer; }
  void join_main_hook() override;
  void join_post_hook(bool is_last_joiner) override;
  ProcessGroup& join_process_group() override { return *group_; }
  std::string join_description() const override;

 private:
  struct Unit;
  FullyShardedDataParallelImpl(std::shared_ptr<torch::nn::Module> module,
                               std::function<torch::Tensor(torch::Tensor)> tensor_forward,
                               GroupRef group, FsdpOptions options);
  template <typename ModuleType>
  static std::function<torch::Tensor(torch::Tensor)> tensor_forward_of(
      const std::shared_ptr<ModuleType>& module) {
    if constexpr (requires(ModuleType & m, torch::Tensor x) {
                    { m.forward(x) } -> std::convertible_to<torch::Tensor>;
                  }) {
      // The wrapper owns the module (wrapped_), so the raw pointer outlives the function.
      return [m = module.get()](torch::Tensor x) -> torch::Tensor { return m->forward(x); };
    } else {
      return {};
    }
  }
  template <typename T>
  decltype(auto) cast_input(T&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<T>, torch::Tensor>) {
      return cast_tensor_input(arg);
    } else {
      return std::forward<T>(arg);
    }
  }
  torch::Tensor cast_tensor_input(const torch::Tensor& input) const;
  [[noreturn]] void throw_not_a(const char* type_name) const;
  // One forward of the one-unit (any module) form: gathers before, and after it hooks the
  // outputs (for the gather before backward) and frees.
  void begin_forward(bool tensor_forward);
  // A backward that failed inside autograd never reached finish_backward: its per-pass state is
  // dropped at the next forward (fsdp_forward.cc says how).
  void drop_unfinished_backward();
  void end_forward(const std::vector<torch::Tensor>& outputs);
  void find_nested_wrappers();
  // This wrapper and every nested one, outermost first.
  std::vector<FullyShardedDataParallelImpl*> tree();
  bool sync_gradients_ = true;  // false inside no_sync()
  // Whether `p` is one of the wrapped module's parameters this wrapper shards.
  bool shards_parameter(const torch::Tensor& p) const;
  // The wrapped module's parameters outside every nested wrapper.
  std::vector<torch::Tensor> own_parameters(const torch::nn::Module& module) const;
  void build();
  void start_gather(std::size_t unit);
  void wait_gather(std::size_t unit);
  void free_full(std::size_t unit);
  // The unit's flat gradient buffer (in param_dtype), with the parameters' .grad() as views of
  // it (what they held copied in), so that autograd accumulates into it in place.
  void attach_flat_gradient(Unit& u) const;
  void before_unit_backward(std::size_t unit);
  void on_grad_ready(std::size_t unit, std::size_t param);
  // low_memory_backward: whether this pass reduces the unit's gradients one parameter at a time
  // (synchronised, and no no_sync() accumulation in its flat buffer).
  bool reduces_each_gradient(const Unit& u) const;
  // Reduces the unit's parameters whose gradients are ready, last parameter first, stopping at the
  // first not ready (all of them when `finishing`: a missing gradient counts as zero); once every
  // parameter is reduced, frees the unit and hands the shard its gradient.
  void reduce_ready_parameters(std::size_t unit, bool finishing);
  void reduce_parameter_gradient(Unit& u, std::size_t unit, std::size_t param);
  // Where the reduced elements [at, at + count) of this rank's shard go, and putting `sum` there
  // (the shard's .grad() takes its average; the buffer the sum).
  static torch::Tensor reduced_slot(Unit& u, std::int64_t at, std::int64_t count);
  void hand_over_sum(Unit& u, torch::Tensor& sum, std::int64_t at);
  void reduce_gradients(std::size_t unit);
  // Waits for the unit's reduction and adds its average to the shard's .grad().
  void harvest_reduction(std::size_t unit);
  // Error when the shard's .grad() is the one a failed backward left, unchanged since (it may
  // hold part of that pass); called before a reduction adds to it.
  void check_gradient_after_failure(std::size_t unit);
  void queue_finish_backward();
  // The units of this wrapper, then of each nested one (recursively): what a sharded checkpoint
  // holds. ConfigError when a nested wrapper has another strategy or group.
  std::vector<Unit*> checkpoint_units() const;
  // Every parameter of the tree's units under its model name, with the part of it this rank
  // owns, and the buffers (fsdp_dcp_state.cc).
  struct DcpSlots;
  void collect_dcp_slots(const std::string& prefix, DcpSlots& out) const;
  // The slots of the whole tree with `layout`'s specs applied (fsdp_dcp_state.cc).
  void collect_dcp_slots(const DcpModelLayout& layout, const std::string& who, DcpSlots& out) const;
  // This rank's DIR/shard-<rank>-of-<W>.pt (fsdp_sharded_checkpoint.cc).
  void write_shard_file(const std::filesystem::path& dir,
                        const torch::optim::Optimizer& optimizer) const;
  void release_free_heap() const;

  torch::nn::Sequential module_;                                // the Sequential form, else empty
  std::shared_ptr<torch::nn::Module> wrapped_;                  // what is wrapped, in every form
  std::function<torch::Tensor(torch::Tensor)> tensor_forward_;  // the one-unit form's forward
  std::vector<std::pair<std::string, std::shared_ptr<FullyShardedDataParallelImpl>>> nested_;
  std::vector<torch::Tensor> nested_shards_;  // every parameter() of the nested wrappers
  GroupRef group_ref_;
  ProcessGroup* group_ = nullptr;
  FsdpOptions options_;
  // The group the units are sharded over: group_, or kHybridShard's shard group; and the group
  // the shards are replicated over (kHybridShard only, else null).
  ProcessGroup* shard_group_ = nullptr;
  std::shared_ptr<ProcessGroup> replicate_group_;
  void make_hybrid_groups();
  // kFullShard and kHybridShard free the full parameters outside a unit's forward and backward.
  bool frees_full_parameters() const;
  // mixed_precision: the dtype of the gathered parameters and their gradients, the dtype the
  // gradients are reduced in, and whether the shards are a separate fp32 copy of the gathered
  // parameters (they are views of them in fp32 kNoShard and kShardGradOp).
  torch::ScalarType compute_dtype() const;
  torch::ScalarType reduce_dtype() const;
  // The device every parameter of this wrapper is on (the CPU, or one CUDA device): where its
  // flat buffers, shards and gradients live. A host group (ring, mpi) stages CUDA buffers'
  // collectives through host copies (the tensor API); nccl takes them as they are.
  torch::Device device_{torch::kCPU};
  // The dtype of every parameter of this wrapper, so of its flat buffers, shards and their
  // gradients: torch::kFloat, or torch::kDouble (then without mixed precision).
  torch::ScalarType storage_dtype_ = torch::kFloat;
  // A zero-filled flat buffer of `numel` elements on device_ (mapped host memory on the CPU).
  torch::Tensor flat_zeros(std::int64_t numel, torch::ScalarType dtype) const;
  // cpu_offload.offload_params on a CUDA device_: the shards and their gradients live on the CPU.
  bool offloads_shards() const { return options_.cpu_offload.offload_params && !device_.is_cpu(); }
  // ConfigError when device_ is a CUDA device this process cannot use, or a group takes CUDA
  // memory (nccl) that device_ is not.
  void check_device() const;
  bool low_precision_parameters() const { return compute_dtype() != storage_dtype_; }
  void check_mixed_precision() const;
  // The original dtypes of the buffers buffer_dtype cast (full_state_dict returns those).
  std::vector<std::pair<torch::Tensor, torch::ScalarType>> cast_buffers_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<std::ptrdiff_t> unit_starting_at_;  // child index -> unit beginning there, or -1
  static constexpr std::size_t kReductionsInFlight = 1;
  // Gradient reductions in flight, in the order they started, shared by the outermost wrapper and
  // every wrapper nested in it: the limit holds for the whole tree, so a model of many one-unit
  // wrappers (fsdp_build_sharded, fsdp_auto_wrap) keeps one unit's full gradient in flight, not
  // every unit's until the end of backward.
  struct PendingReduction {
    FullyShardedDataParallelImpl* wrapper;
    std::size_t unit;
  };
  std::shared_ptr<std::vector<PendingReduction>> in_flight_ =
      std::make_shared<std::vector<PendingReduction>>();
  // Harvests (finish_backward) or forgets (a dropped backward) this wrapper's entries in it.
  void harvest_own_reductions();
  void forget_own_reductions();
  bool finish_queued_ = false;
  std::int64_t all_gather_count_ = 0;
  // Join: the optimizer a joined rank steps, the last input's shape and dtype (the shadow's empty
  // batch), and whether the forward running is a shadow (which must not announce a step).
  torch::optim::Optimizer* join_optimizer_ = nullptr;
  std::vector<std::int64_t> last_input_sizes_;
  torch::ScalarType last_input_dtype_ = torch::kFloat;
  torch::Device last_input_device_{torch::kCPU};
  bool shadowing_ = false;
  void check_join_setup() const;
};

TORCH_MODULE(FullyShardedDataParallel);

// Calls `module` (a ModuleList element, say) whether or not it was wrapped: through the
// wrapper's forward_as<ModuleType> if it is a FullyShardedDataParallel, else its own forward.
// ConfigError when it is neither a wrapper nor a ModuleType.
template <typename ModuleType, typename... Args>
auto fsdp_call(const std::shared_ptr<torch::nn::Module>& module, Args&&... args) {
  if (auto* wrapper = dynamic_cast<FullyShardedDataParallelImpl*>(module.get())) {
    return wrapper->forward_as<ModuleType>(std::forward<Args>(args)...);
  }
  auto* plain = dynamic_cast<ModuleType*>(module.get());
  if (plain == nullptr) {
    throw ConfigError(std::string("ddp::fsdp_call: the module is a ") + module->name() +
                      ", neither the type asked for nor a FullyShardedDataParallel wrapper");
  }
  return plain->forward(std::forward<Args>(args)...);
}

// PyTorch's size_based_auto_wrap_policy over Sequential and ModuleList trees. Bottom-up, every
// element of a ModuleList (descended into when it is a ModuleList or Sequential) and every child
// of a Sequential that holds at least options.min_num_params parameters not yet wrapped is
// replaced by a FullyShardedDataParallel of it, with `options`. libtorch's containers cannot
// replace an element in place, so new containers are returned; the elements are the same
// modules. A Sequential comes back as the root wrapper over its new copy (its small children in
// the root's units); a ModuleList as the new list (call its elements with fsdp_call, and wrap the
// module that holds it). Collective, like the constructor.
FullyShardedDataParallel fsdp_auto_wrap(torch::nn::Sequential module, GroupRef group,
                                        FsdpOptions options);
torch::nn::ModuleList fsdp_auto_wrap(torch::nn::ModuleList module, GroupRef group,
                                     FsdpOptions options);

// Deferred construction, for a model that one rank cannot hold whole: builds a Sequential of
// `children` children one at a time, make_child(0), make_child(1), ..., and wraps each child that
// holds at least options.min_num_params parameters in a FullyShardedDataParallel of its own (its
// parameters sharded, and under kFullShard freed) before the next child is built; the smaller
// children join the root wrapper's units, as fsdp_auto_wrap's. So no rank holds more than its
// shards of the children built so far plus one child in full. The model is the one fsdp_auto_wrap
// makes of the Sequential built whole by the same calls in the same order: with the same seed,
// the same initial numbers. Children are named "0", "1", ... unless `names` gives one per child.
// Collective, like the constructor; ConfigError for a null child or a wrong number of names.
FullyShardedDataParallel fsdp_build_sharded(
    std::size_t children, const std::function<torch::nn::AnyModule(std::size_t)>& make_child,
    GroupRef group, FsdpOptions options, const std::vector<std::string>& names = {});

}  // namespace ddp
#pragma GCC visibility pop
