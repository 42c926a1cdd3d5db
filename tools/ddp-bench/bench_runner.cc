#include "ddp-bench/bench_runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::bench {
namespace {

// Cache-line (and AVX-512) alignment, so the engine's kernels see the same alignment as
// framework tensors would give them.
constexpr std::align_val_t kAlignment{64};

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

}  // namespace

void BenchRunner::AlignedFree::operator()(std::byte* p) const {
  ::operator delete[](p, kAlignment);
}

BenchRunner::Buffer BenchRunner::allocate(std::size_t bytes) {
  auto* p = static_cast<std::byte*>(::operator new[](std::max<std::size_t>(bytes, 64), kAlignment));
  // Touch every page now, so page faults never land in a timed iteration.
  std::memset(p, 0, std::max<std::size_t>(bytes, 64));
  return Buffer(p);
}

BenchRunner::BenchRunner(ProcessGroup& group, const BenchOptions& options)
    : group_(group), options_(options) {
  for (Collective c : options.collectives) {
    for (std::size_t bytes : options.byte_sizes()) {
      const Layout layout = layout_for(c, bytes, options.dtype, group.size());
      capacity_bytes_ = std::max({capacity_bytes_, layout.send_count * dtype_size(options.dtype),
                                  layout.recv_count * dtype_size(options.dtype)});
    }
  }
  send_ = allocate(capacity_bytes_);
  recv_ = allocate(capacity_bytes_);
  if (options.shared_buffer) {
    std::string why;
    shared_recv_ = group.allocate_shared_buffer(std::max<std::size_t>(capacity_bytes_, 64), &why);
    if (shared_recv_) {
      shared_send_ = group.allocate_shared_buffer(std::max<std::size_t>(capacity_bytes_, 64), &why);
    }
    if (!shared_recv_ || !shared_send_) {
      throw std::invalid_argument(
          "ddp-bench: --shared-buffer: the group made no shared buffer (" +
          (why.empty() ? std::string(group.backend()) + " backend, or not every rank on one host"
                       : why) +
          "); drop --shared-buffer");
    }
  }
}

BenchRunner::~BenchRunner() = default;

BenchRow BenchRunner::run(Collective collective, std::size_t requested_bytes) {
  const int rank = group_.rank();
  const Layout layout = layout_for(collective, requested_bytes, options_.dtype, group_.size());
  const CheckSpec spec{.collective = collective,
                       .dtype = options_.dtype,
                       .reduce_op = options_.reduce_op,
                       .world_size = group_.size(),
                       .root = options_.root};
  // --shared-buffer: a reduce-scatter's zero-copy path reads its input from the shared buffer.
  std::byte* send = shared_send_ && collective == Collective::kReduceScatter
                        ? static_cast<std::byte*>(shared_send_.get())
                        : send_.get();
  std::byte* recv = shared_recv_ ? static_cast<std::byte*>(shared_recv_.get()) : recv_.get();

  // Broadcast works in place on `recv`: the root's holds its input for the whole run, the others'
  // are poisoned before each checked iteration (like every other receive buffer). An in-place
  // allreduce gets its input (kept in `send`) back in `recv` before every iteration.
  const bool in_place = collective == Collective::kBroadcast;
  const bool allreduce_in_place =
      collective == Collective::kAllreduce && (options_.in_place || options_.shared_buffer);
  fill_input(spec, rank, in_place ? recv : send, in_place ? layout.total_count : layout.send_count);
  const auto prepare = [&] {
    if (allreduce_in_place) {
      std::memcpy(recv, send, layout.send_count * dtype_size(spec.dtype));
    } else if (options_.check && !(in_place && rank == options_.root)) {
      poison(spec.dtype, recv, layout.recv_count);
    }
  };

  const auto issue = [&]() -> std::shared_ptr<Work> {
    const DType dtype = spec.dtype;
    const ReduceOp op = spec.reduce_op;
    const int root = spec.root;
    const CallOptions call{.blocking = !options_.async};
    switch (collective) {
      case Collective::kAllreduce:
        return group_.allreduce(allreduce_in_place ? recv : send, recv, layout.total_count, dtype,
                                op, call);
      case Collective::kBroadcast:
        return group_.broadcast(recv, layout.total_count, dtype, root, call);
      case Collective::kReduce:
        return group_.reduce(send, recv, layout.total_count, dtype, op, root, call);
      case Collective::kAllgather:
        return group_.allgather(send, recv, layout.block_count, dtype, call);
      case Collective::kGather:
        return group_.gather(send, recv, layout.block_count, dtype, root, call);
      case Collective::kScatter:
        return group_.scatter(send, recv, layout.block_count, dtype, root, call);
      case Collective::kReduceScatter:
        return group_.reduce_scatter(send, recv, layout.block_count, dtype, op, call);
      case Collective::kAlltoall:
        return group_.alltoall(send, recv, layout.block_count, dtype, call);
      case Collective::kBarrier:
        return group_.barrier(call);
      case Collective::kSend: {
        // Both posted before either is waited for: the pattern that needs sends and receives to
        // progress independently.
        const int n = group_.size();
        auto s = group_.send(send, layout.total_count, dtype, (rank + 1) % n, 0);
        auto r = group_.recv(recv, layout.total_count, dtype, (rank + n - 1) % n, 0);
        s->wait();
        return r;
      }
    }
    throw std::invalid_argument("ddp-bench: unknown collective");
  };

  std::vector<double> times_us(static_cast<std::size_t>(options_.iters));
  std::uint64_t wrong = 0;
  for (int it = 0; it < options_.warmup + options_.iters; ++it) {
    prepare();
    group_.barrier({.blocking = true});
    const auto start = std::chrono::steady_clock::now();
    issue()->wait();
    const auto stop = std::chrono::steady_clock::now();
    if (it >= options_.warmup) {
      times_us[static_cast<std::size_t>(it - options_.warmup)] =
          std::chrono::duration<double, std::micro>(stop - start).count();
    }
    if (options_.check) wrong += count_wrong(spec, rank, recv, layout);
  }

  // Outside the timed loop: the slowest rank's time per iteration, and the wrong count of all.
  group_.allreduce(times_us.data(), times_us.size(), DType::kFloat64, ReduceOp::kMax)->wait();
  auto wrong_total = static_cast<std::int64_t>(wrong);
  if (options_.check) group_.allreduce(&wrong_total, 1, DType::kInt64, ReduceOp::kSum)->wait();

  BenchRow row;
  row.collective = collective;
  row.layout = layout;
  row.dtype = spec.dtype;
  row.reduce_op = spec.reduce_op;
  row.root = spec.root;
  row.world_size = group_.size();
  row.backend = std::string(group_.backend());
  row.iters = options_.iters;
  row.warmup = options_.warmup;
  row.blocking = !options_.async;
  row.time_us = median(times_us);
  row.time_min_us = *std::min_element(times_us.begin(), times_us.end());
  row.time_max_us = *std::max_element(times_us.begin(), times_us.end());
  if (row.time_us > 0) {
    row.algbw_gbps = static_cast<double>(layout.bytes) / (row.time_us * 1e-6) / 1e9;
  }
  row.busbw_gbps = row.algbw_gbps * bus_bandwidth_factor(collective, group_.size());
  if (options_.check) row.wrong = static_cast<std::uint64_t>(wrong_total);
  return row;
}

}  // namespace ddp::bench
