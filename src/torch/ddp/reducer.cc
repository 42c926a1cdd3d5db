// Reducer: construction, the gradient hooks and the parameter checks before forward,
// prepare_for_backward, comm-hook registration and the settings (the bucket phases are in
// reducer_buckets.cc, reducer_launch.cc and reducer_finalize.cc).
#include "ddp/torch/ddp/reducer.h"

#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/timeouts.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "torch/core/device_staging.h"
#include "torch/core/host_values.h"
#include "torch/core/libtorch_compat.h"
#include "torch/core/parameter_devices.h"
#include "torch/core/staging_thread.h"
#include "torch/ddp/reducer_internal.h"

namespace ddp {

Reducer::Reducer(std::vector<torch::Tensor> parameters, std::vector<std::string> names,
                 std::shared_ptr<ProcessGroup> group, ReducerOptions options)
    : parameters_(std::move(parameters)),
      names_(std::move(names)),
      group_(std::move(group)),
      options_(options),
      comm_hook_(allreduce_hook()) {
  if (!group_) throw ConfigError("Reducer needs a process group");
  if (names_.size() != parameters_.size()) {
    throw ConfigError("Reducer: one name per parameter is needed");
  }
  if (options_.bucket_cap_bytes == 0 || options_.first_bucket_cap_bytes == 0) {
    throw ConfigError("bucket caps must be positive (bucket_cap_mb, first bucket)");
  }
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    check_collective_tensor(p, fmt::format("parameter '{}'", names_[i]));
    if (!p.requires_grad() || !p.is_leaf()) {
      throw ConfigError(
          fmt::format("parameter '{}' must be a leaf tensor that requires grad", names_[i]));
    }
  }
  if (const auto mixed = detail::mixed_devices(parameters_, names_)) throw ConfigError(*mixed);
  const c10::Device device =
      parameters_.empty() ? c10::Device(c10::kCPU) : parameters_.front().device();
  if (group_->memory_space() == MemorySpace::kCuda && !detail::takes_as_is(*group_, device)) {
    throw ConfigError(fmt::format(
        "DistributedDataParallel: the parameters are on {}, but the process group ({}) takes "
        "CUDA memory only; move the module to its GPU (module->to(torch::Device(\"cuda:<local "
        "rank>\"))) or use a host group (ring, mpi)",
        device.str(), group_->backend()));
  }
  if (options_.staging_for_tests.enabled) {
    staging_ = detail::make_host_staging(options_.staging_for_tests.observer);
  } else if (device.is_cuda() && group_->memory_space() == MemorySpace::kHost) {
    staging_ = detail::make_cuda_staging(device);
  }
  if (staging_) staging_thread_ = std::make_unique<detail::StagingThread>();
  sparse_ = options_.sparse_gradients;
  if (sparse_.empty()) sparse_.assign(parameters_.size(), false);
  if (sparse_.size() != parameters_.size()) {
    throw ConfigError(fmt::format("Reducer: sparse_gradients has {} entries for {} parameters",
                                  sparse_.size(), parameters_.size()));
  }
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (sparse_[i] &&
        (staging_ || !device.is_cpu() || group_->memory_space() != MemorySpace::kHost)) {
      throw ConfigError(fmt::format(
          "DistributedDataParallel: parameter '{}' has sparse gradients (an Embedding with "
          "sparse = true) on {}; ddp reduces sparse gradients of CPU parameters only: use "
          "sparse = false on a GPU",
          names_[i], device.str()));
    }
  }
  ready_.assign(parameters_.size(), false);
  used_.assign(parameters_.size(), false);

  std::vector<std::size_t> reverse_order(parameters_.size());
  std::iota(reverse_order.rbegin(), reverse_order.rend(), std::size_t{0});
  assign_buckets(reverse_order);

  grad_hooks_.resize(parameters_.size());
  for (std::size_t i = 0; i < parameters_.size(); ++i)
    attach_hook(i);
}

void Reducer::attach_hook(std::size_t param) {
  grad_hooks_[param] = std::make_unique<libtorch_compat::GradReadyHook>(
      parameters_[param], [this, param] { autograd_hook(param); });
}

