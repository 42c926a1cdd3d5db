// synchronize_trace_clock: the offset of each rank's clock against rank 0's, by ping-pong.
//
// Rank r (r > 0) sends its clock reading t0 to rank 0; rank 0 answers with its own reading T
// taken when the ping arrived; rank r reads t1 when the answer is back. If the two one-way trips
// took the same time, T happened at (t0 + t1) / 2 on rank r's clock, so offset = T - (t0+t1)/2.
// Whatever the asymmetry, T lies between t0 and t1, so the error is at most (t1 - t0) / 2: the
// round with the smallest round trip gives the tightest bound (the NTP/Cristian method). Rank 0
// serves the ranks one after the other; each exchange is 2 * rounds messages of 8 bytes.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "ddp/comm/process_group.h"
#include "ddp/comm/trace.h"
#include "ddp/comm/work.h"

namespace ddp {
namespace detail {
void record_trace_clock_offset(std::int64_t offset_ns, std::int64_t error_ns,
                               std::int64_t round_trip_ns, int rounds);  // tracer.cc
}  // namespace detail

std::int64_t synchronize_trace_clock(ProcessGroup& group, int rounds) {
  if (group.size() == 1) {
    detail::record_trace_clock_offset(0, 0, 0, 0);
    return 0;
  }
  rounds = std::max(rounds, 1);
  if (group.rank() == 0) {
    for (int peer = 1; peer < group.size(); ++peer) {
      for (int round = 0; round < rounds; ++round) {
        std::int64_t ping = 0;
        group.recv(&ping, 1, DType::kInt64, peer, kClockSyncTag)->wait();
        const std::int64_t now = trace_clock_ns();
        group.send(&now, 1, DType::kInt64, peer, kClockSyncTag)->wait();
      }
    }
    detail::record_trace_clock_offset(0, 0, 0, rounds);
    return 0;
  }
  std::int64_t best_round_trip = std::numeric_limits<std::int64_t>::max();
  std::int64_t best_offset = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::int64_t sent = trace_clock_ns();
    group.send(&sent, 1, DType::kInt64, 0, kClockSyncTag)->wait();
    std::int64_t rank0_time = 0;
    group.recv(&rank0_time, 1, DType::kInt64, 0, kClockSyncTag)->wait();
    const std::int64_t received = trace_clock_ns();
    const std::int64_t round_trip = received - sent;
    if (round_trip < best_round_trip) {
      best_round_trip = round_trip;
      best_offset = rank0_time - (sent + (round_trip / 2));
    }
  }
  detail::record_trace_clock_offset(best_offset, (best_round_trip + 1) / 2, best_round_trip,
                                    rounds);
  return best_offset;
}

}  // namespace ddp
