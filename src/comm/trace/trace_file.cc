#include "comm/trace/trace_file.h"

#include <fmt/format.h>

#include "comm/json_file.h"

namespace ddp::comm {
namespace {

// Microseconds with nanosecond resolution, as the trace format's ts and dur want.
std::string micros(std::int64_t ns) {
  const char* sign = ns < 0 ? "-" : "";
  const std::uint64_t magnitude =
      ns < 0 ? static_cast<std::uint64_t>(-(ns + 1)) + 1 : static_cast<std::uint64_t>(ns);
  return fmt::format("{}{}.{:03}", sign, magnitude / 1000, magnitude % 1000);
}

}  // namespace

std::string format_trace(const TraceRecord& record) {
  std::string out;
  out.reserve(256 + record.events.size() * 160);
  out += "{\"traceEvents\": [\n";
  bool first = true;
  const auto separator = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  separator();
  out += fmt::format(
      "{{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": {0}, \"tid\": 0, "
      "\"args\": {{\"name\": \"rank {0}\"}}}}",
      record.rank);
  separator();
  out += fmt::format(
      "{{\"ph\": \"M\", \"name\": \"process_sort_index\", \"pid\": {0}, \"tid\": 0, "
      "\"args\": {{\"sort_index\": {0}}}}}",
      record.rank);
  for (const auto& [tid, name] : record.lanes) {
    separator();
    out += fmt::format(
        "{{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": {}, \"tid\": {}, "
        "\"args\": {{\"name\": {}}}}}",
        record.rank, tid, json_string(name));
    separator();
    out += fmt::format(
        "{{\"ph\": \"M\", \"name\": \"thread_sort_index\", \"pid\": {}, \"tid\": {}, "
        "\"args\": {{\"sort_index\": {}}}}}",
        record.rank, tid, tid);
  }
  std::int64_t last_ns = 0;
  for (const auto& e : record.events) {
    separator();
    const std::int64_t ts = e.start_ns - record.clock.steady_origin_ns;
    last_ns = std::max(last_ns, ts + e.duration_ns);
    out += fmt::format(
        "{{\"ph\": \"{}\", \"name\": {}, \"cat\": {}, \"pid\": {}, \"tid\": {}, "
        "\"ts\": {}",
        e.phase, json_string(e.name), json_string(e.category), record.rank, e.lane, micros(ts));
    if (e.phase == 'X') out += fmt::format(", \"dur\": {}", micros(e.duration_ns));
    if (e.phase == 'i') out += ", \"s\": \"t\"";
    out += fmt::format(", \"args\": {{{}}}}}", e.args);
  }
  if (record.dropped_events > 0) {
    separator();
    out += fmt::format(
        "{{\"ph\": \"i\", \"name\": \"trace truncated\", \"cat\": \"ddp\", \"pid\": {}, "
        "\"tid\": 0, \"ts\": {}, \"s\": \"p\", \"args\": {{\"dropped_events\": {}, "
        "\"max_events\": {}, \"hint\": \"raise DDP_TRACE_MAX_EVENTS or trace fewer steps\"}}}}",
        record.rank, micros(last_ns), record.dropped_events, record.max_events);
  }
  const auto& c = record.clock;
  out += fmt::format(
      "\n],\n\"displayTimeUnit\": \"ms\",\n\"otherData\": {{\"format\": \"ddp-trace 1\", "
      "\"rank\": {}, \"world_size\": {}, \"events\": {}, \"dropped_events\": {}, "
      "\"max_events\": {}, \"clock\": {{\"steady_origin_ns\": {}, \"system_origin_ns\": {}, "
      "\"offset_measured\": {}, \"offset_to_rank0_ns\": {}, \"offset_error_ns\": {}, "
      "\"offset_round_trip_ns\": {}, \"offset_rounds\": {}}}}}}}\n",
      record.rank, record.world_size, record.events.size(), record.dropped_events,
      record.max_events, c.steady_origin_ns, c.system_origin_ns,
      c.offset_measured ? "true" : "false", c.offset_to_rank0_ns, c.offset_error_ns,
      c.offset_round_trip_ns, c.offset_rounds);
  return out;
}

}  // namespace ddp::comm
