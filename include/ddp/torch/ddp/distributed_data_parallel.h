// DistributedDataParallel: data-parallel training of a libtorch module across processes.
//
//   auto pg = ddp::init_process_group();
//   auto model = ddp::DistributedDataParallel(std::make_shared<Net>(), pg);
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (...) { opt.zero_grad(); model->forward(x).cross_entropy... .backward(); opt.step(); }
//
// Construction checks that every rank wraps the same parameters (names, shapes, dtypes; the error
// names the first parameter that differs and the ranks), then copies rank 0's parameters and
// buffers to every rank. Each training-mode forward first broadcasts rank 0's buffers
// (broadcast_buffers) and, once, rebuilds the gradient buckets; backward() then returns with every
// gradient averaged over the ranks, the communication having overlapped backward (see reducer.h).
//
// Evaluation (a forward in eval mode) communicates nothing, so rank 0 may evaluate alone. Unlike
// PyTorch, which re-broadcasts rank 0's buffers in the first forward after training whatever the
// mode, each rank then uses its own buffers (BatchNorm statistics of its own last batches); call
// sync_buffers() on every rank first to evaluate everywhere with rank 0's.
//
// Staying in sync: every forward checks (locally, a few microseconds) that the wrapped module
// still has the parameters it was wrapped with. A load after wrapping (torch::load,
// Module::load) or a replaced parameter tensor of the same shape re-attaches the gradient hooks;
// a changed parameter set, shape, dtype or device is an Error naming the parameter. The divergence
// guard, on by default, catches values that differ across the ranks: each training forward (with
// gradients enabled) agrees in one 4-byte allgather, after the module's forward and before
// backward, whether any rank loaded or replaced parameters since the last one (torch::load,
// Module::load, ddp::load_checkpoint, a replaced tensor) and, if so, compares a checksum of every
// parameter across the ranks before that step's backward;
// and every divergence_check_every such forwards (default kDefaultDivergenceCheckEvery) it
// compares them anyway, which catches what no rank can see (a copy_ into a parameter on one
// rank, an optimizer step skipped). A difference is an Error naming the first parameter that
// differs, the ranks, and the ranks that loaded. DdpOptions::divergence_check_every = 0 (or
// DDP_DIVERGENCE_CHECK_EVERY=0) turns the guard off entirely.
//
// Uneven inputs: DistributedDataParallel is a Joinable; see ddp/torch/api/join.h.
//
// Gradient accumulation: `{ auto guard = model->no_sync(); loss.backward(); }` for the micro-steps,
// then a normal backward for the last one. Options follow PyTorch's names and defaults.
//
// Threads: use one DistributedDataParallel from one training thread. Lifetime: it keeps the
// module and the group alive; destroying it while reductions are in flight waits for them.
// Throws ConfigError for a missing group or bad options, Error for models that differ across
// ranks or parameters without gradients (see reducer.h), CommError from the group.
#pragma once

#include <chrono>
#include <cstddef>
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
#include "ddp/torch/api/join.h"
#include "ddp/torch/core/output_tensors.h"
#include "ddp/torch/ddp/ddp_logging_data.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/ddp/reducer.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// The divergence guard's default interval in training forwards: a checksum of every parameter
// costs about one pass over the model's memory, which this interval keeps far below 1 % of a
// step (docs/benchmarks.md, "Divergence guard").
inline constexpr std::int64_t kDefaultDivergenceCheckEvery = 100;

