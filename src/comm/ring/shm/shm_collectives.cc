// ShmDomain's collectives: how a call runs (poisoning on failure, the chunked double-buffered
// pipeline) and allreduce, reduce, broadcast, allgather, reduce_scatter and barrier over it.
#include "comm/ring/shm/shm_domain.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/reduce_kernels.h"
#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_domain_internal.h"
#include "ddp/error.h"

namespace ddp::comm::shm {

template <typename Fn>
void ShmDomain::guarded(const OpHeader& header, Deadline deadline, Fn&& body) {
  if (error_) {
    if (error_is_peer_) {
      throw ShmPeerError(error_->kind(), error_->what(), error_->group(), error_->op(),
                         error_->sequence(), error_->peer());
    }
    throw CommError(*error_);
  }
  header_ = header;
  deadline_ = deadline;
  call_start_ = {};  // set by the first wait of the call (a clock read saved per small call)
  wait_warned_ = false;
  try {
    body();
  } catch (const ShmPeerError& e) {
    error_ = e;
    error_is_peer_ = true;
    abort_domain(e.what());
    throw;
  } catch (const CommError& e) {
    error_ = e;
    abort_domain(e.what());
    throw;
  }
  ++calls_;
}

// A chunked collective, for each chunk i (elements [first, first + len), buffers of parity i%2):
//
//   copy_in(i)  write this rank's input slot            -> event A_i (A_0: also arrive())
//   wait for A_i of every rank (chunk 0: all arrived; compare the call headers)
//   compute(i)  read peers' input slots, write own output -> event B_i
//   copy_in(i+1)                                         -> event A_{i+1}
//   wait for B_i of every rank
//   copy_out(i) read the result slot
//
// Buffer reuse is safe with two parities: a rank overwrites its input slot of parity p (chunk
// i+2) only after it saw every B_i, and peers read that slot before publishing B_i; a rank
// writes its slice of the result slot p (chunk i+2) only after it saw every A_{i+2}, which each
// peer publishes after its copy_out(i). Two events per chunk; copy_in(i+1) overlaps the wait for
// B_i. A call with count 0 only publishes A_0, which checks the headers.
template <typename CopyIn, typename Compute, typename CopyOut>
void ShmDomain::run_chunked(std::size_t count, std::size_t chunk_elems, CopyIn&& copy_in,
                            Compute&& compute, CopyOut&& copy_out) {
  run_chunked_or(count, chunk_elems, std::forward<CopyIn>(copy_in), std::forward<Compute>(compute),
                 std::forward<CopyOut>(copy_out), [] { return false; });
}

// `instead` runs after chunk 0's arrival (A_0), when every rank's header and control are
// visible; if it did the call, B_0 ends it (the same two events as a call of one chunk).
template <typename CopyIn, typename Compute, typename CopyOut, typename Instead>
void ShmDomain::run_chunked_or(std::size_t count, std::size_t chunk_elems, CopyIn&& copy_in,
                               Compute&& compute, CopyOut&& copy_out, Instead&& instead) {
  const std::size_t chunks = (count + chunk_elems - 1) / chunk_elems;
  auto len_of = [&](std::size_t i) { return std::min(chunk_elems, count - i * chunk_elems); };
  const int parity = static_cast<int>(calls_ & 1);
  controls(segment_)[rank_].headers[parity] = header_;
  if (count > 0) copy_in(std::size_t{0}, len_of(0), 0);
  publish();
  arrive();
  if (count == 0) {  // nothing to move; the headers still have to agree
    announce_and_check();
    return;
  }
  const std::uint32_t base = events_ - 1;
  for (std::size_t i = 0; i < chunks; ++i) {
    const std::size_t first = i * chunk_elems;
    const std::size_t len = len_of(i);
    const int p = static_cast<int>(i & 1);
    const auto a_i = static_cast<std::uint32_t>(base + 2 * i + 1);
    if (i == 0) {
      announce_and_check();
      if (instead()) {
        publish();
        wait_all(a_i + 1);
        return;
      }
    } else {
      wait_all(a_i);
    }
    compute(first, len, p);
    publish();
    if (i + 1 < chunks) {
      copy_in(first + chunk_elems, len_of(i + 1), 1 - p);
      publish();
    }
    wait_all(a_i + 1);
    copy_out(first, len, p);
  }
}

// The zero-copy paths reduce in pieces of this many bytes, so that the destination of the
// rank-order passes stays in the cache.
constexpr std::size_t kZeroCopyPieceBytes = 64 * 1024;

// Slice of a chunk of `len` elements that `rank` reduces: equal parts rounded up to a cache line,
// so that no two ranks write the same line; the last ranks may get less or nothing.
static std::pair<std::size_t, std::size_t> slice_of(std::size_t len, int rank, int size,
                                                    std::size_t element_size) {
  const std::size_t per_line = std::max<std::size_t>(1, kCacheLine / element_size);
  const std::size_t part = round_up((len + size - 1) / size, per_line);
  const std::size_t begin = std::min(len, part * rank);
  const std::size_t end = std::min(len, begin + part);
  return {begin, end - begin};
}

// Reduces `inputs(r) + offset` over every rank r in rank order into dst (bytes, count elements);
// the average divides once, at the last step.
template <typename InputOf>
static void reduce_in_rank_order(std::byte* dst, InputOf&& input_of, std::size_t count, DType dtype,
                                 ReduceOp op, int size) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (count == 0) return;
  if (size == 1) {
    if (dst != input_of(0)) std::memmove(dst, input_of(0), bytes);
    return;
  }
  const int divisor = op == ReduceOp::kAvg ? size : 0;
  reduce(dst, input_of(0), input_of(1), count, dtype, op, size == 2 ? divisor : 0);
  for (int r = 2; r < size; ++r) {
    reduce(dst, dst, input_of(r), count, dtype, op, r == size - 1 ? divisor : 0);
  }
}

namespace {

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

}  // namespace

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
