// DistributedDataParallel: data-parallel training of a libtorch module across processes.
//
//   auto pg = ddp::init_process_group();
//   auto model = ddp::DistributedDataParallel(std::make_shared<Net>(), pg);
//   torch::optim::SGD opt(model->parameters(), 0.1);
//   for (...) { opt.zero_grad(); model->forward(x).cross_entropy... .backward(); opt.step(); }
//
// Construction checks that every rank wraps the same parameters (count, shapes, dtypes; the error
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
// a changed parameter set, shape, dtype or device is an Error naming the parameter. Loading values
// on some ranks only cannot be seen that way: ddp::load_checkpoint on every rank, or the opt-in
// divergence check (DdpOptions::divergence_check_every, or DDP_DIVERGENCE_CHECK_EVERY=N), which
// compares a checksum of every parameter across ranks every N training forwards and names the
// first parameter that differs and the ranks.
//
// Uneven inputs: DistributedDataParallel is a Joinable; see ddp/torch/join.h.
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
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddp/process_group.h"
#include "ddp/torch/comm_hooks.h"
#include "ddp/torch/ddp_logging_data.h"
#include "ddp/torch/join.h"
#include "ddp/torch/reducer.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct DdpOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;
  bool broadcast_buffers = true;
  bool find_unused_parameters = false;
  bool gradient_as_bucket_view = false;
  bool static_graph = false;
  // Every N training-mode forwards, compare a checksum of each parameter across the ranks (one
  // allgather of 8 bytes per parameter) and throw Error naming the first that differs. 0 = off,
  // unless the environment sets DDP_DIVERGENCE_CHECK_EVERY=N.
  std::int64_t divergence_check_every = 0;
  // Mixed precision for the gradient reduction (PyTorch's mixed_precision.reduce_dtype):
  // torch::kBFloat16 or torch::kHalf reduces every bucket in that dtype (half the bytes on the
  // wire) while parameters and .grad stay fp32; the same as registering bf16_compress_hook() or
  // fp16_compress_hook(), which a later register_comm_hook replaces. nullopt: the gradients' dtype.
  std::optional<torch::ScalarType> reduce_dtype;
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
  // Configuration, buckets and average times so far (ddp/torch/ddp_logging_data.h). Local.
  DdpLoggingData logging_data() const;

  // Copies rank 0's buffers to every rank (collective). E.g. before evaluating on every rank.
  void sync_buffers();
  // Compares a checksum of every parameter across the ranks now (collective); throws Error naming
  // the first parameter that differs and the ranks that differ from rank 0.
  void check_divergence();
  // The check that runs before every forward (local): re-attaches the hooks of parameters
  // replaced by tensors of the same shape, throws Error for other changes. Returns how many
  // parameters were re-attached.
  std::size_t check_parameters();

  // Joinable (ddp/torch/join.h).
  void join_main_hook() override;
  void join_post_hook(bool is_last_joiner) override;
  ProcessGroup& join_process_group() override { return *group_; }
  std::string join_description() const override;
  bool join_leaves_gradients() const override { return true; }

 protected:
  // `group` null = default_process_group(). Registers `module` as the submodule "module".
  DistributedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                              std::shared_ptr<ProcessGroup> group, DdpOptions options);
  void pre_forward();
  void post_forward(const std::vector<torch::Tensor>& outputs);

 private:
  struct StepPlan;
  StepPlan plan_join_step(bool joined);
  double join_gradient_scale(const JoinState& join, int nonjoined) const;
  void broadcast_buffers_from(int root);
  void maybe_check_divergence();

  std::shared_ptr<torch::nn::Module> wrapped_;
  std::shared_ptr<ProcessGroup> group_;
  DdpOptions options_;
  std::vector<torch::Tensor> buffers_;
  std::unique_ptr<Reducer> reducer_;
  std::int64_t training_forwards_ = 0;
  // Training-mode forwards timed from pre_forward to post_forward (logging_data, traces).
  std::chrono::steady_clock::time_point forward_started_{};
  std::int64_t timed_forwards_ = 0;
  std::chrono::nanoseconds forward_time_{0};
};

namespace detail {

inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  out.push_back(t);
}
inline void collect_tensors(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... Ts>
void collect_tensors(const std::tuple<Ts...>& tuple, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... items) { (collect_tensors(items, out), ...); }, tuple);
}
template <typename A, typename B>
void collect_tensors(const std::pair<A, B>& pair, std::vector<torch::Tensor>& out) {
  collect_tensors(pair.first, out);
  collect_tensors(pair.second, out);
}
// Other output types carry no tensors ddp can see; find_unused_parameters then reports every
// parameter as unused, so return tensors from forward when using it.
template <typename T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {}

}  // namespace detail

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
    auto output = module_->forward(std::forward<Args>(args)...);
    std::vector<torch::Tensor> tensors;
    detail::collect_tensors(output, tensors);
    post_forward(tensors);
    return output;
  }

  // The wrapped module (its parameters are this module's, under the prefix "module.").
  const std::shared_ptr<ModuleType>& module() const { return module_; }

 private:
  std::shared_ptr<ModuleType> module_;
};

template <typename ModuleType>
class DistributedDataParallel
    : public torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleType>> {
  using Holder = torch::nn::ModuleHolder<DistributedDataParallelImpl<ModuleType>>;

 public:
  DistributedDataParallel(std::shared_ptr<ModuleType> module,
                          std::shared_ptr<ProcessGroup> group = nullptr, DdpOptions options = {})
      : Holder(std::make_shared<DistributedDataParallelImpl<ModuleType>>(
            std::move(module), std::move(group), options)) {}

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
