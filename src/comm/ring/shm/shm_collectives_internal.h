// How a ShmDomain collective runs (internal to shm/): poisoning on failure, the chunked
// double-buffered pipeline, and the helpers its collectives' two files share.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "comm/reduce_kernels.h"
#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_domain.h"
#include "comm/ring/shm/shm_domain_internal.h"
#include "ddp/comm/comm_error.h"

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
inline constexpr std::size_t kZeroCopyPieceBytes = 64 * 1024;

// Slice of a chunk of `len` elements that `rank` reduces: equal parts rounded up to a cache line,
// so that no two ranks write the same line; the last ranks may get less or nothing.
inline std::pair<std::size_t, std::size_t> slice_of(std::size_t len, int rank, int size,
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
inline void reduce_in_rank_order(std::byte* dst, InputOf&& input_of, std::size_t count, DType dtype,
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

// Checks that `header` describes the call and `root` is a rank (throws ConfigError).
void check_header(const OpHeader& header, Collective kind, std::size_t count, DType dtype, int root,
                  int size);
// Throws ConfigError when `p` is null for a nonzero `count`.
void check_buffer(const void* p, std::size_t count, const char* what);

}  // namespace ddp::comm::shm
