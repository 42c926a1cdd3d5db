#include "comm/flight_recorder.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>

#include <fmt/format.h>

#include "comm/flight_dump_signal.h"
#include "comm/json_file.h"

namespace ddp::comm {
namespace {

std::string int_or_null(long long value) {
  return value < 0 ? std::string("null") : std::to_string(value);
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

// "2026-11-30T20:01:02.123456Z"
std::string iso_time(std::chrono::system_clock::time_point t) {
  const auto us =
      std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  const std::time_t seconds = static_cast<std::time_t>(us / 1'000'000);
  std::tm utc{};
  ::gmtime_r(&seconds, &utc);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z", utc.tm_year + 1900,
                     utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec,
                     us % 1'000'000);
}

}  // namespace

std::string_view to_string(FlightState state) {
  switch (state) {
    case FlightState::kQueued:
      return "queued";
    case FlightState::kStarted:
      return "started";
    case FlightState::kCompleted:
      return "completed";
    case FlightState::kFailed:
      return "failed";
  }
  return "unknown";
}

std::string_view to_string(FlightChannel channel) {
  switch (channel) {
    case FlightChannel::kCollective:
      return "collective";
    case FlightChannel::kSend:
      return "send";
    case FlightChannel::kRecv:
      return "recv";
  }
  return "unknown";
}

FlightRecorder::FlightRecorder(FlightIdentity identity, FlightRecorderOptions options,
                               std::mutex& guard)
    : identity_(std::move(identity)),
      options_(std::move(options)),
      guard_(guard),
      ring_(options_.entries) {
  if (enabled()) register_for_signal_dumps(this);
}

FlightRecorder::~FlightRecorder() {
  if (enabled()) unregister_for_signal_dumps(this);
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::vector<FlightEntry> out;
  if (ring_.empty()) return out;
  const std::uint64_t n = std::min<std::uint64_t>(next_id_, ring_.size());
  out.reserve(n);
  for (std::uint64_t id = next_id_ - n; id < next_id_; ++id)
    out.push_back(ring_[id % ring_.size()]);
  return out;
}

std::string FlightRecorder::file_name(const std::string& group, int rank) {
  std::string safe;
  for (const char c : group) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '.';
    safe += ok ? c : '_';
  }
  if (safe.empty()) safe = "_";
  return fmt::format("ddp_flight_{}_rank{}.json", safe, rank);
}

