// ShmDomain's allreduce over the chunked pipeline (shm_collectives_internal.h): contiguous or in
// segments, small calls in one step, zero-copy over shared buffers; the call checks.
#include "comm/ring/shm/shm_domain.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_collectives_internal.h"
#include "comm/ring/shm/shm_domain_internal.h"
#include "ddp/error.h"

namespace ddp::comm::shm {

void check_header(const OpHeader& header, Collective kind, std::size_t count, DType dtype, int root,
                  int size) {
  if (header.kind != kind || header.count != count ||
      (kind != Collective::kBarrier && header.dtype != static_cast<std::uint8_t>(dtype))) {
    throw ConfigError(fmt::format("ShmDomain: the header {} does not describe the call {}({} x {})",
                                  describe(header), to_string(kind), to_string(dtype), count));
  }
  const bool rooted = kind == Collective::kBroadcast || kind == Collective::kReduce;
  if (root >= size || (rooted && root < 0)) {
    throw ConfigError(
        fmt::format("ShmDomain: root {} is not a rank of a group of size {}", root, size));
  }
}

void check_buffer(const void* p, std::size_t count, const char* what) {
  if (p == nullptr && count != 0) {
    throw ConfigError(fmt::format("ShmDomain: {} is null for {} elements", what, count));
  }
}

// A buffer as the allreduce sees it: one contiguous range, or the segments of allreduce_segments
// one after the other. for_each(first, n, fn) calls fn(piece, at, len) for each contiguous piece
// of elements [first, first + n): `piece` points at element first + at, `len` elements long.
class ShmDomain::Pieces {
 public:
  // One contiguous range: no allocation (this is on the path of every allreduce).
  Pieces(const void* data, std::size_t count, std::size_t element_bytes)
      : element_bytes_(element_bytes),
        single_{const_cast<void*>(data), count},
        single_end_(count),
        segments_(&single_, 1),
        ends_(&single_end_, 1) {}
  Pieces(std::span<const BufferSegment> segments, std::size_t element_bytes)
      : element_bytes_(element_bytes), segments_(segments) {
    owned_ends_.reserve(segments.size());
    std::size_t end = 0;
    for (const auto& segment : segments) {
      end += segment.count;
      owned_ends_.push_back(end);
    }
    ends_ = owned_ends_;
  }
  Pieces(const Pieces&) = delete;
  Pieces& operator=(const Pieces&) = delete;

  template <typename Fn>
  void for_each(std::size_t first, std::size_t n, Fn&& fn) const {
    if (n == 0) return;
    // The first segment that ends after `first` (empty segments are passed over).
    auto k = static_cast<std::size_t>(std::upper_bound(ends_.begin(), ends_.end(), first) -
                                      ends_.begin());
    std::size_t at = 0;
    while (at < n) {
      const std::size_t begin = ends_[k] - segments_[k].count;
      const std::size_t offset = first + at - begin;
      const std::size_t len = std::min(n - at, segments_[k].count - offset);
      if (len > 0) {
        fn(static_cast<std::byte*>(segments_[k].data) + offset * element_bytes_, at, len);
      }
      at += len;
      ++k;
    }
  }

 private:
  std::size_t element_bytes_;
  BufferSegment single_{};
  std::size_t single_end_ = 0;
  std::vector<std::size_t> owned_ends_;
  std::span<const BufferSegment> segments_;
  std::span<const std::size_t> ends_;  // element index after each segment
};

void ShmDomain::run_small_allreduce(const Pieces& in, const Pieces& out, std::size_t count,
                                    DType dtype, ReduceOp op) {
  const int parity = static_cast<int>(calls_ & 1);
  const std::size_t esize = dtype_size(dtype);
  controls(segment_)[rank_].headers[parity] = header_;
  std::byte* mine = small_slot(rank_, parity);
  in.for_each(0, count, [&](const std::byte* piece, std::size_t at, std::size_t len) {
    std::memcpy(mine + at * esize, piece, len * esize);
  });
  publish();
  arrive();
  announce_and_check();
  out.for_each(0, count, [&](std::byte* piece, std::size_t at, std::size_t len) {
    reduce_in_rank_order(
        piece, [&](int r) { return small_slot(r, parity) + at * esize; }, len, dtype, op, size_);
  });
}

void ShmDomain::allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kAllreduce, count, dtype, -1, size_);
  check_buffer(send, count, "send");
  check_buffer(recv, count, "recv");
  const std::size_t esize = dtype_size(dtype);
  std::size_t offset = 0;
  std::shared_ptr<const SharedBufferMapping> shared;
  if (send == recv && count * esize > options_.small_bytes) {
    shared = shared_buffers_->find(recv, count * esize, rank_, offset);
  }
  run_allreduce(Pieces(send, count, esize), Pieces(recv, count, esize), count, dtype, op, header,
                deadline, shared.get(), offset);
}

