// GradScaler: dynamic loss scaling for mixed-precision training, with PyTorch's semantics
// (torch.amp.GradScaler), and the overflow check agreed across the ranks of a group.
//
//   ddp::GradScaler scaler({}, pg);
//   for (...) {
//     optimizer.zero_grad();
//     { ddp::AutocastGuard autocast(torch::kBFloat16); loss = loss_fn(model->forward(x), y); }
//     scaler.scale(loss).backward();
//     scaler.step(optimizer);  // unscales; skips the step if a gradient is inf/nan
//     scaler.update();         // backs the scale off after an overflow, grows it after
//   }                          // growth_interval clean steps
//
// The loss is multiplied by the scale so that small gradients survive low precision; step()
// divides the gradients by it again and steps only when every gradient is finite. With a group,
// "every gradient" means on every rank: unscale_ max-allreduces its overflow flag (one 4-byte
// collective per optimizer and step), so all ranks skip the same steps and keep the same scale
// even where their gradients differ (no_sync, sharded gradients, a hook's rounding). Every rank
// must then call unscale_/step in the same order. Without a group the decision is local.
//
// Errors: ConfigError for options out of range (naming the option); Error for calls out of order
// (unscale_ twice between updates, unscale_ after step), as PyTorch's RuntimeErrors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct GradScalerOptions {
  double init_scale = 65536.0;          // 2^16; the scale is kept in float32, as PyTorch's
  double growth_factor = 2.0;           // > 1
  double backoff_factor = 0.5;          // in (0, 1)
  std::int64_t growth_interval = 2000;  // clean steps before the scale grows; > 0
  bool enabled = true;                  // false: scale() and unscale_ do nothing, step() steps
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {},
                      std::shared_ptr<ProcessGroup> group = nullptr);

  // loss * scale (the loss unchanged when disabled).
  torch::Tensor scale(const torch::Tensor& loss) const;
  // Divides the gradients of `optimizer`'s parameters by the scale, in place, and records
  // whether any of them (on any rank, with a group) is inf or nan. At most once per optimizer
  // between updates.
  void unscale_(torch::optim::Optimizer& optimizer);
  // unscale_ if not done yet, then optimizer.step() unless an overflow was found. Returns
  // whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Adjusts the scale from this iteration's overflows (every optimizer's), then forgets them.
  void update();
  // Sets the scale (> 0) instead, as PyTorch's update(new_scale).
  void update(double new_scale);

  double get_scale() const { return options_.enabled ? scale_ : 1.0; }
  std::int64_t growth_tracker() const { return growth_tracker_; }
  bool is_enabled() const { return options_.enabled; }
  // Whether the last unscale_ of `optimizer` in this iteration found an overflow.
  bool found_inf(const torch::optim::Optimizer& optimizer) const;

  // The scale and the growth tracker (PyTorch's state_dict keys "scale", "_growth_tracker").
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    bool found_inf = false;
  };
  GradScalerOptions options_;
  std::shared_ptr<ProcessGroup> group_;
  float scale_;
  std::int64_t growth_tracker_ = 0;
  std::map<const torch::optim::Optimizer*, PerOptimizer> iteration_;
};

// Autocast on the CPU for the guard's lifetime (bf16 or fp16): eligible ops (matmul, linear,
// convolution, ...) run in that dtype, the rest in fp32, as torch.autocast("cpu"). Restores the
// previous state on destruction. Per thread, as libtorch's autocast state. ConfigError for another
// dtype, and for float16 with libtorch 1.13 (its CPU autocast supports bfloat16 only).
class AutocastGuard {
 public:
  explicit AutocastGuard(torch::ScalarType dtype = torch::kBFloat16, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool previous_enabled_;
  torch::ScalarType previous_dtype_;
};

}  // namespace ddp
#pragma GCC visibility pop
