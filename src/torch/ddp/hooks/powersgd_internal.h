// Private to PowerSGD's sources (powersgd_hook.cc, powersgd_reduce.cc, powersgd_batched_reduce.cc):
// the hooks' access to the state, and what both reductions use (defined in powersgd_hook.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"

namespace ddp {

// The hooks' access to the state's members (kept private so that users go through the
// accessors, which lock).
struct PowerSGDAccess {
  static std::unique_lock<std::mutex> lock(PowerSGDState& s) { return std::unique_lock(s.mutex_); }
  static const PowerSGDOptions& options(PowerSGDState& s) { return s.options_; }
  static std::int64_t& iter(PowerSGDState& s) { return s.iter_; }
  static std::int64_t& before(PowerSGDState& s) { return s.numel_before_; }
  static std::int64_t& after(PowerSGDState& s) { return s.numel_after_; }
  static std::uint64_t& bytes(PowerSGDState& s) { return s.bytes_sent_; }
  static std::mt19937& rng(PowerSGDState& s) { return s.rng_; }
  static std::map<std::size_t, torch::Tensor>& error(PowerSGDState& s) { return s.error_; }
  static std::map<std::size_t, torch::Tensor>& p(PowerSGDState& s) { return s.p_memory_; }
  static std::map<std::size_t, torch::Tensor>& q(PowerSGDState& s) { return s.q_memory_; }
};

namespace powersgd_detail {

using Access = PowerSGDAccess;

// A random generator seeded as PyTorch seeds the global one under fork_rng for the initial Q.
at::Generator q_generator(PowerSGDState& state);

// Both variants average plainly before start_powersgd_iter and for non-floating buckets; else
// nullopt: the bucket is compressed.
std::optional<BucketReduction> plain_average_unless_compressing(
    const std::shared_ptr<PowerSGDState>& state, ProcessGroup& group, GradBucket& bucket);

// The bucket's memory of `which` (error, P or Q) with `numel` elements: reused when present and
// of that size, else ConfigError (a state from another model or bucket layout).
void check_memory_size(const torch::Tensor& memory, std::int64_t numel, const char* which,
                       std::size_t bucket);

// The two hooks' reductions of one bucket: powersgd_hook's (powersgd_reduce.cc) and
// batched_powersgd_hook's (powersgd_batched_reduce.cc).
BucketReduction powersgd_reduce(const std::shared_ptr<PowerSGDState>& state_ptr,
                                ProcessGroup& group, GradBucket& bucket);
BucketReduction batched_powersgd_reduce(const std::shared_ptr<PowerSGDState>& state_ptr,
                                        ProcessGroup& group, GradBucket& bucket);

}  // namespace powersgd_detail
}  // namespace ddp
