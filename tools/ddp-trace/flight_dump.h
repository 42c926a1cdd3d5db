// Reading the flight recorder's dumps (the JSON files ranks write into DDP_DUMP_DIR, see
// docs/observability.md for the format). ddp-trace's own reader: it knows the format, not ddp's
// internals.
//
//   auto dumps = ddp::trace::read_flight_dumps("/tmp/job-logs");   // every ddp_flight_*.json
//
// Throws TraceError naming the folder or file and what is wrong: a folder that does not exist or
// cannot be read, one without dumps, a file that is not JSON or lacks a field of the format.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ddp::trace {

class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One operation of a dump. Times are wall-clock microseconds since the Unix epoch.
struct DumpEntry {
  std::uint64_t id = 0;
  std::uint64_t sequence = 0;
  std::string channel;  // "collective", "send", "recv"
  int peer = -1;
  std::string op;  // "allreduce", ...; "" when unknown
  std::string dtype;
  std::uint64_t count = 0;
  std::string reduce_op;  // "" none
  int root = -1;
  std::string algorithm;
  std::string state;  // "queued", "started", "completed", "failed"
  std::optional<std::int64_t> enqueued_us, started_us, ended_us;

  // "allreduce(float32 x 1024, sum) #7", as ddp's own error messages name calls.
  std::string describe() const;
  // What must agree across ranks at one sequence number (op, dtype, count, reduce op, root).
  std::string fingerprint() const;
};

struct FlightDump {
  std::filesystem::path path;
  std::string group;
  std::string backend;
  int rank = 0;
  int size = 1;
  std::string host;
  long long pid = 0;
  std::string reason;  // "timeout", "mismatch", "failure", "signal"
  std::string error;   // the group's first error, "" none
  std::int64_t dump_time_us = 0;
  std::uint64_t capacity = 0;
  std::uint64_t recorded = 0;
  std::vector<DumpEntry> entries;  // oldest first
};

// Parses one dump's text; `path` names it in errors.
FlightDump parse_flight_dump(const std::string& text, const std::filesystem::path& path);
// Every ddp_flight_*.json in `dir`, sorted by group then rank.
std::vector<FlightDump> read_flight_dumps(const std::filesystem::path& dir);

}  // namespace ddp::trace
