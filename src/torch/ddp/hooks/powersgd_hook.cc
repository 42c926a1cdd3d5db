#include "ddp/torch/ddp/hooks/powersgd_hook.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "torch/ddp/hooks/powersgd_kernels.h"

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

}  // namespace powersgd_detail

namespace {

using Access = PowerSGDAccess;

constexpr std::uint32_t kSeedBound = 1'000'000'000;  // PyTorch: rng.randint(1_000_000_000)

// A random generator seeded as PyTorch seeds the global one under fork_rng for the initial Q.
at::Generator q_generator(PowerSGDState& state) {
  const auto seed = powersgd_detail::numpy_randint(Access::rng(state), kSeedBound);
  return at::detail::createCPUGenerator(static_cast<std::uint64_t>(seed));
}

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

// Both variants average plainly before start_powersgd_iter and for non-floating buckets; else
// nullopt: the bucket is compressed.
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

// The bucket's memory of `which` (error, P or Q) with `numel` elements: reused when present and
// of that size, else ConfigError (a state from another model or bucket layout).
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

// Adds the bucket's error to `input` (none on its first step) and returns the bucket's error
// memory, which now holds a copy of the error-corrected input; the finish step subtracts the
// approximation from it, leaving the new error. PyTorch clones the input and allocates the
// difference every step; reusing the one tensor gives the same values without two allocations
// of the bucket's size per step (80 MB each for the mlp).
torch::Tensor apply_error_feedback(PowerSGDState& state, std::size_t index, torch::Tensor& input) {
  auto lock = Access::lock(state);
  auto& errors = Access::error(state);
  auto it = errors.find(index);
  if (it == errors.end()) return errors.emplace(index, input.clone()).first->second;
  check_memory_size(it->second, input.numel(), "error", index);
  input.add_(it->second);
  it->second.copy_(input);
  return it->second;
}

// Adds the bucket's error memory to `input` (none on its first step: then it is made, zero) and
// returns the memory. Fused (see CompressionPlan::fused), the memory keeps last step's error
// until the finish step overwrites it with the new one as it decompresses. Otherwise it now
// holds a copy of the error-corrected input, from which the finish step subtracts the result,
// leaving the new error. PyTorch clones the input and allocates the difference every step; either
// way gives its values without two allocations of the bucket's size per step (80 MB each for
// the mlp).
torch::Tensor add_error(PowerSGDState& state, std::size_t index, torch::Tensor& input, bool fused) {
  torch::Tensor error;
  {
    auto lock = Access::lock(state);
    auto& errors = Access::error(state);
    auto it = errors.find(index);
    if (it == errors.end()) {
      return errors.emplace(index, fused ? torch::zeros_like(input) : input.clone()).first->second;
    }
    check_memory_size(it->second, input.numel(), "error", index);
    error = it->second;  // this bucket's: touched by this bucket's hook and finish only
  }
  input.add_(error);
  if (!fused) error.copy_(input);
  return error;
}

// A gradient's element offset in its bucket's buffer, or -1 where it is not a contiguous view
// of the buffer.
std::int64_t offset_in(const torch::Tensor& buffer, const torch::Tensor& grad) {
  if (!grad.is_contiguous() || !grad.is_alias_of(buffer) || grad.dtype() != buffer.dtype())
    return -1;
  const auto offset = grad.storage_offset() - buffer.storage_offset();
  if (offset < 0 || offset + grad.numel() > buffer.numel()) return -1;
  return offset;
}

// One matrix to compress: a view of its gradient in the bucket and of its factors in the
// bucket's P and Q memories.
struct Compressed {
  torch::Tensor matrix;      // n x m
  torch::Tensor p, q;        // n x r and m x r
  std::int64_t offset = -1;  // in the bucket's buffer
};

struct CompressionPlan {
  std::vector<torch::Tensor> uncompressed;         // gradient views, averaged as they are
  std::vector<std::int64_t> uncompressed_offsets;  // in the bucket's buffer
  std::int64_t uncompressed_numel = 0;
  // Matrices to compress, grouped by shape in the order shapes first appear (PyTorch's
  // shape_to_tensors): one batch per shape with batch_tensors_with_same_shape, else one batch per
  // matrix. A batch's Q is drawn and its Ps and Qs are orthogonalised as one [k, n, r] block
  // (p_batches, q_batches: views of the memories) in PyTorch's order; the products are made per
  // matrix on the bucket's own views (PyTorch stacks a batch into a copy for one bmm and copies
  // the result back: the same sums, two more passes).
  std::vector<std::vector<Compressed>> batches;
  std::vector<torch::Tensor> p_batches, q_batches;
  std::int64_t p_numel = 0, q_numel = 0;
  // On the CPU, float or double, and the gradients are contiguous views that tile the buffer in
  // order (as the reducer makes them): the finish step writes the new error while it decompresses,
  // and no copy of the bucket is kept.
  bool fused = false;
};

CompressionPlan plan_compression(PowerSGDState& state, const GradBucket& bucket) {
  const auto& options = Access::options(state);
  CompressionPlan plan;
  const auto type = bucket.buffer.scalar_type();
  plan.fused = bucket.buffer.device().is_cpu() && (type == torch::kFloat || type == torch::kDouble);
  std::int64_t tiled = 0;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::vector<Compressed>> by_shape;
  std::int64_t before = 0, after = 0;
  for (const auto& grad : bucket.gradients) {
    const auto offset = offset_in(bucket.buffer, grad);
    plan.fused = plan.fused && offset == tiled;
    tiled += grad.numel();
    if (grad.dim() == 0) {
      plan.uncompressed.push_back(grad);
      plan.uncompressed_offsets.push_back(offset);
      plan.uncompressed_numel += 1;
      before += 1;
      after += 1;
      continue;
    }
    auto matrix = grad.view({grad.size(0), -1});
    const auto n = matrix.size(0), m = matrix.size(1);
    const auto rank = std::min<std::int64_t>({n, m, options.matrix_approximation_rank});
    const auto compressed = (n + m) * rank;
    before += n * m;
    if (static_cast<double>(compressed) * options.min_compression_rate <
        static_cast<double>(n * m)) {
      const std::vector<std::int64_t> shape{n, m};
      auto it = std::find(shapes.begin(), shapes.end(), shape);
      if (it == shapes.end()) {
        shapes.push_back(shape);
        by_shape.emplace_back();
        it = shapes.end() - 1;
      }
      by_shape[it - shapes.begin()].push_back({matrix, {}, {}, offset});
      plan.p_numel += n * rank;
      plan.q_numel += m * rank;
      after += compressed;
    } else {
      plan.uncompressed.push_back(grad);
      plan.uncompressed_offsets.push_back(offset);
      plan.uncompressed_numel += grad.numel();
      after += n * m;
    }
  }
  plan.fused = plan.fused && tiled == bucket.buffer.numel();
  for (auto& group : by_shape) {
    if (options.batch_tensors_with_same_shape) {
      plan.batches.push_back(std::move(group));
    } else {
      for (auto& matrix : group)
        plan.batches.push_back({std::move(matrix)});
    }
  }
  auto lock = Access::lock(state);
  Access::before(state) += before;
  Access::after(state) += after;
  return plan;
}

bool has_kernels(const torch::Tensor& matrix) {
  const auto type = matrix.scalar_type();
  // The loops of powersgd_kernels.h read host memory: CUDA tensors take the ATen path.
  return matrix.device().is_cpu() && (type == torch::kFloat || type == torch::kDouble) &&
         matrix.is_contiguous();
}

// out = matrix x factor (n x r) for one matrix. Rank 1 is a matrix-vector product: BLAS's gemv
// reads the matrix at memory speed, where a matrix product with one column (the bmm of PyTorch's
// hook) took about five times as long (libtorch 1.13 with OpenBLAS, one thread).
void multiply(torch::Tensor out, const torch::Tensor& matrix, const torch::Tensor& factor) {
  const auto type = matrix.scalar_type();
  if (type != torch::kFloat && type != torch::kDouble) {
    auto batch = out.unsqueeze(0);
    at::bmm_out(batch, matrix.unsqueeze(0), factor.unsqueeze(0));
  } else if (factor.size(1) == 1) {
    auto vector = out.view({out.size(0)});
    at::mv_out(vector, matrix, factor.view({factor.size(0)}));
  } else {
    at::mm_out(out, matrix, factor);
  }
}

// matrix = P Q^T; with `error` (a view of the error memory where the matrix lies) also
// error = matrix - P Q^T first, in the same pass (powersgd_kernels.h).
void decompress(Compressed& c, const torch::Tensor& error) {
  if (!has_kernels(c.matrix)) {
    auto batch = c.matrix.unsqueeze(0);
    at::bmm_out(batch, c.p.unsqueeze(0), c.q.t().unsqueeze(0));
    return;
  }
  const auto n = c.matrix.size(0), m = c.matrix.size(1), rank = c.p.size(1);
  const auto qt = c.q.t().contiguous();
  if (c.matrix.scalar_type() == torch::kFloat) {
    powersgd_detail::decompress<float>(
        c.matrix.data_ptr<float>(), error.defined() ? error.data_ptr<float>() + c.offset : nullptr,
        c.p.data_ptr<float>(), qt.data_ptr<float>(), n, m, rank);
  } else {
    powersgd_detail::decompress<double>(
        c.matrix.data_ptr<double>(),
        error.defined() ? error.data_ptr<double>() + c.offset : nullptr, c.p.data_ptr<double>(),
        qt.data_ptr<double>(), n, m, rank);
  }
}

BucketReduction powersgd_reduce(const std::shared_ptr<PowerSGDState>& state_ptr,
                                ProcessGroup& group, GradBucket& bucket) {
  PowerSGDState& state = *state_ptr;
  const auto& options = Access::options(state);
  torch::NoGradGuard no_grad;
  if (auto plain = plain_average_unless_compressing(state_ptr, group, bucket)) return *plain;
  torch::Tensor input = bucket.buffer;
  const std::size_t index = bucket.index;
  const double world = group.size();
  auto plan = std::make_shared<CompressionPlan>(plan_compression(state, bucket));
  torch::Tensor error;  // the bucket's error memory (add_error)
  if (options.use_error_feedback) error = add_error(state, index, input, plan->fused);

  const auto dtype = input.scalar_type();
  torch::Tensor p_memory, q_memory;
  bool randomize = false;
  {
    auto lock = Access::lock(state);
    auto& ps = Access::p(state);
    auto& qs = Access::q(state);
    if (!options.warm_start || ps.count(index) == 0) {
      randomize = true;
      ps[index] = torch::empty({plan->p_numel}, input.options());
      qs[index] = torch::empty({plan->q_numel}, input.options());
    }
    check_memory_size(ps[index], plan->p_numel, "P", index);
    check_memory_size(qs[index], plan->q_numel, "Q", index);
    p_memory = ps[index];
    q_memory = qs[index];
  }
  std::int64_t p_at = 0, q_at = 0;
  for (auto& batch : plan->batches) {
    const auto k = static_cast<std::int64_t>(batch.size());
    const auto n = batch[0].matrix.size(0), m = batch[0].matrix.size(1);
    const auto rank = std::min<std::int64_t>({n, m, options.matrix_approximation_rank});
    plan->p_batches.push_back(p_memory.narrow(0, p_at, k * n * rank).view({k, n, rank}));
    plan->q_batches.push_back(q_memory.narrow(0, q_at, k * m * rank).view({k, m, rank}));
    for (std::int64_t i = 0; i < k; ++i) {
      batch[i].p = plan->p_batches.back()[i];
      batch[i].q = plan->q_batches.back()[i];
    }
    p_at += k * n * rank;
    q_at += k * m * rank;
  }
  if (!randomize) {
    for (auto& q : plan->q_batches)
      powersgd_detail::orthogonalize(q, options.orthogonalization_epsilon);
  } else {
    at::Generator generator;
    {
      auto lock = Access::lock(state);
      generator = q_generator(state);
    }
    for (auto& q : plan->q_batches) {
      q.copy_(torch::randn(q.sizes(), generator, torch::TensorOptions().dtype(dtype)));
      powersgd_detail::orthogonalize(q, options.orthogonalization_epsilon);
    }
  }
  for (auto& batch : plan->batches) {
    for (auto& c : batch)
      multiply(c.p, c.matrix, c.q);
  }

  // One allreduce for the uncompressed tensors and every P (both sums).
  std::vector<torch::Tensor> pieces;
  for (const auto& t : plan->uncompressed)
    pieces.push_back(t.reshape({-1}));
  pieces.push_back(p_memory);
  auto first = std::make_shared<torch::Tensor>(torch::cat(pieces));
  const std::size_t elem = input.element_size();
  const std::size_t bytes = (first->numel() + plan->q_numel) * elem;
  {
    auto lock = Access::lock(state);
    Access::bytes(state) += bytes;
  }
  const double epsilon = options.orthogonalization_epsilon;
  auto work = allreduce_tensor(group, *first, ReduceOp::kSum);
  // The Q stage runs in finish, on the autograd thread, in bucket order: issued from a
  // completion callback (Work::and_then) it could interleave with the next bucket's first
  // allreduce differently on different ranks (measured: a collective mismatch on the mlp).
  const bool is_last = bucket.is_last;
  auto finish = [state_ptr, plan, first, p_memory, q_memory, input, error, index, world, epsilon,
                 is_last, &group]() mutable {
    torch::NoGradGuard no_grad;
    PowerSGDState& state = *state_ptr;
    // Fused, the error of each tensor is written as its result is: the error-corrected gradient
    // (still in the bucket) minus the average.
    const bool fused_error = error.defined() && plan->fused;
    std::int64_t at = 0;
    for (std::size_t k = 0; k < plan->uncompressed.size(); ++k) {
      auto& t = plan->uncompressed[k];
      auto average = first->narrow(0, at, t.numel()).div_(world).view_as(t);
      if (fused_error) {
        auto t_error = error.narrow(0, plan->uncompressed_offsets[k], t.numel()).view_as(t);
        at::sub_out(t_error, t, average);
      }
      t.copy_(average);
      at += t.numel();
    }
    p_memory.copy_(first->narrow(0, at, p_memory.numel()));
    if (!plan->batches.empty()) {
      for (auto& p : plan->p_batches)
        powersgd_detail::orthogonalize(p, epsilon);
      for (auto& batch : plan->batches) {
        for (auto& c : batch)
          multiply(c.q, c.matrix.t(), c.p);
      }
      allreduce_tensor(group, q_memory, ReduceOp::kSum)->wait();
    }
    q_memory.div_(world);
    for (auto& batch : plan->batches) {
      for (auto& c : batch)
        decompress(c, fused_error ? error : torch::Tensor());
    }
    auto lock = Access::lock(state);
    const auto& options = Access::options(state);
    if (error.defined() && !plan->fused) error.sub_(input);  // the error memory (add_error)
    if (!options.warm_start) {
      Access::p(state).erase(index);
      Access::q(state).erase(index);
    }
    if (is_last) ++Access::iter(state);
  };
  return {std::move(work), std::move(finish), bytes};
}

BucketReduction batched_powersgd_reduce(const std::shared_ptr<PowerSGDState>& state_ptr,
                                        ProcessGroup& group, GradBucket& bucket) {
  PowerSGDState& state = *state_ptr;
  const auto& options = Access::options(state);
  torch::NoGradGuard no_grad;
  if (auto plain = plain_average_unless_compressing(state_ptr, group, bucket)) return *plain;
  torch::Tensor input = bucket.buffer;
  const std::size_t index = bucket.index;
  const double world = group.size();
  const auto total = input.numel();
  const auto side = static_cast<std::int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  // PyTorch uses the configured rank here; a rank above the side would fail its assertion.
  const auto rank = std::min<std::int64_t>(side, options.matrix_approximation_rank);
  {
    auto lock = Access::lock(state);
    Access::before(state) += total;
    Access::after(state) += side * options.matrix_approximation_rank * 2;
  }
  // PyTorch resizes the bucket in place; the reducer's bucket is fixed, so pad a copy.
  auto padded = torch::zeros({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);
  torch::Tensor padded_copy;
  if (options.use_error_feedback) padded_copy = apply_error_feedback(state, index, padded);
  auto matrix = padded.view({side, side});
  torch::Tensor p, q;
  {
    auto lock = Access::lock(state);
    auto& ps = Access::p(state);
    auto& qs = Access::q(state);
    if (!options.warm_start || ps.count(index) == 0) {
      ps[index] = torch::empty({side, rank}, input.options());
      auto generator = q_generator(state);
      qs[index] =
          torch::randn({side, rank}, generator, torch::TensorOptions().dtype(input.dtype()));
    }
    check_memory_size(ps[index], side * rank, "P", index);
    check_memory_size(qs[index], side * rank, "Q", index);
    p = ps[index];
    q = qs[index];
  }
  powersgd_detail::orthogonalize(q.unsqueeze(0), 0);
  at::matmul_out(p, matrix, q);
  const std::size_t bytes = 2 * static_cast<std::size_t>(side * rank) * input.element_size();
  {
    auto lock = Access::lock(state);
    Access::bytes(state) += bytes;
  }
  auto work = allreduce_tensor(group, p, ReduceOp::kSum);
  // The Q stage in finish, in bucket order (see powersgd_reduce).
  const bool is_last = bucket.is_last;
  auto finish = [state_ptr, p, q, matrix, padded, padded_copy, input, total, index, world, is_last,
                 &group]() mutable {
    torch::NoGradGuard no_grad;
    PowerSGDState& state = *state_ptr;
    powersgd_detail::orthogonalize(p.unsqueeze(0), 0);
    at::matmul_out(q, matrix.t(), p);
    allreduce_tensor(group, q, ReduceOp::kSum)->wait();
    q.div_(world);
    at::matmul_out(matrix, p, q.t());
    input.copy_(padded.narrow(0, 0, total));
    auto lock = Access::lock(state);
    const auto& options = Access::options(state);
    if (options.use_error_feedback) padded_copy.sub_(padded);  // the error memory
    if (!options.warm_start) {
      Access::p(state).erase(index);
      Access::q(state).erase(index);
    }
    if (is_last) ++Access::iter(state);
  };
  return {std::move(work), std::move(finish), bytes};
}

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
    return powersgd_reduce(state, group, bucket);
  };
}

CommHook batched_powersgd_hook(std::shared_ptr<PowerSGDState> state) {
  state = checked(std::move(state), "batched_powersgd_hook");
  return [state](ProcessGroup& group, GradBucket& bucket) {
    return batched_powersgd_reduce(state, group, bucket);
  };
}

}  // namespace ddp