struct DdpOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // The divergence guard (see above): every N training forwards, and at the first one after a
  // rank loaded or replaced parameters, compare a checksum of each parameter across the ranks
  // (one allgather of 8 bytes per parameter) and throw Error naming the first that differs.
  // 0 = off (also the per-forward load flag). Unset: DDP_DIVERGENCE_CHECK_EVERY=N if the
  // environment sets it, else kDefaultDivergenceCheckEvery.
  std::optional<std::int64_t> divergence_check_every;
  // Mixed precision for the gradient reduction (PyTorch's mixed_precision.reduce_dtype):
  // torch::kBFloat16 or torch::kHalf reduces every bucket in that dtype (half the bytes on the
  // wire) while parameters and .grad stay fp32; the same as registering bf16_compress_hook() or
  // fp16_compress_hook(), which a later register_comm_hook replaces. nullopt: the gradients' dtype.
  std::optional<torch::ScalarType> reduce_dtype;
  // Mixed precision for compute (PyTorch's mixed_precision.param_dtype, _MixedPrecision):
  // torch::kBFloat16 or torch::kHalf runs forward and backward with every floating-point parameter
  // in that dtype, from full-precision master weights. Each forward casts the parameters (and the
  // floating-point tensors passed to forward) to it; backward's gradients are upcast into the
  // buckets and averaged in the parameters' own dtype (or in reduce_dtype); when backward ends
  // (also under no_sync), or at once after a forward with gradients disabled, the parameters are
  // their full-precision selves again, with full-precision gradients, for the optimizer and
  // checkpoints. Buffers keep their dtype unless buffer_dtype says otherwise. nullopt: off.
  std::optional<torch::ScalarType> param_dtype;
  // PyTorch's mixed_precision.buffer_dtype: the module's floating-point buffers (BatchNorm
  // statistics) are cast to it for good at construction, after rank 0's are broadcast, and stay in
  // it (also in the module's state dict), as PyTorch's DDP casts them. A floating-point dtype;
  // nullopt: unchanged. (libtorch 1.13's CPU BatchNorm needs its buffers in the parameters'
  // dtype, so a BatchNorm model under param_dtype needs buffer_dtype = param_dtype there.)
  std::optional<torch::ScalarType> buffer_dtype;
  // Parameters and buffers DDP leaves alone, by their dotted names in the wrapped module
  // (PyTorch's _set_params_and_buffers_to_ignore_for_model): not broadcast at construction, not
  // reduced (their gradients stay this rank's own), not in the divergence guard. A name that is
  // neither a parameter nor a buffer of the module is a ConfigError.
  std::vector<std::string> parameters_to_ignore;
  // For tests only (ReducerOptions::staging_for_tests): CPU buckets take the staged path of CUDA
  // buckets on a host group.
  ReducerOptions::StagingForTests staging_for_tests;
};

// Restores the previous synchronisation mode when it goes out of scope.
class [[nodiscard]] NoSyncGuard {
 public:
  explicit NoSyncGuard(Reducer& reducer);
  NoSyncGuard(NoSyncGuard&& other) noexcept;
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  Reducer* reducer_;
  bool previous_;
};

// Where DistributedDataParallelBase reads the tensors of the module it wraps: every parameter with
// its dotted name, recursively, in registration order (a tensor shared by two submodules appears
// under both names), and every buffer with its name. Read again whenever they are needed (every
// forward), since a load or a replaced attribute may swap them. The tensors are the module's own,
// never copies: DDP hooks their gradient accumulators and writes rank 0's values into them. Filled
// for a torch::nn::Module by DistributedDataParallelImpl, for a torch::jit::Module by
// ScriptDistributedDataParallelImpl (ddp/torch/ddp/script_distributed_data_parallel.h).
struct WrappedModuleTensors {
  std::function<torch::OrderedDict<std::string, torch::Tensor>()> named_parameters;
  std::function<torch::OrderedDict<std::string, torch::Tensor>()> named_buffers;
};

// The part of DistributedDataParallel that does not depend on the module's type.
class DistributedDataParallelBase : public torch::nn::Module, public Joinable {
 public:
  ProcessGroup& process_group() const { return *group_; }
  Reducer& reducer() const { return *reducer_; }
  const DdpOptions& options() const { return options_; }

  // Gradients of backward passes inside the guard's scope are not synchronised.
  NoSyncGuard no_sync() { return NoSyncGuard(*reducer_); }
  // `name` labels the hook in logging_data() and in traces.
  void register_comm_hook(CommHook hook, std::string name = "custom") {
    reducer_->register_comm_hook(std::move(hook), std::move(name));
  }
  // Configuration, buckets and average times so far (ddp/torch/ddp/ddp_logging_data.h). Local.
  DdpLoggingData logging_data() const;