std::size_t Reducer::check_parameters(const std::vector<torch::Tensor>& parameters,
                                      const std::vector<std::string>& names) {
  std::lock_guard lock(mutex_);
  if (names != names_) {
    std::size_t i = 0;
    while (i < names.size() && i < names_.size() && names[i] == names_[i])
      ++i;
    const auto describe = [](const std::vector<std::string>& list, std::size_t k) {
      return k < list.size() ? fmt::format("'{}'", list[k]) : std::string("none");
    };
    throw Error(fmt::format(
        "DistributedDataParallel: the wrapped module's trainable parameters changed after it was "
        "wrapped ({} then, {} now; at position {} it was {}, now {}). A parameter was added, "
        "removed, or its requires_grad changed. Construct a new DistributedDataParallel after "
        "changing which parameters train",
        names_.size(), names.size(), i, describe(names_, i), describe(names, i)));
  }
  std::size_t reattached = 0;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const auto& now = parameters[i];
    // What the parameter was: its slot in a bucket, or (no bucket: sparse, or none left after a
    // failed rebuild) the tensor itself.
    const auto& view = sparse_[i] || buckets_.empty()
                           ? parameters_[i]
                           : buckets_[slots_[i].bucket].views[slots_[i].index];
    if (now.sizes() != view.sizes() || now.scalar_type() != view.scalar_type() ||
        now.device() != view.device()) {
      throw Error(fmt::format(
          "DistributedDataParallel: parameter '{}' is now [{}] {} on {}, but it was [{}] {} on {} "
          "when the model was wrapped. Its gradient bucket no longer fits, and the ranks would "
          "train apart. Change shapes, dtypes and devices (module->to(...), a checkpoint of "
          "another model) before wrapping, or construct a new DistributedDataParallel afterwards",
          names_[i], fmt::join(now.sizes(), ", "), c10::toString(now.scalar_type()),
          now.device().str(), fmt::join(view.sizes(), ", "), c10::toString(view.scalar_type()),
          view.device().str()));
    }
    const bool same_tensor = now.unsafeGetTensorImpl() == parameters_[i].unsafeGetTensorImpl();
    if (same_tensor && grad_hooks_[i]->attached_to(now)) continue;
    if (!now.requires_grad() || !now.is_leaf()) {
      throw Error(fmt::format(
          "DistributedDataParallel: parameter '{}' was replaced by a tensor that is not a leaf "
          "requiring grad; construct a new DistributedDataParallel after replacing parameters",
          names_[i]));
    }
    // A load (Module::load, torch::load) or a replaced tensor: the hook must follow the
    // parameter to its current accumulator, or its gradients would never be averaged again.
    parameters_[i] = now;
    attach_hook(i);  // and the hook on the old accumulator goes
    ++reattached;
  }
  return reattached;
}

void Reducer::follow_gradient_accumulators() {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!grad_hooks_[i]->attached_to(parameters_[i])) attach_hook(i);
  }
}

Reducer::~Reducer() {
  grad_hooks_.clear();      // first: no hook may run into a Reducer being destroyed
  staging_thread_.reset();  // lets a launch in progress finish; nothing launches after it
  std::lock_guard lock(mutex_);
  wait_for_launched_buckets();
}

void Reducer::prepare_for_backward(const std::vector<torch::Tensor>& outputs) {
  std::lock_guard lock(mutex_);
  // A new pass: a failed one may have dropped its queued callbacks.
  end_of_backward_queued_ = false;
  if (callback_queued_) {
    // The last backward threw inside autograd after its first hook (a hook of the user's, an
    // allocation): finalize_backward never ran, and every parameter it reached would count as
    // ready twice in this pass. That pass is dropped: what it launched completes first (as on the
    // other ranks, or within the group's timeout), and nothing of it is delivered; the local
    // gradients autograd accumulated before the failure stay in .grad, as without DDP.
    if (staging_thread_) staging_thread_->drain(detail::Clock::now() + kDefaultTimeout);
    wait_for_launched_buckets();
    reset_iteration();
  }
  if (!require_sync_) return;
  throw_if_hook_failed();
  expect_hooks_ = true;
  prepared_at_ = detail::Clock::now();
  if (!options_.find_unused_parameters && !options_.static_graph) return;
  if (options_.static_graph && unused_known_) return;
  find_unused(outputs);
}

void Reducer::find_unused(const std::vector<torch::Tensor>& outputs) {
  ++stats_.unused_parameter_searches;
  const auto seen = libtorch_compat::reachable_nodes(outputs);
  unused_.clear();
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (seen.count(grad_hooks_[i]->node()) == 0) unused_.push_back(i);
  }
}

void Reducer::set_end_of_backward(std::function<void()> callback) {
  std::lock_guard lock(mutex_);
  end_of_backward_ = std::move(callback);
}

void Reducer::queue_end_of_backward() {
  if (!end_of_backward_ || end_of_backward_queued_) return;
  end_of_backward_queued_ = true;
  libtorch_compat::at_end_of_backward([this] {
    std::function<void()> callback;
    {
      std::lock_guard lock(mutex_);
      end_of_backward_queued_ = false;
      callback = end_of_backward_;
    }
    callback();
  });
}

void Reducer::set_require_sync(bool require_sync) {
  std::lock_guard lock(mutex_);
  require_sync_ = require_sync;
}

bool Reducer::require_sync() const {
  std::lock_guard lock(mutex_);
  return require_sync_;
}

void Reducer::register_comm_hook(CommHook hook, std::string name) {
  if (!hook) throw ConfigError("register_comm_hook: the hook is empty");
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    if (!sparse_[i]) continue;
    throw ConfigError(fmt::format(
        "register_comm_hook ({}): parameter '{}' has sparse gradients (an Embedding with "
        "sparse = true), and comm hooks take dense buckets; use sparse = false to compress it, or "
        "no hook",
        name, names_[i]));
  }
  comm_hook_ = std::move(hook);
  comm_hook_name_ = std::move(name);
  custom_hook_ = true;
}

std::string Reducer::comm_hook_name() const {
  std::lock_guard lock(mutex_);
  return comm_hook_name_;
}

}  // namespace ddp
