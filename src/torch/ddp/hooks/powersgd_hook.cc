// PowerSGD: the state (construction, counters, save and load), the two hooks, the helpers both
// reductions share, orthogonalize and numpy_randint (the reductions are in powersgd_reduce.cc and
// powersgd_batched_reduce.cc).
#include "ddp/torch/ddp/hooks/powersgd_hook.h"

#include <ATen/CPUGeneratorImpl.h>

#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "torch/ddp/hooks/powersgd_internal.h"

namespace ddp {

namespace powersgd_detail {

void orthogonalize(torch::Tensor matrices, double epsilon) {
  if (matrices.dim() != 3 || matrices.size(2) > matrices.size(1)) {
    throw ConfigError(fmt::format(
        "PowerSGD orthogonalize: expected a batch of n x r matrices with r <= n, got shape {}",
        fmt::join(matrices.sizes(), "x")));
  }
  const auto rank = matrices.size(2);
  const auto type = matrices.scalar_type();
  if (rank <= 2 || type == torch::kHalf || type == torch::kBFloat16) {
    // Gram-Schmidt, column by column, as PyTorch's _orthogonalize_gram_schmidt.
    for (std::int64_t i = 0; i < rank; ++i) {
      auto col = matrices.narrow(2, i, 1);
      auto norm = at::linalg_vector_norm(col, 2, std::vector<std::int64_t>{1}, true);
      if (epsilon == 0) {
        col.div_(norm);
      } else {
        col.div_(norm + epsilon);
      }
      if (i + 1 < rank) {
        auto rest = matrices.narrow(2, i + 1, rank - i - 1);
        rest.sub_(torch::sum(col * rest, 1, true) * col);
      }
    }
  } else {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

std::int64_t numpy_randint(std::mt19937& rng, std::uint32_t high) {
  // numpy's legacy RandomState.randint(high): masked rejection sampling on 32-bit draws of the
  // same MT19937 (seeded as std::mt19937 is) — numpy/random/src/distributions.
  if (high <= 1) return 0;
  const std::uint32_t max = high - 1;
  std::uint32_t mask = max;
  for (int shift = 1; shift < 32; shift <<= 1)
    mask |= mask >> shift;
  for (;;) {
    const std::uint32_t value = static_cast<std::uint32_t>(rng()) & mask;
    if (value <= max) return value;
  }
}

namespace {

constexpr std::uint32_t kSeedBound = 1'000'000'000;  // PyTorch: rng.randint(1_000_000_000)

// Plain averaging (before start_powersgd_iter, and for non-floating buckets). The iteration is
// counted at the last bucket: at once before compression starts (as PyTorch), else in finish,
// after the compressed buckets of the pass.
BucketReduction plain_average(const std::shared_ptr<PowerSGDState>& state, ProcessGroup& group,
                              GradBucket& bucket, bool count_iteration_now) {
  const auto bytes = static_cast<std::size_t>(bucket.buffer.nbytes());
  {
    auto lock = Access::lock(*state);
    Access::bytes(*state) += bytes;
    if (count_iteration_now && bucket.is_last) ++Access::iter(*state);
  }
  BucketReduction reduction{allreduce_tensor(group, bucket.buffer, ReduceOp::kAvg), {}, bytes};
  if (!count_iteration_now && bucket.is_last) {
    reduction.finish = [state] {
      auto lock = Access::lock(*state);
      ++Access::iter(*state);
    };
  }
  return reduction;
}

}  // namespace

at::Generator q_generator(PowerSGDState& state) {
  const auto seed = powersgd_detail::numpy_randint(Access::rng(state), kSeedBound);
  return at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
}

std::optional<BucketReduction> plain_average_unless_compressing(
    const std::shared_ptr<PowerSGDState>& state, ProcessGroup& group, GradBucket& bucket) {
  {
    auto lock = Access::lock(*state);
    if (Access::iter(*state) < Access::options(*state).start_powersgd_iter) {
      lock.unlock();
      return plain_average(state, group, bucket, /*count_iteration_now=*/true);
    }
  }
  if (!bucket.buffer.is_floating_point()) {
    return plain_average(state, group, bucket, /*count_iteration_now=*/false);
  }
  return std::nullopt;
}

void check_memory_size(const torch::Tensor& memory, std::int64_t numel, const char* which,
                       std::size_t bucket) {
  if (memory.numel() != numel) {
    throw ConfigError(fmt::format(
        "PowerSGD: the state's {} memory of gradient bucket {} has {} elements but this bucket "
        "needs {}: the state belongs to another model or bucket layout (one PowerSGDState per "
        "DDP model; load a saved state only into the model it was saved with, and keep "
        "start_powersgd_iter >= 2 so that compression starts after DDP rebuilds its buckets)",
        which, bucket, memory.numel(), numel));
  }
}

}  // namespace powersgd_detail

namespace {

std::shared_ptr<PowerSGDState> checked(std::shared_ptr<PowerSGDState> state, const char* hook) {
  if (!state) {
    throw ConfigError(fmt::format(
        "{}: the state is null; pass std::make_shared<ddp::PowerSGDState>(options)", hook));
  }
  return state;
}

}  // namespace

PowerSGDState::PowerSGDState(PowerSGDOptions options)
    : options_(options), rng_(options.random_seed) {
  if (options_.matrix_approximation_rank < 1) {
    throw ConfigError(fmt::format(
        "PowerSGDOptions::matrix_approximation_rank is {}; it must be at least 1 (the number of "
        "columns of the low-rank factors P and Q; try 1, 2, 4, ...)",
        options_.matrix_approximation_rank));
  }
  if (options_.start_powersgd_iter < 0 || !(options_.min_compression_rate >= 0) ||
      !(options_.orthogonalization_epsilon >= 0)) {
    throw ConfigError(
        fmt::format("PowerSGDOptions: start_powersgd_iter ({}), min_compression_rate ({}) and "
                    "orthogonalization_epsilon ({}) must not be negative",
                    options_.start_powersgd_iter, options_.min_compression_rate,
                    options_.orthogonalization_epsilon));
  }
  if ((options_.use_error_feedback || options_.warm_start) && options_.start_powersgd_iter <= 1) {
    throw ConfigError(fmt::format(
        "PowerSGDOptions::start_powersgd_iter is {}; with use_error_feedback or warm_start it "
        "must be at least 2, because DDP rebuilds its buckets after the first iteration and the "
        "per-bucket memories must not be made before (as in PyTorch)",
        options_.start_powersgd_iter));
  }
}

std::int64_t PowerSGDState::iteration() const {
  std::lock_guard lock(mutex_);
  return iter_;
}
std::int64_t PowerSGDState::numel_before_compression() const {
  std::lock_guard lock(mutex_);
  return numel_before_;
}
std::int64_t PowerSGDState::numel_after_compression() const {
  std::lock_guard lock(mutex_);
  return numel_after_;
}
std::uint64_t PowerSGDState::bytes_sent() const {
  std::lock_guard lock(mutex_);
  return bytes_sent_;
}

namespace {
constexpr const char* kPrefix = "powersgd/";

void write_memories(torch::serialize::OutputArchive& archive, const char* name,
                    const std::map<std::size_t, torch::Tensor>& memories) {
  for (const auto& [index, tensor] : memories)
    archive.write(fmt::format("{}{}/{}", kPrefix, name, index), tensor);
}

std::map<std::size_t, torch::Tensor> read_memories(torch::serialize::InputArchive& archive,
                                                   const std::vector<std::string>& keys,
                                                   const std::string& name) {
  std::map<std::size_t, torch::Tensor> memories;
  const std::string prefix = kPrefix + name + "/";
  for (const auto& key : keys) {
    if (key.rfind(prefix, 0) != 0) continue;
    torch::Tensor tensor;
    archive.read(key, tensor);
    memories[std::stoul(key.substr(prefix.size()))] = tensor;
  }
  return memories;
}
}  // namespace

void PowerSGDState::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard lock(mutex_);
  std::ostringstream rng;
  rng << rng_;
  archive.write(std::string(kPrefix) + "iteration", c10::IValue(iter_));
  archive.write(std::string(kPrefix) + "numel_before", c10::IValue(numel_before_));
  archive.write(std::string(kPrefix) + "numel_after", c10::IValue(numel_after_));
  archive.write(std::string(kPrefix) + "bytes_sent",
                c10::IValue(static_cast<std::int64_t>(bytes_sent_)));
  archive.write(std::string(kPrefix) + "rng", c10::IValue(rng.str()));
  write_memories(archive, "error", error_);
  write_memories(archive, "p", p_memory_);
  write_memories(archive, "q", q_memory_);
}

void PowerSGDState::load(torch::serialize::InputArchive& archive) {
  c10::IValue iteration, before, after, bytes, rng_text;
  if (!archive.try_read(std::string(kPrefix) + "iteration", iteration) ||
      !archive.try_read(std::string(kPrefix) + "rng", rng_text)) {
    throw ConfigError(
        "PowerSGDState::load: the archive holds no PowerSGD state (no 'powersgd/iteration'); "
        "save it with PowerSGDState::save into the archive you load from");
  }
  archive.read(std::string(kPrefix) + "numel_before", before);
  archive.read(std::string(kPrefix) + "numel_after", after);
  archive.read(std::string(kPrefix) + "bytes_sent", bytes);
  const auto keys = archive.keys();
  auto errors = read_memories(archive, keys, "error");
  auto ps = read_memories(archive, keys, "p");
  auto qs = read_memories(archive, keys, "q");
  std::mt19937 rng;
  std::istringstream in(rng_text.toStringRef());
  in >> rng;
  if (!in) throw ConfigError("PowerSGDState::load: the saved random generator state is corrupt");
  std::lock_guard lock(mutex_);
  iter_ = iteration.toInt();
  numel_before_ = before.toInt();
  numel_after_ = after.toInt();
  bytes_sent_ = static_cast<std::uint64_t>(bytes.toInt());
  rng_ = rng;
  error_ = std::move(errors);
  p_memory_ = std::move(ps);
  q_memory_ = std::move(qs);
}

CommHook powersgd_hook(std::shared_ptr<PowerSGDState> state) {
  state = checked(std::move(state), "powersgd_hook");
  return [state](ProcessGroup& group, GradBucket& bucket) {
    return powersgd_detail::powersgd_reduce(state, group, bucket);
  };
}

CommHook batched_powersgd_hook(std::shared_ptr<PowerSGDState> state) {
  state = checked(std::move(state), "batched_powersgd_hook");
  return [state](ProcessGroup& group, GradBucket& bucket) {
    return powersgd_detail::batched_powersgd_reduce(state, group, bucket);
  };
}

}  // namespace ddp
