// The layout of the shared-memory segment of a domain (internal): the contract between the
// processes that map it. Changing it means bumping kSegmentVersion.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/wire.h"

namespace ddp::comm::shm {

inline constexpr std::uint64_t kSegmentMagic = 0x4d48535044445044ULL;  // "DPDDPSHM" in memory
// 2: anonymous memory shared through /proc; 3: the shared buffer of each call (zero copy)
inline constexpr std::uint32_t kSegmentVersion = 3;
inline constexpr std::size_t kCacheLine = 64;
inline constexpr std::size_t kAbortReasonBytes = 512;

inline std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// The shared mapping, in this order (each part aligned to a cache line or a page):
//   SegmentHeader | RankControl x size | inputs: 2 x size x slot_bytes | results: 2 x slot_bytes
//   | small: 2 x size x small_bytes
// Every rank writes only its own RankControl, its own input and small slots, and its slice of a
// result slot; the events counters order those writes (see ShmDomain::run_chunked).
//
// Any process of the same user can write here too, so a rank trusts no field it did not write
// itself further than its check where it is read:
//   magic, version, size, slot_bytes, small_bytes, total_bytes   equal to this rank's (joining)
//   joined            at most size - 1 (the join wait)
//   aborted_by        -1 or a rank of the world other than the reader (every wait)
//   pid               a positive pid (the join; the pidfds are opened from it)
//   abort_reason      read up to its size, terminated or not; control bytes shown as '?'
//   headers           only compared and described (describe() names a corrupt header)
//   shared_buffer/offset  only compared with this rank's own (equal ones are in range here)
//   events, sleepers, arrivals, arrival_sleepers   counters: compared, never used as an index
// A damaged value can make a call fail or wait until its deadline, never read or write outside
// the mapping.
struct SegmentHeader {
  std::uint64_t magic;  // written last by rank 0, with release
  std::uint32_t version;
  std::int32_t size;
  std::uint64_t slot_bytes;
  std::uint64_t small_bytes;
  std::uint64_t total_bytes;
  std::uint32_t joined;     // ranks other than 0 that have mapped the segment (futex word)
  std::int32_t aborted_by;  // -1, or the first rank that failed a call
  // Arrivals at the first event of a call, all ranks together (futex word), on its own line.
  alignas(kCacheLine) std::uint32_t arrivals;
  std::uint32_t arrival_sleepers;
};

struct alignas(kCacheLine) RankControl {
  // Events this rank has published: the futex word its peers sleep on. Alone on its line.
  alignas(kCacheLine) std::uint32_t events;
  // Peers sleeping on `events` (the publisher skips FUTEX_WAKE when there are none).
  alignas(kCacheLine) std::uint32_t sleepers;
  std::int32_t pid;
  // The headers of this rank's calls, by call parity (a fast peer may start call c+1 while a slow
  // one still reads the header of call c).
  alignas(kCacheLine) OpHeader headers[2];
  // By call parity too: the shared buffer (SharedBufferMapping::id; 0: none) that this rank's
  // call reads from or writes into (a large in-place allreduce's data, a reduce-scatter's input,
  // an allgather's output), and the byte offset of that data in it. The call takes the zero-copy
  // path when every rank names the same buffer and offset.
  std::uint64_t shared_buffer[2];
  std::uint64_t shared_offset[2];
  char abort_reason[kAbortReasonBytes];
};

struct Layout {
  std::size_t control_offset, inputs_offset, results_offset, small_offset, total;
};

inline Layout layout_for(int size, std::size_t slot_bytes, std::size_t small_bytes) {
  Layout l{};
  l.control_offset = round_up(sizeof(SegmentHeader), kCacheLine);
  l.inputs_offset = round_up(l.control_offset + sizeof(RankControl) * size, 4096);
  l.results_offset = l.inputs_offset + 2 * static_cast<std::size_t>(size) * slot_bytes;
  l.small_offset = l.results_offset + 2 * slot_bytes;
  l.total = round_up(l.small_offset + 2 * static_cast<std::size_t>(size) * small_bytes, 4096);
  return l;
}

// The RankControl array that follows the header.
inline RankControl* controls_of(SegmentHeader* header) {
  return reinterpret_cast<RankControl*>(reinterpret_cast<std::byte*>(header) +
                                        round_up(sizeof(SegmentHeader), kCacheLine));
}

}  // namespace ddp::comm::shm