  // Copies rank 0's buffers to every rank (collective). E.g. before evaluating on every rank.
  void sync_buffers();
  // Compares a checksum of every parameter across the ranks now (collective); throws Error naming
  // the first parameter that differs and the ranks that differ from rank 0.
  void check_divergence() { check_divergence_because({}); }
  // The check that runs before every forward (local): re-attaches the hooks of parameters
  // replaced by tensors of the same shape, throws Error for other changes. Returns how many
  // parameters were re-attached.
  std::size_t check_parameters();

  // Joinable (ddp/torch/api/join.h).
  void join_main_hook() override;
  void join_post_hook(bool is_last_joiner) override;
  ProcessGroup& join_process_group() override { return *group_; }
  std::string join_description() const override;
  bool join_leaves_gradients() const override { return true; }

 protected:
  // `group` null = default_process_group_for(the parameters' device) (distributed.h): the default
  // group, or under DDP_BACKEND=auto the nccl group for CUDA parameters where there is one.
  // Registers `module` as the submodule "module".
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                              std::shared_ptr<ProcessGroup> group, DdpOptions options);
  // For a module that is not a torch::nn::Module: DDP synchronises the tensors `wrapped` reads,
  // and registers `registered` (which holds the same parameters and buffers) as the submodule
  // "module", so that parameters() and buffers() list them for optimizers.
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> registered,
                              WrappedModuleTensors wrapped, std::shared_ptr<ProcessGroup> group,
                              DdpOptions options);
  void pre_forward();
  void post_forward(const std::vector<torch::Tensor>& outputs);
  // `input` cast to DdpOptions::param_dtype when that is set and `input` is floating-point, else
  // `input` itself.
  torch::Tensor mixed_precision_input(const torch::Tensor& input) const;

 private:
  struct StepPlan;
  StepPlan plan_join_step(bool joined, bool loaded_here);
  double join_gradient_scale(const JoinState& join, int nonjoined) const;
  void broadcast_buffers_from(int root);
  // The divergence guard before a training forward (collective unless the guard is off).
  // `loaded_here`: this rank loaded or replaced parameters since the last guarded forward.
  void guard_divergence(bool loaded_here);
  // Whether this rank's parameters were loaded or replaced since the last guarded forward.
  bool parameters_loaded_since_last_forward(std::size_t reattached);
  // `loaded_ranks`: the ranks that loaded since the last forward, named in the error.
  void check_divergence_because(const std::vector<int>& loaded_ranks);
  // DdpOptions::param_dtype: the parameters' data swapped for a low-precision copy (forward and
  // backward), and back to their full-precision masters with their gradients upcast.
  void cast_parameters_for_forward();
  void restore_full_precision_parameters();
  void pre_forward_in_full_precision();

  WrappedModuleTensors wrapped_;
  std::shared_ptr<ProcessGroup> group_;
  DdpOptions options_;
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
  std::int64_t training_forwards_ = 0;
  // Training forwards with gradients enabled: the ones the divergence guard counts (evaluation
  // under NoGradGuard in training mode, maybe on one rank only, communicates nothing).
  std::int64_t guarded_forwards_ = 0;
  // The parameters' storage at the last guarded forward, and ddp's load count then: a change
  // means a load or a replacement on this rank.
  std::vector<const void*> parameter_storage_;
  std::uint64_t loads_seen_ = 0;
  // Set by pre_forward for post_forward: run the guard, and whether this rank loaded.
  bool guard_after_forward_ = false;
  bool loaded_before_forward_ = false;
  // Training-mode forwards timed from pre_forward to post_forward (logging_data, traces).
  std::chrono::steady_clock::time_point forward_started_{};
  std::int64_t timed_forwards_ = 0;
  std::chrono::nanoseconds forward_time_{0};
  // While the parameters are cast (param_dtype): each one and its full-precision data.
  std::vector<torch::Tensor> cast_parameters_;
  std::vector<torch::Tensor> full_precision_data_;
};

