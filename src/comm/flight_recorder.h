// FlightRecorder: the last N operations of a process group, for post-mortems of hangs and
// failures (internal; the role of PyTorch's NCCL flight recorder, docs/observability.md).
//
// Each group's OpQueue owns one. It is a preallocated ring of fixed-size entries: recording an
// operation writes one entry in place (no allocation, no lock of its own, no clock read: the
// times are the ones the queue takes anyway), so it costs a few stores per operation.
//
// Threads: every record_* call and snapshot() must be made with the queue's mutex held (the
// `guard` given at construction); dump() takes that mutex itself to copy the entries, then formats
// and writes the copy without it. So recording is never contended except while a dump copies.
//
// Dumps: dump() writes the entries as JSON to `<dump dir>/ddp_flight_<group>_rank<R>.json`
// (atomically: a temporary file, then rename). A dump that cannot be written is a warning on
// stderr, never an exception: the dump runs on failure paths whose own error must reach the
// caller unchanged. SIGUSR1 dumps every live recorder of the process (flight_dump_signal.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "comm/wire.h"
#include "ddp/comm/comm_error.h"
#include "net/socket.h"

namespace ddp::comm {

enum class FlightState : std::uint8_t { kQueued, kStarted, kCompleted, kFailed };
enum class FlightChannel : std::uint8_t { kCollective, kSend, kRecv };

std::string_view to_string(FlightState state);
std::string_view to_string(FlightChannel channel);

// One operation, one cache line (an operation writes one line of the ring). Times are
// steady-clock nanoseconds since its epoch, 0 while not reached.
struct alignas(64) FlightEntry {
  std::uint64_t id = 0;  // the recorder's running count of operations (slot = id % capacity)
  std::uint64_t sequence = 0;
  std::uint64_t count = 0;  // elements, as the call's fingerprint has it (bytes: from dtype)
  std::int64_t enqueued_ns = 0;
  std::int64_t started_ns = 0;
  std::int64_t ended_ns = 0;
  std::int32_t root = -1;  // root rank, or a send's tag; -1 none
  std::int32_t peer = -1;  // send/recv: the other rank
  FlightChannel channel = FlightChannel::kCollective;
  Collective kind = Collective::kAllreduce;
  std::uint8_t dtype = 0;
  std::uint8_t reduce_op = kNoReduceOp;
  Algorithm algorithm = Algorithm::kNone;
  FlightState state = FlightState::kQueued;
  bool has_fingerprint = false;  // kind..algorithm are known (the backend gave a header)
};
static_assert(sizeof(FlightEntry) == 64);

struct FlightRecorderOptions {
  std::size_t entries = 2000;  // 0: off (every call is a no-op)
  std::string dump_dir;        // "": the working directory
};

// A dump's reason for a group's first error: "timeout", "mismatch", or "failure" for every other
// kind (ddp-trace reads these three).
inline std::string_view dump_reason(CommErrorKind kind) {
  return kind == CommErrorKind::kTimeout    ? "timeout"
         : kind == CommErrorKind::kMismatch ? "mismatch"
                                            : "failure";
}

// Who recorded: written into every dump.
struct FlightIdentity {
  std::string group;
  std::string backend;
  int rank = 0;
  int size = 1;
  int job_rank = -1;        // the launcher's RANK etc., -1 unknown
  int job_world_size = -1;  // -1 unknown
};

class FlightRecorder {
 public:
  FlightRecorder(FlightIdentity identity, FlightRecorderOptions options, std::mutex& guard);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  bool enabled() const { return !ring_.empty(); }
  std::size_t capacity() const { return ring_.size(); }

  // Which entry an operation has (its id, and the slot, kept to spare a division per call).
  struct Handle {
    std::uint64_t id = 0;
    std::size_t slot = 0;
  };

  // REQUIRES: guard held. Records a queued operation and returns its handle for the calls below.
  // `header` may be null (no fingerprint known).
  Handle record_enqueued(const OpHeader* header, FlightChannel channel, int peer,
                         std::uint64_t sequence, net::Clock::time_point enqueued) {
    if (ring_.empty()) return {};
    const Handle handle{next_id_++, next_slot_};
    if (++next_slot_ == ring_.size()) next_slot_ = 0;
    // The next operation's line was last written capacity operations ago, so it is cold: fetch it
    // now, while this operation runs, rather than stall the next one's lock on the miss.
    __builtin_prefetch(&ring_[next_slot_], 1, 3);
    FlightEntry& e = ring_[handle.slot];
    const std::uint64_t id = handle.id;
    e.id = id;
    e.sequence = sequence;
    e.enqueued_ns = enqueued.time_since_epoch().count();
    e.started_ns = 0;
    e.ended_ns = 0;
    e.peer = peer;
    e.channel = channel;
    e.state = FlightState::kQueued;
    e.has_fingerprint = header != nullptr;
    if (header != nullptr) {
      e.count = header->count;
      e.root = header->root;
      e.kind = header->kind;
      e.dtype = header->dtype;
      e.reduce_op = header->reduce_op;
      e.algorithm = header->algorithm;
    } else {
      e.count = 0;
      e.root = -1;
    }
    return handle;
  }
  // REQUIRES: guard held. No-ops for an entry already overwritten by a newer one.
  void record_started(Handle handle, net::Clock::time_point at) {
    if (FlightEntry* e = live(handle)) {
      e->started_ns = at.time_since_epoch().count();
      e->state = FlightState::kStarted;
    }
  }
  void record_ended(Handle handle, net::Clock::time_point at, bool ok) {
    if (FlightEntry* e = live(handle); e != nullptr && e->state != FlightState::kFailed) {
      e->ended_ns = at.time_since_epoch().count();
      e->state = ok ? FlightState::kCompleted : FlightState::kFailed;
    }
  }
  // An operation that failed without running (the group was poisoned first): no end time.
  void record_cancelled(Handle handle) {
    if (FlightEntry* e = live(handle)) e->state = FlightState::kFailed;
  }

  // REQUIRES: guard held. The recorded entries, oldest first.
  std::vector<FlightEntry> snapshot() const;

  // Writes the dump (takes the guard to copy; must not be called with it held). `reason`:
  // "timeout", "mismatch", "failure", "signal", ...; `error`: the group's first error ("" none).
  // Returns the file written, or "" (recorder off, or a warning was printed).
  std::string dump(std::string_view reason, const std::string& error);

  // The dump as JSON text (for tests and dump()).
  static std::string to_json(const FlightIdentity& identity, std::size_t capacity,
                             std::uint64_t recorded, const std::vector<FlightEntry>& entries,
                             std::string_view reason, const std::string& error);
  // "ddp_flight_<group>_rank<R>.json", the group's name made safe for a file name.
  static std::string file_name(const std::string& group, int rank);
  const std::string& dump_dir() const { return options_.dump_dir; }

 private:
  FlightEntry* live(Handle handle) {
    if (ring_.empty()) return nullptr;
    FlightEntry& e = ring_[handle.slot];
    return e.id == handle.id ? &e : nullptr;
  }

  const FlightIdentity identity_;
  const FlightRecorderOptions options_;
  std::mutex& guard_;
  std::vector<FlightEntry> ring_;  // guarded by guard_
  std::uint64_t next_id_ = 0;      // guarded by guard_
  std::size_t next_slot_ = 0;      // next_id_ % capacity, guarded by guard_
  std::mutex dump_mutex_;          // one dump of this recorder at a time
};

}  // namespace ddp::comm
