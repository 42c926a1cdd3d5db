// ShmDomain's collectives other than allreduce, over the chunked pipeline
// (shm_collectives_internal.h): reduce, broadcast, allgather, reduce_scatter and barrier.
#include "comm/ring/shm/shm_domain.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>

#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_collectives_internal.h"
#include "comm/ring/shm/shm_domain_internal.h"

namespace ddp::comm::shm {

void ShmDomain::reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                       int root, const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kReduce, count, dtype, root, size_);
  check_buffer(send, count, "send");
  if (rank_ == root) check_buffer(recv, count, "recv");
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    // Nobody else reads this rank's slice of its input, so it stays in `send` (saves 1/N of the
    // copy-in) and the reduction reads it from there.
    auto copy_in_but_own_slice = [&](std::size_t first, std::size_t len, int p) {
      const auto [begin, n] = slice_of(len, rank_, size_, esize);
      std::byte* slot = input_slot(rank_, p);
      std::memcpy(slot, in + first * esize, begin * esize);
      std::memcpy(slot + (begin + n) * esize, in + (first + begin + n) * esize,
                  (len - begin - n) * esize);
    };
    auto reduce_own_slice = [&](std::size_t first, std::size_t len, int p) {
      // Plain variables, not a structured binding: the lambda below captures them (clang < 16
      // cannot capture bindings).
      const auto slice = slice_of(len, rank_, size_, esize);
      const std::size_t begin = slice.first, n = slice.second;
      const std::size_t offset = begin * esize;
      reduce_in_rank_order(
          result_slot(p) + offset,
          [&](int r) {
            return r == rank_ ? in + (first + begin) * esize : input_slot(r, p) + offset;
          },
          n, dtype, op, size_);
    };
    run_chunked(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) { copy_in_but_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) { reduce_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ == root) std::memcpy(out + first * esize, result_slot(p), len * esize);
        });
  });
}

void ShmDomain::broadcast(void* buf, std::size_t count, DType dtype, int root,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kBroadcast, count, dtype, root, size_);
  check_buffer(buf, count, "buf");
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    auto* data = static_cast<std::byte*>(buf);
    run_chunked(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ == root) std::memcpy(input_slot(rank_, p), data + first * esize, len * esize);
        },
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ != root) std::memcpy(data + first * esize, input_slot(root, p), len * esize);
        },
        [](std::size_t, std::size_t, int) {});
  });
}

void ShmDomain::allgather(const void* send, void* recv, std::size_t count_per_rank, DType dtype,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kAllgather, count_per_rank, dtype, -1, size_);
  check_buffer(send, count_per_rank, "send");
  check_buffer(recv, count_per_rank, "recv");
  const std::size_t esize = dtype_size(dtype);
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  // Zero-copy only where no peer writes what this rank reads: send apart from recv, or exactly
  // this rank's block of it (in place).
  const std::size_t block = count_per_rank * esize;
  const std::size_t total = block * static_cast<std::size_t>(size_);
  const bool apart = in + block <= out || out + total <= in;
  const bool own_block = in == out + static_cast<std::size_t>(rank_) * block;
  std::size_t shared_offset = 0;
  std::shared_ptr<const SharedBufferMapping> shared;
  if (count_per_rank > 0 && (apart || own_block)) {
    shared = shared_buffers_->find(out, total, rank_, shared_offset);
  }
  guarded(header, deadline, [&] {
    name_shared_buffer(shared.get(), shared_offset);
    run_chunked_or(
        count_per_rank, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) {
          std::memcpy(input_slot(rank_, p), in + first * esize, len * esize);
        },
        [&](std::size_t first, std::size_t len, int p) {
          for (int r = 0; r < size_; ++r) {
            std::memmove(out + (r * count_per_rank + first) * esize, input_slot(r, p), len * esize);
          }
        },
        [](std::size_t, std::size_t, int) {},
        [&] {
          return shared != nullptr &&
                 try_zero_copy_allgather(*shared, shared_offset, in, count_per_rank, dtype);
        });
  });
}

