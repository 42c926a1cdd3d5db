#include "ddp/torch/ddp/grad_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "torch/core/host_values.h"
#include "torch/core/libtorch_compat.h"

namespace ddp {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw ConfigError("GradScalerOptions: " + what);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options, std::shared_ptr<ProcessGroup> group)
    : options_(options), group_(std::move(group)), scale_(static_cast<float>(options.init_scale)) {
  require(options_.init_scale > 0 && options_.init_scale <= std::numeric_limits<float>::max(),
          fmt::format("init_scale must be > 0 and finite in float32 (at most {:g}), got {}",
                      std::numeric_limits<float>::max(), options_.init_scale));
  require(std::isfinite(options_.growth_factor) && options_.growth_factor > 1,
          fmt::format("growth_factor must be finite and > 1, got {}", options_.growth_factor));
  require(options_.backoff_factor > 0 && options_.backoff_factor < 1,
          fmt::format("backoff_factor must be in (0, 1), got {}", options_.backoff_factor));
  require(options_.growth_interval > 0,
          fmt::format("growth_interval must be > 0, got {}", options_.growth_interval));
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const {
  if (!options_.enabled) return loss;
  // In fp32, as PyTorch's scale tensor, whatever the loss's dtype.
  return loss * scale_;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  auto& state = iteration_[&optimizer];
  if (state.unscaled) {
    throw Error(
        "GradScaler::unscale_() has already been called on this optimizer since the last "
        "update(); call update() once per iteration, after step()");
  }
  if (state.stepped) {
    throw Error(
        "GradScaler::unscale_() is being called after step() on this optimizer; call it "
        "before step(), or not at all (step() unscales)");
  }
  // The reciprocal in fp32, as PyTorch (scale.double().reciprocal().float()).
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_));
  // One flag per device, set where the gradients are, and read once per device: a CUDA
  // gradient's check queues on its stream instead of waiting for it parameter by parameter.
  std::vector<torch::Tensor> non_finite;  // a bool scalar per device
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      auto& grad = param.mutable_grad();
      if (!grad.defined()) continue;
      if (grad.is_sparse()) {
        throw Error("GradScaler::unscale_: sparse gradients are not supported; use dense ones");
      }
      grad.mul_(inv_scale);
      auto flag = std::find_if(non_finite.begin(), non_finite.end(),
                               [&](const torch::Tensor& f) { return f.device() == grad.device(); });
      if (flag == non_finite.end()) {
        non_finite.push_back(torch::zeros({}, grad.options().dtype(torch::kBool)));
        flag = non_finite.end() - 1;
      }
      flag->logical_or_(torch::isfinite(grad).logical_not().any());
    }
  }
  bool found_inf = false;
  for (const auto& flag : non_finite)
    found_inf = found_inf || flag.item<bool>();
  if (group_ && group_->size() > 1) {
    // Every rank must make the same decision: one overflow anywhere skips the step everywhere.
    std::int32_t flag = found_inf ? 1 : 0;
    detail::HostValues(*group_)->allreduce(&flag, 1, DType::kInt32, ReduceOp::kMax)->wait();
    found_inf = flag != 0;
  }
  state.unscaled = true;
  state.found_inf = found_inf;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  auto& state = iteration_[&optimizer];
  if (state.stepped) {
    throw Error(
        "GradScaler::step() has already been called on this optimizer since the last "
        "update(); call update() once per iteration");
  }
  if (!state.unscaled) unscale_(optimizer);
  auto& after = iteration_[&optimizer];
  after.stepped = true;
  if (after.found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  if (iteration_.empty()) {
    throw Error(
        "GradScaler::update(): no unscale_() or step() since the last update(); nothing "
        "says whether this iteration overflowed");
  }
  bool found_inf = false;
  for (const auto& [optimizer, state] : iteration_)
    found_inf = found_inf || state.found_inf;
  iteration_.clear();
  if (found_inf) {
    scale_ *= static_cast<float>(options_.backoff_factor);
    growth_tracker_ = 0;
    return;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    scale_ *= static_cast<float>(options_.growth_factor);
    growth_tracker_ = 0;
  }
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  if (!(new_scale > 0 && new_scale <= std::numeric_limits<float>::max())) {
    throw ConfigError(fmt::format(
        "GradScaler::update(new_scale): must be > 0 and finite in float32, got {}", new_scale));
  }
  scale_ = static_cast<float>(new_scale);
  iteration_.clear();
}

bool GradScaler::found_inf(const torch::optim::Optimizer& optimizer) const {
  const auto it = iteration_.find(&optimizer);
  return it != iteration_.end() && it->second.found_inf;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", torch::tensor(scale_, torch::kFloat64));
  archive.write("_growth_tracker", torch::tensor(growth_tracker_, torch::kInt64));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  torch::Tensor scale, tracker;
  archive.read("scale", scale);
  archive.read("_growth_tracker", tracker);
  const double new_scale = scale.item<double>();
  const auto new_tracker = tracker.item<std::int64_t>();
  if (!(new_scale > 0 && new_scale <= std::numeric_limits<float>::max()) || new_tracker < 0) {
    throw Error(
        fmt::format("GradScaler::load: the archive holds scale {} and growth tracker {}; "
                    "expected a scale > 0, finite in float32, and a tracker >= 0",
                    new_scale, new_tracker));
  }
  scale_ = static_cast<float>(new_scale);
  growth_tracker_ = new_tracker;
  iteration_.clear();
}

AutocastGuard::AutocastGuard(torch::ScalarType dtype, bool enabled)
    : previous_enabled_(libtorch_compat::cpu_autocast_enabled()),
      previous_dtype_(libtorch_compat::cpu_autocast_dtype()) {
  if (dtype != torch::kBFloat16 && dtype != torch::kFloat16) {
    throw ConfigError(fmt::format("AutocastGuard: CPU autocast runs in bfloat16 or float16, not {}",
                                  c10::toString(dtype)));
  }
  if (dtype == torch::kFloat16 && !libtorch_compat::cpu_autocast_supports_half()) {
    // libtorch would warn and run everything in fp32: refuse rather than be silently different.
    throw ConfigError(
        "AutocastGuard: this libtorch's CPU autocast runs in bfloat16 only; use "
        "torch::kBFloat16, or libtorch 2.x for float16");
  }
  libtorch_compat::set_cpu_autocast(enabled, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // Leaving the outermost autocast region frees the casts it cached, as torch.autocast's exit.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  libtorch_compat::set_cpu_autocast(previous_enabled_, previous_dtype_);
}

}  // namespace ddp
