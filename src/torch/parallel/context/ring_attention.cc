// Ring attention (ring_attention.h): causal attention over a sequence split across a cp group.
#include "ddp/torch/parallel/context/ring_attention.h"

#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "torch/core/autograd_group.h"

namespace ddp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kMinusInfinity = -std::numeric_limits<double>::infinity();

void check_chunks(std::int64_t sequence, int cp_size, const char* call) {
  if (sequence < 2 * cp_size || sequence % (2 * cp_size) != 0) {
    throw ConfigError(fmt::format(
        "{}: a sequence of {} does not split into 2 x cp = {} equal chunks (rank r holds chunks "
        "r and 2 cp - 1 - r); use a sequence length that is a multiple of {}",
        call, sequence, 2 * cp_size, 2 * cp_size));
  }
}

struct Ring {
  ProcessGroup* group = nullptr;  // null: one rank
  int rank = 0, size = 1;
  int next() const { return (rank + 1) % size; }
  int previous() const { return (rank + size - 1) % size; }
  // The global chunk index of local chunk `local` (0 or 1) of rank `owner`.
  int chunk(int owner, int local) const { return local == 0 ? owner : 2 * size - 1 - owner; }
};

// Starts passing `mine` to the next rank and receiving the previous rank's into `theirs`.
std::vector<std::shared_ptr<Work>> pass_on(const Ring& ring, const std::vector<torch::Tensor>& mine,
                                           std::vector<torch::Tensor>& theirs, int first_tag) {
  std::vector<P2POp> ops;
  theirs.clear();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    theirs.push_back(torch::empty_like(mine[i]));
    const int tag = first_tag + static_cast<int>(i);
    ops.push_back({P2POp::Kind::kIsend, mine[i], ring.next(), *ring.group, tag});
    ops.push_back({P2POp::Kind::kIrecv, theirs.back(), ring.previous(), *ring.group, tag});
  }
  return batch_isend_irecv(ops);
}

void wait_all(const std::vector<std::shared_ptr<Work>>& works) {
  for (const auto& w : works)
    w->wait();
}

// The scaled scores of query chunk q against key chunk k, future positions -inf when they are
// the same chunk; undefined when the key chunk is entirely in the query chunk's future.
torch::Tensor scores(const torch::Tensor& q, const torch::Tensor& k, int query_chunk, int key_chunk,
                     double scale) {
  if (key_chunk > query_chunk) return {};
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (key_chunk == query_chunk) {
    const auto c = q.size(-2);
    s = s.masked_fill(torch::ones({c, c}, torch::kBool).triu(1), kMinusInfinity);
  }
  return s;
}