void ShmDomain::allreduce_segments(std::span<const BufferSegment> segments, DType dtype,
                                   ReduceOp op, const OpHeader& header, Deadline deadline) {
  std::size_t count = 0;
  for (const auto& segment : segments) {
    check_buffer(segment.data, segment.count, "a segment");
    count += segment.count;
  }
  check_header(header, Collective::kAllreduce, count, dtype, -1, size_);
  const Pieces buffer(segments, dtype_size(dtype));
  run_allreduce(buffer, buffer, count, dtype, op, header, deadline);
}

void ShmDomain::name_shared_buffer(const SharedBufferMapping* shared, std::size_t offset) {
  RankControl& mine = controls(segment_)[rank_];
  const int parity = static_cast<int>(calls_ & 1);
  mine.shared_buffer[parity] = shared != nullptr ? shared->id : 0;
  mine.shared_offset[parity] = shared != nullptr ? offset : 0;
}

bool ShmDomain::all_named(const SharedBufferMapping& shared, std::size_t offset) const {
  const int parity = static_cast<int>(calls_ & 1);
  for (int r = 0; r < size_; ++r) {
    const RankControl& control = controls(segment_)[r];
    if (control.shared_buffer[parity] != shared.id || control.shared_offset[parity] != offset) {
      return false;
    }
  }
  return true;
}

// Every rank's copy of the buffer is mapped here, so rank r reduces slice r of the whole call
// from all of them (in rank order: the copying path's bits) into a cache-sized scratch and writes
// it into every copy. Each element is read once and written once per rank, against the copying
// path's copy in, reduce, and copy out through the segment. Only rank r touches slice r of any
// copy until B_0, and no rank reads its own buffer before it has seen every B_0.
bool ShmDomain::try_zero_copy_allreduce(const SharedBufferMapping& shared, std::size_t offset,
                                        std::size_t count, DType dtype, ReduceOp op) {
  if (!all_named(shared, offset)) return false;
  const std::size_t esize = dtype_size(dtype);
  const auto [begin, n] = slice_of(count, rank_, size_, esize);
  const std::size_t piece = std::max<std::size_t>(1, kZeroCopyPieceBytes / esize);
  if (zero_copy_scratch_.size() < piece * esize) zero_copy_scratch_.resize(piece * esize);
  std::byte* scratch = zero_copy_scratch_.data();
  for (std::size_t at = 0; at < n; at += piece) {
    const std::size_t m = std::min(piece, n - at);
    const std::size_t byte_offset = offset + (begin + at) * esize;
    reduce_in_rank_order(
        scratch, [&](int r) { return shared.bases[static_cast<std::size_t>(r)] + byte_offset; }, m,
        dtype, op, size_);
    for (int r = 0; r < size_; ++r) {
      std::memcpy(shared.bases[static_cast<std::size_t>(r)] + byte_offset, scratch, m * esize);
    }
  }
  shared_buffer_allreduces_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ShmDomain::run_allreduce(const Pieces& in, const Pieces& out, std::size_t count, DType dtype,
                              ReduceOp op, const OpHeader& header, Deadline deadline,
                              const SharedBufferMapping* shared, std::size_t shared_offset) {
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    if (count * esize <= options_.small_bytes && count > 0) {
      run_small_allreduce(in, out, count, dtype, op);
      return;
    }
    // Published with the header (before A_0): a rank whose buffer is not shared names none, and
    // every rank then copies (chunk 0's copy-in is done either way, so both paths can follow).
    name_shared_buffer(shared, shared_offset);
    // Nobody else reads this rank's slice of its input, so it stays where it is (saves 1/N of
    // the copy-in) and the reduction reads it from there.
    auto copy_in_but_own_slice = [&](std::size_t first, std::size_t len, int p) {
      const auto [begin, n] = slice_of(len, rank_, size_, esize);
      std::byte* slot = input_slot(rank_, p);
      auto copy_at = [&](std::size_t from) {
        return [&, from](const std::byte* piece, std::size_t at, std::size_t m) {
          std::memcpy(slot + (from + at) * esize, piece, m * esize);
        };
      };
      in.for_each(first, begin, copy_at(0));
      in.for_each(first + begin + n, len - begin - n, copy_at(begin + n));
    };
    auto reduce_own_slice = [&](std::size_t first, std::size_t len, int p) {
      // Plain variables, not a structured binding: the lambda below captures them (clang < 16
      // cannot capture bindings).
      const auto slice = slice_of(len, rank_, size_, esize);
      const std::size_t begin = slice.first, n = slice.second;
      in.for_each(first + begin, n, [&](const std::byte* piece, std::size_t at, std::size_t m) {
        const std::size_t offset = (begin + at) * esize;
        reduce_in_rank_order(
            result_slot(p) + offset,
            [&](int r) { return r == rank_ ? piece : input_slot(r, p) + offset; }, m, dtype, op,
            size_);
      });
    };
    run_chunked_or(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) { copy_in_but_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) { reduce_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) {
          const std::byte* result = result_slot(p);
          out.for_each(first, len, [&](std::byte* piece, std::size_t at, std::size_t m) {
            std::memcpy(piece, result + at * esize, m * esize);
          });
        },
        [&] {
          return shared != nullptr &&
                 try_zero_copy_allreduce(*shared, shared_offset, count, dtype, op);
        });
  });
}

}  // namespace ddp::comm::shm