template <typename ModuleType>
class DistributedDataParallelImpl : public DistributedDataParallelBase {
 public:
  DistributedDataParallelImpl(std::shared_ptr<ModuleType> module,
                              std::shared_ptr<ProcessGroup> group = nullptr,
                              DdpOptions options = {})
      : DistributedDataParallelBase(module, std::move(group), options),
        module_(std::move(module)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    pre_forward();
    auto output = module_->forward(forward_argument(std::forward<Args>(args))...);
    std::vector<torch::Tensor> tensors;
    detail::OutputTensors</*kStrict=*/false>::collect(output, tensors);
    post_forward(tensors);
    return output;
  }

  // The wrapped module (its parameters are this module's, under the prefix "module.").
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  // A tensor argument of forward, cast to DdpOptions::param_dtype when it is floating-point;
  // anything else as it came.
  template <typename T>
  decltype(auto) forward_argument(T&& arg) {
    if constexpr (std::is_same_v<std::remove_cvref_t<T>, torch::Tensor>) {
      return mixed_precision_input(arg);
    } else {
      return std::forward<T>(arg);
    }
  }

  std::shared_ptr<ModuleType> module_;
};

namespace detail {

// The module type a holder contains (GPT for a TORCH_MODULE(GPT)'s GPTImpl holder), else itself.
template <typename T, typename = void>
struct contained_module {
  using type = T;
};
template <typename T>
struct contained_module<T, std::void_t<typename T::ContainedType>> {
  using type = typename T::ContainedType;
};
template <typename T>
using contained_module_t = typename contained_module<T>::type;

}  // namespace detail

// The module holder, as libtorch's TORCH_MODULE holders: ModuleType is the module (GPTImpl) or its
// holder (GPT, from TORCH_MODULE(GPT)); both name the same wrapper. As a class member:
//
//   struct Trainer {
//     ddp::DistributedDataParallel<GPT> model{nullptr};  // empty until wrapped
//     explicit Trainer(GPT gpt) : model(gpt) {}         // or later: model = ddp::...(gpt);
//     void step(torch::Tensor x) { model->forward(x); model->module()->... }
//   };
template <typename ModuleType>
class DistributedDataParallel
    : public torch::nn::ModuleHolder<
          DistributedDataParallelImpl<detail::contained_module_t<ModuleType>>> {
  using Module = detail::contained_module_t<ModuleType>;
  using Holder = torch::nn::ModuleHolder<DistributedDataParallelImpl<Module>>;

 public:
  // An empty holder (as torch::nn::Linear{nullptr}), to be assigned later.
  DistributedDataParallel(std::nullptr_t) : Holder(nullptr) {}

  DistributedDataParallel(std::shared_ptr<Module> module,
                          std::shared_ptr<ProcessGroup> group = nullptr, DdpOptions options = {})
      : Holder(std::make_shared<DistributedDataParallelImpl<Module>>(std::move(module),
                                                                     std::move(group), options)) {}

  // The same wrapper named through the module or through its holder.
  template <typename Other>
  requires std::is_same_v<detail::contained_module_t<Other>, Module> &&
      (!std::is_same_v<Other, ModuleType>)
          DistributedDataParallel(const DistributedDataParallel<Other>& other)
      : Holder(other.ptr()) {}

  // From a libtorch module holder, e.g. torch::nn::Linear or torch::nn::Sequential.
  template <typename Contained>
  DistributedDataParallel(torch::nn::ModuleHolder<Contained> holder,
                          std::shared_ptr<ProcessGroup> group = nullptr, DdpOptions options = {})
      : DistributedDataParallel(holder.ptr(), std::move(group), options) {}
};

template <typename ModuleType>
DistributedDataParallel(std::shared_ptr<ModuleType>, std::shared_ptr<ProcessGroup> = nullptr,
                        DdpOptions = {}) -> DistributedDataParallel<ModuleType>;
template <typename Contained>
DistributedDataParallel(torch::nn::ModuleHolder<Contained>, std::shared_ptr<ProcessGroup> = nullptr,
                        DdpOptions = {}) -> DistributedDataParallel<Contained>;

}  // namespace ddp
#pragma GCC visibility pop