std::array<torch::Tensor, 2> halves(const torch::Tensor& t) {
  const auto c = t.size(2) / 2;
  return {t.narrow(2, 0, c), t.narrow(2, c, c)};
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const std::shared_ptr<ProcessGroup>& cp) {
    const Ring ring{cp.get(), cp ? cp->rank() : 0, cp ? cp->size() : 1};
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto qs = halves(q);
    std::array<torch::Tensor, 2> running_max, running_sum, accumulated;
    for (int a = 0; a < 2; ++a) {
      running_max[a] = torch::full_like(qs[a].narrow(-1, 0, 1), kMinusInfinity);
      running_sum[a] = torch::zeros_like(running_max[a]);
      accumulated[a] = torch::zeros_like(qs[a]);
    }
    std::vector<torch::Tensor> block{k.contiguous(), v.contiguous()}, arriving;
    for (int step = 0; step < ring.size; ++step) {
      const int owner = (ring.rank - step + ring.size) % ring.size;
      // The next block travels while this one is computed on.
      std::vector<std::shared_ptr<Work>> moving;
      if (step + 1 < ring.size) moving = pass_on(ring, block, arriving, kRingAttentionTag);
      const auto ks = halves(block[0]), vs = halves(block[1]);
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 2; ++b) {
          const auto s =
              scores(qs[a], ks[b], ring.chunk(ring.rank, a), ring.chunk(owner, b), scale);
          if (!s.defined()) continue;
          const auto new_max = torch::maximum(running_max[a], std::get<0>(s.max(-1, true)));
          const auto p = torch::exp(s - new_max);
          const auto rescale = torch::exp(running_max[a] - new_max);
          running_sum[a] = running_sum[a] * rescale + p.sum(-1, true);
          accumulated[a] = accumulated[a] * rescale + torch::matmul(p, vs[b]);
          running_max[a] = new_max;
        }
      }
      wait_all(moving);
      if (step + 1 < ring.size) block = std::move(arriving);
    }
    const auto out =
        torch::cat({accumulated[0] / running_sum[0], accumulated[1] / running_sum[1]}, 2);
    const auto log_sum_exp = torch::cat(
        {running_max[0] + torch::log(running_sum[0]), running_max[1] + torch::log(running_sum[1])},
        2);
    ctx->save_for_backward({q, k, v, out, log_sum_exp});
    detail::save_group(ctx, "cp", cp);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto cp = detail::saved_group(ctx, "cp");
    const Ring ring{cp.get(), cp ? cp->rank() : 0, cp ? cp->size() : 1};
    const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
    const auto grad_out = grads[0].contiguous();
    const auto qs = halves(q), dos = halves(grad_out), lses = halves(saved[4]);
    // D = rowsum(dO * O): the softmax's backward term.
    const auto ds_terms = halves((grad_out * saved[3]).sum(-1, true));
    auto grad_q = torch::zeros_like(q);
    const auto dqs = halves(grad_q);
    std::vector<torch::Tensor> block{saved[1].contiguous(), saved[2].contiguous()}, arriving;
    std::vector<torch::Tensor> block_grads{torch::zeros_like(block[0]),
                                           torch::zeros_like(block[1])},
        arriving_grads;
    for (int step = 0; step < ring.size; ++step) {
      const int owner = (ring.rank - step + ring.size) % ring.size;
      // The keys and values go on while this block is computed on (not after the last step:
      // only the gradients still have a pass to make, home).
      const bool more_steps = step + 1 < ring.size;
      std::vector<std::shared_ptr<Work>> moving;
      if (more_steps) moving = pass_on(ring, block, arriving, kRingAttentionTag);
      const auto ks = halves(block[0]), vs = halves(block[1]);
      const auto dks = halves(block_grads[0]), dvs = halves(block_grads[1]);
      for (int a = 0; a < 2; ++a) {
        for (int b = 0; b < 2; ++b) {
          const auto s =
              scores(qs[a], ks[b], ring.chunk(ring.rank, a), ring.chunk(owner, b), scale);
          if (!s.defined()) continue;
          const auto p = torch::exp(s - lses[a]);
          dvs[b].add_(torch::matmul(p.transpose(-2, -1), dos[a]));
          const auto dp = torch::matmul(dos[a], vs[b].transpose(-2, -1));
          const auto ds = p * (dp - ds_terms[a]) * scale;
          dqs[a].add_(torch::matmul(ds, ks[b]));
          dks[b].add_(torch::matmul(ds.transpose(-2, -1), qs[a]));
        }
      }
      // The gradients travel with their block, after this rank's part is in them.
      if (ring.size > 1) {
        auto more = pass_on(ring, block_grads, arriving_grads, kRingAttentionTag + 2);
        moving.insert(moving.end(), more.begin(), more.end());
        wait_all(moving);
        if (more_steps) block = std::move(arriving);
        block_grads = std::move(arriving_grads);
      }
    }
    // After size passes every block is home, its gradients whole.
    return {grad_q, block_grads[0], block_grads[1], torch::Tensor()};
  }
};

}  // namespace

torch::Tensor context_parallel_positions(std::int64_t sequence, const ProcessGroup& cp) {
  check_chunks(sequence, cp.size(), "context_parallel_positions");
  const auto c = sequence / (2 * cp.size());
  const auto r = static_cast<std::int64_t>(cp.rank());
  return torch::cat(
      {torch::arange(r * c, (r + 1) * c, torch::kInt64),
       torch::arange((2 * cp.size() - 1 - r) * c, (2 * cp.size() - r) * c, torch::kInt64)});
}

torch::Tensor context_parallel_shard(const torch::Tensor& full, std::int64_t dim,
                                     const ProcessGroup& cp) {
  if (dim < 0) dim += full.dim();
  if (dim < 0 || dim >= full.dim()) {
    throw ConfigError(
        fmt::format("context_parallel_shard: dim {} is outside a tensor of {} "
                    "dimensions",
                    dim, full.dim()));
  }
  return full.index_select(dim, context_parallel_positions(full.size(dim), cp));
}

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const std::shared_ptr<ProcessGroup>& cp) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes()) {
    throw ConfigError(fmt::format(
        "ring_attention: q, k and v must be [batch, heads, local sequence, head_dim] of one shape; "
        "got [{}], [{}] and [{}]",
        fmt::join(q.sizes(), ", "), fmt::join(k.sizes(), ", "), fmt::join(v.sizes(), ", ")));
  }
  const int size = cp ? cp->size() : 1;
  if (q.size(2) % 2 != 0) {
    throw ConfigError(fmt::format(
        "ring_attention: this rank holds {} positions, not two equal chunks of the sequence "
        "(context_parallel_shard of a sequence that divides into 2 x cp = {} chunks)",
        q.size(2), 2 * size));
  }
  return RingAttention::apply(q, k, v, cp);
}

}  // namespace ddp
