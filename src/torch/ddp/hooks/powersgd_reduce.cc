// PowerSGD: powersgd_hook's reduction of a bucket: the compression plan (matrices grouped by
// shape), the error feedback, P's allreduce, and the Q stage and decompression in finish.
#include <algorithm>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/torch/core/tensor_collectives.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "torch/ddp/hooks/powersgd_internal.h"
#include "torch/ddp/hooks/powersgd_kernels.h"

namespace ddp::powersgd_detail {
namespace {

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

}  // namespace

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

}  // namespace ddp::powersgd_detail