// Every rank's copy of recv is mapped here: this rank's block goes straight into each (read once,
// written size() times, against the copying path's copy in and every rank reading every slot).
// Each rank writes only its own block of any copy, and no rank reads its result before it has
// seen every rank's B_0.
bool ShmDomain::try_zero_copy_allgather(const SharedBufferMapping& shared, std::size_t offset,
                                        const std::byte* send, std::size_t count_per_rank,
                                        DType dtype) {
  if (!all_named(shared, offset)) return false;
  const std::size_t block = count_per_rank * dtype_size(dtype);
  const std::size_t at = offset + static_cast<std::size_t>(rank_) * block;
  for (int r = 0; r < size_; ++r) {
    std::byte* to = shared.bases[static_cast<std::size_t>(r)] + at;
    if (to != send) std::memcpy(to, send, block);  // in place: this rank's own copy has it
  }
  shared_buffer_allgathers_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ShmDomain::reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, ReduceOp op, const OpHeader& header,
                               Deadline deadline) {
  check_header(header, Collective::kReduceScatter, count_per_rank, dtype, -1, size_);
  check_buffer(send, count_per_rank, "send");
  check_buffer(recv, count_per_rank, "recv");
  const std::size_t esize = dtype_size(dtype);
  // A chunk carries `len` elements of each of the size_ blocks, so it is 1/size_ as long.
  const std::size_t chunk =
      std::max<std::size_t>(1, options_.slot_bytes / (esize * static_cast<std::size_t>(size_)));
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::size_t shared_offset = 0;
  std::shared_ptr<const SharedBufferMapping> shared;
  if (count_per_rank > 0) {
    shared = shared_buffers_->find(in, count_per_rank * esize * static_cast<std::size_t>(size_),
                                   rank_, shared_offset);
  }
  guarded(header, deadline, [&] {
    name_shared_buffer(shared.get(), shared_offset);
    run_chunked_or(
        count_per_rank, chunk,
        [&](std::size_t first, std::size_t len, int p) {
          std::byte* slot = input_slot(rank_, p);
          for (int block = 0; block < size_; ++block) {
            std::memcpy(slot + block * len * esize, in + (block * count_per_rank + first) * esize,
                        len * esize);
          }
        },
        [&](std::size_t first, std::size_t len, int p) {
          const std::size_t offset = rank_ * len * esize;
          reduce_in_rank_order(
              out + first * esize, [&](int r) { return input_slot(r, p) + offset; }, len, dtype, op,
              size_);
        },
        [](std::size_t, std::size_t, int) {},
        [&] {
          return shared != nullptr && try_zero_copy_reduce_scatter(*shared, shared_offset, out,
                                                                   count_per_rank, dtype, op);
        });
  });
}

// Every rank's copy of send is mapped here: this rank's block of each is reduced straight into
// recv, in rank order (the copying path's bits), piece by piece so that recv stays in the cache
// between the passes. Each copy is read once, against the copying path's copy in and read back.
// No rank changes its send before it has seen every rank's B_0.
bool ShmDomain::try_zero_copy_reduce_scatter(const SharedBufferMapping& shared, std::size_t offset,
                                             std::byte* recv, std::size_t count_per_rank,
                                             DType dtype, ReduceOp op) {
  if (!all_named(shared, offset)) return false;
  const std::size_t esize = dtype_size(dtype);
  const std::size_t at = offset + static_cast<std::size_t>(rank_) * count_per_rank * esize;
  const std::size_t piece = std::max<std::size_t>(1, kZeroCopyPieceBytes / esize);
  for (std::size_t first = 0; first < count_per_rank; first += piece) {
    const std::size_t m = std::min(piece, count_per_rank - first);
    reduce_in_rank_order(
        recv + first * esize,
        [&](int r) { return shared.bases[static_cast<std::size_t>(r)] + at + first * esize; }, m,
        dtype, op, size_);
  }
  shared_buffer_reduce_scatters_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ShmDomain::barrier(const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kBarrier, header.count, DType::kFloat32, -1, size_);
  guarded(header, deadline, [&] {
    const int parity = static_cast<int>(calls_ & 1);
    controls(segment_)[rank_].headers[parity] = header_;
    publish();
    arrive();
    announce_and_check();
  });
}

}  // namespace ddp::comm::shm
