// ddp-trace merge: joins the ranks' timeline files (DIR/trace_rank<R>.json, written under
// DDP_TRACE; include/ddp/comm/trace.h) into one Chrome/Perfetto trace on rank 0's clock
// (docs/observability.md, "Merging the ranks").
//
//   auto merged = ddp::trace::merge_timelines(ddp::trace::read_timelines(dir));
//   write(merged.trace.dump());  for (auto& line : merged.lines) std::cout << line << '\n';
//
// Alignment, per rank r: when r measured its offset against rank 0 (synchronize_trace_clock,
// ping-pong: otherData.clock.offset_measured) and rank 0's file is there, an event at ts on rank
// r moves to ts + (origin_r + offset_r - origin_0), accurate to the recorded error bound (half
// the best round trip). Otherwise the system clocks taken at each trace's origin are used
// (ts + system_origin_r - system_origin_0): exact on one host, as good as NTP across hosts. The
// lowest rank present is the reference when rank 0's file is missing. Each rank keeps its pid
// (the rank), so the merged view has one process per rank.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddp-trace/flight_dump.h"  // TraceError

namespace ddp::trace {

struct RankTimeline {
  std::string file;
  int rank = 0;
  int world_size = 0;
  nlohmann::json trace;  // the whole file
};

struct RankAlignment {
  int rank = 0;
  std::string method;                // "ping-pong", "system clock" or "reference"
  std::int64_t shift_ns = 0;         // added to the rank's timestamps
  std::int64_t error_bound_ns = -1;  // -1: unknown (system clock)
  std::int64_t events = 0;
  std::int64_t dropped_events = 0;
};

struct MergedTimeline {
  nlohmann::json trace;                  // {"traceEvents": [...], "otherData": {...}}
  std::vector<RankAlignment> alignment;  // per rank, by rank
  std::vector<std::string> lines;        // a summary to print
};

// Reads every trace_rank<R>.json in `dir`. Throws TraceError for a missing folder, a folder
// without trace files, a file that is not a ddp trace (naming it and what is wrong) and two files
// of one rank.
std::vector<RankTimeline> read_timelines(const std::filesystem::path& dir);

MergedTimeline merge_timelines(const std::vector<RankTimeline>& ranks);

}  // namespace ddp::trace