std::string FlightRecorder::to_json(const FlightIdentity& identity, std::size_t capacity,
                                    std::uint64_t recorded, const std::vector<FlightEntry>& entries,
                                    std::string_view reason, const std::string& error) {
  // Steady-clock times become wall-clock microseconds through the offset measured now, so that
  // the dumps of several hosts can be compared (as well as their clocks agree).
  const auto wall_now = std::chrono::system_clock::now();
  const auto steady_now = net::Clock::now();
  const std::int64_t offset_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(wall_now.time_since_epoch()).count() -
      std::chrono::duration_cast<std::chrono::nanoseconds>(steady_now.time_since_epoch()).count();
  const auto wall_us = [&](std::int64_t steady_ns) {
    return steady_ns == 0 ? std::string("null") : std::to_string((steady_ns + offset_ns) / 1000);
  };
  std::string out;
  out.reserve(512 + entries.size() * 360);
  out += "{\n";
  out += fmt::format("  \"format\": \"ddp-flight-recorder\",\n  \"version\": 1,\n");
  out += fmt::format("  \"group\": {},\n  \"backend\": {},\n", json_string(identity.group),
                     json_string(identity.backend));
  out += fmt::format("  \"rank\": {},\n  \"size\": {},\n  \"job_rank\": {},\n", identity.rank,
                     identity.size, int_or_null(identity.job_rank));
  out += fmt::format("  \"job_world_size\": {},\n  \"pid\": {},\n  \"host\": {},\n",
                     int_or_null(identity.job_world_size), ::getpid(), json_string(host_name()));
  out += fmt::format(
      "  \"dump_time\": {},\n  \"dump_time_unix_us\": {},\n", json_string(iso_time(wall_now)),
      std::chrono::duration_cast<std::chrono::microseconds>(wall_now.time_since_epoch()).count());
  out += fmt::format("  \"reason\": {},\n  \"error\": {},\n", json_string(reason),
                     error.empty() ? std::string("null") : json_string(error));
  out +=
      fmt::format("  \"capacity\": {},\n  \"recorded\": {},\n  \"entries\": [", capacity, recorded);
  bool first = true;
  for (const FlightEntry& e : entries) {
    out += first ? "\n" : ",\n";
    first = false;
    std::string op = "null", dtype = "null", reduce = "null", algorithm = "null", root = "null";
    if (e.has_fingerprint) {
      op = json_string(to_string(e.kind));
      dtype = e.dtype <= static_cast<std::uint8_t>(DType::kInt64)
                  ? json_string(to_string(static_cast<DType>(e.dtype)))
                  : json_string(fmt::format("dtype {}", e.dtype));
      if (e.reduce_op != kNoReduceOp) {
        reduce = e.reduce_op <= static_cast<std::uint8_t>(ReduceOp::kBxor)
                     ? json_string(to_string(static_cast<ReduceOp>(e.reduce_op)))
                     : json_string(fmt::format("op {}", e.reduce_op));
      }
      algorithm = json_string(to_string(e.algorithm));
      if (e.root >= 0) root = std::to_string(e.root);
    }
    const std::string bytes =
        e.has_fingerprint && e.dtype <= static_cast<std::uint8_t>(DType::kInt64)
            ? std::to_string(e.count * dtype_size(static_cast<DType>(e.dtype)))
            : std::string("null");
    const std::string duration = e.started_ns != 0 && e.ended_ns != 0
                                     ? std::to_string((e.ended_ns - e.started_ns) / 1000)
                                     : std::string("null");
    out += fmt::format(
        "    {{\"id\": {}, \"sequence\": {}, \"channel\": {}, \"peer\": {}, \"op\": {}, "
        "\"dtype\": {}, \"count\": {}, \"bytes\": {}, \"reduce_op\": {}, \"root\": {}, "
        "\"algorithm\": {}, \"state\": {}, \"enqueued_us\": {}, \"started_us\": {}, "
        "\"ended_us\": {}, \"duration_us\": {}}}",
        e.id, e.sequence, json_string(to_string(e.channel)), int_or_null(e.peer), op, dtype,
        e.count, bytes, reduce, root, algorithm, json_string(to_string(e.state)),
        wall_us(e.enqueued_ns), wall_us(e.started_ns), wall_us(e.ended_ns), duration);
  }
  out += entries.empty() ? "]\n}\n" : "\n  ]\n}\n";
  return out;
}

std::string FlightRecorder::dump(std::string_view reason, const std::string& error) {
  if (!enabled()) return {};
  std::lock_guard dumping(dump_mutex_);
  std::vector<FlightEntry> entries;
  std::uint64_t recorded = 0;
  {
    std::lock_guard lock(guard_);
    entries = snapshot();
    recorded = next_id_;
  }
  // A group that never queued an operation (e.g. the cross-host part of a hierarchical group,
  // whose steps run on its parent's queue) has nothing to tell.
  if (recorded == 0) return {};
  const std::filesystem::path dir = options_.dump_dir.empty()
                                        ? std::filesystem::path(".")
                                        : std::filesystem::path(options_.dump_dir);
  const std::filesystem::path path = dir / file_name(identity_.group, identity_.rank);
  std::string problem;
  try {
    problem = write_file_atomically(
        path, to_json(identity_, ring_.size(), recorded, entries, reason, error));
  } catch (const std::exception& e) {  // formatting (allocation)
    problem = e.what();
  }
  if (!problem.empty()) {
    std::fprintf(stderr,
                 "ddp: warning: rank %d could not write the flight recorder of group '%s' (%s); "
                 "set DDP_DUMP_DIR to a folder this process can write\n",
                 identity_.rank, identity_.group.c_str(), problem.c_str());
    return {};
  }
  return path.string();
}

}  // namespace ddp::comm
