// The trace a rank records, and its JSON text (internal; the format is described in
// include/ddp/comm/trace.h and docs/observability.md, and read by tools/ddp-trace/merge).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace ddp::comm {

struct TraceEvent {
  char phase = 'X';  // 'X' complete, 'i' instant
  int lane = 0;
  std::int64_t start_ns = 0;  // the tracer's clock
  std::int64_t duration_ns = 0;
  std::string name;
  std::string category;
  std::string args;  // the members of the args object as JSON text, without braces; may be ""
};

// The clocks of one rank, so that a reader can put its events on rank 0's time line.
struct TraceClock {
  std::int64_t steady_origin_ns = 0;    // the tracer's clock at start: ts 0 of the events
  std::int64_t system_origin_ns = 0;    // system_clock (Unix time) at the same moment
  bool offset_measured = false;         // synchronize_trace_clock ran
  std::int64_t offset_to_rank0_ns = 0;  // rank 0's steady clock minus this rank's
  std::int64_t offset_error_ns = 0;     // |true offset - offset_to_rank0_ns| is at most this
  std::int64_t offset_round_trip_ns = 0;
  int offset_rounds = 0;
};

struct TraceRecord {
  int rank = 0;
  int world_size = 1;
  std::size_t max_events = 0;
  std::uint64_t dropped_events = 0;
  TraceClock clock;
  std::vector<std::pair<int, std::string>> lanes;  // tid, name
  std::vector<TraceEvent> events;
};

// The trace file's text: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}.
std::string format_trace(const TraceRecord& record);

}  // namespace ddp::comm
