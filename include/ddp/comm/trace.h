// Timeline tracing: where each rank's time goes, as a Chrome/Perfetto trace per rank.
//
//   ddp::start_trace({.dir = "traces", .rank = pg->rank(), .world_size = pg->size()});
//   ddp::synchronize_trace_clock(*pg);                 // optional, collective: aligns the ranks
//   { auto span = ddp::trace_span("data loading"); batch = next(); }
//   { auto span = ddp::trace_span("optimizer step", "train", {{"step", step}}); opt.step(); }
//   ddp::flush_trace();                                 // also runs at exit
//
// Under init_process_group() the environment does all of this: DDP_TRACE=DIR starts a trace for
// the rank, measures its clock against rank 0's through the new group and writes
// DIR/trace_rank<R>.json at exit. DistributedDataParallel records its forward passes, each
// bucket's ready time and its collective's start and end (docs/observability.md).
//
// File: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}. Events are "X"
// (complete: ts and dur in microseconds since this rank's trace origin), "i" (instant) and "M"
// (thread names); pid = rank, tid = the lane (a thread, or a named lane such as one per DDP
// bucket). otherData holds the rank, the clock pair taken at the origin (steady and system clock,
// nanoseconds), the offset of this rank's steady clock against rank 0's with its error bound
// (from synchronize_trace_clock), and how many events were recorded and dropped. `ddp-trace merge`
// joins the ranks' files into one, on rank 0's clock.
//
// Cost: when no trace is running every call below returns after one relaxed atomic load
// (trace_enabled()). While tracing, recording an event takes a mutex and appends to a vector;
// at most TraceOptions::max_events are kept, later ones are counted as dropped and the file says
// so (otherData.dropped_events and a final "trace truncated" instant event).
//
// Threads: every function is thread-safe. Lifetime: one trace per process at a time; start_trace
// again replaces it (events not flushed are lost). The file is written at flush_trace(),
// stop_trace() and at normal exit (atexit), never at a crash.
//
// Errors: start_trace throws TraceError when the folder cannot be made or written (nothing is
// recorded then); flush_trace throws TraceError naming the file and the reason (disk full, no
// permission), leaving no partial file: it writes to a temporary file and renames it, so the
// previous flush's file stays intact. The flush at exit prints that error as a warning instead.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class ProcessGroup;

// The trace folder cannot be used, or a trace file could not be written.
class TraceError : public Error {
 public:
  using Error::Error;
};

struct TraceOptions {
  std::string dir;  // created if missing; the file is dir/trace_rank<rank>.json
  int rank = 0;
  int world_size = 1;
  // Events kept in memory (about 150 bytes each, also in the file); later ones are dropped.
  std::size_t max_events = 200'000;
  // Added to every clock reading of this process (steady and system clock alike): simulates a
  // host whose clocks disagree with rank 0's, for tests of the clock alignment. 0 in real use.
  std::chrono::nanoseconds clock_shift{0};
};

// One argument of an event: an integer, a floating-point number, a boolean or a string. Holds
// the value as given (a string is not copied: it must outlive the recording call), so building
// arguments costs nothing measurable when no trace runs; it is formatted only when recorded.
class TraceArg {
 public:
  template <typename T>
  requires std::is_integral_v<T> &&
      (!std::is_same_v<T, bool>)TraceArg(T value)  // NOLINT(google-explicit-constructor)
      : kind_(Kind::kInteger), integer_(static_cast<std::int64_t>(value)) {}
  TraceArg(double value) : kind_(Kind::kReal), real_(value) {}               // NOLINT
  TraceArg(bool value) : kind_(Kind::kBool), integer_(value ? 1 : 0) {}      // NOLINT
  TraceArg(std::string_view value) : kind_(Kind::kText), text_(value) {}     // NOLINT
  TraceArg(const char* value) : TraceArg(std::string_view(value)) {}         // NOLINT
  TraceArg(const std::string& value) : TraceArg(std::string_view(value)) {}  // NOLINT
  std::string json() const;  // the value as JSON text

 private:
  enum class Kind { kInteger, kReal, kBool, kText };
  Kind kind_;
  std::int64_t integer_ = 0;
  double real_ = 0.0;
  std::string_view text_;
};
using TraceArgs = std::initializer_list<std::pair<std::string_view, TraceArg>>;

namespace detail {
extern std::atomic<bool> trace_on;
}  // namespace detail

// True while a trace is recording: the one check every recording call makes first.
inline bool trace_enabled() noexcept {
  return detail::trace_on.load(std::memory_order_relaxed);
}

// Starts recording (see the errors above). Registers the flush at exit once per process.
void start_trace(const TraceOptions& options);
// Writes the file and stops recording. Throws TraceError like flush_trace. No-op when off.
void stop_trace();
// Writes everything recorded so far to dir/trace_rank<R>.json (replacing the previous flush) and
// returns its path; "" when no trace is running. Recording goes on. Blocks recording on other
// threads while it formats the events.
std::string flush_trace();

// Collective over `group` (every rank must call it; a no-op returning at once when the group has
// one rank): measures the offset of this rank's steady clock against rank 0's by `rounds`
// ping-pongs with rank 0 (tag kClockSyncTag) and keeps the round with the smallest round-trip
// time: offset = t_rank0 - (t_send + t_receive) / 2, error at most half that round trip. Records
// it in the trace (when one is running; the exchange happens either way, so ranks whose trace
// could not start stay in step). Returns the offset in nanoseconds (0 on rank 0).
inline constexpr int kClockSyncTag = 0x7ace;
std::int64_t synchronize_trace_clock(ProcessGroup& group, int rounds = 16);

// The tracer's clock: the steady clock plus TraceOptions::clock_shift, in nanoseconds.
std::int64_t trace_clock_ns() noexcept;
// A steady_clock time point (e.g. from ddp::BackwardTimeline) on the tracer's clock.
std::int64_t trace_clock_ns(std::chrono::steady_clock::time_point t) noexcept;

// A lane (the tid of the events) of its own for a named activity, e.g. "bucket 3 collective";
// the same name gives the same lane. Lanes of threads are made on their own.
int trace_lane(std::string_view name);
// The lane of the calling thread (named "main" for the first thread that records, else
// "thread N", until trace_name_thread).
int trace_thread_lane();
void trace_name_thread(std::string_view name);

// A complete event (phase "X") from start_ns to end_ns (trace_clock_ns values) on `lane`.
void trace_complete(std::string_view name, std::string_view category, int lane,
                    std::int64_t start_ns, std::int64_t end_ns, TraceArgs args = {});
// An instant event (phase "i") at `at_ns` on `lane`.
void trace_instant(std::string_view name, std::string_view category, int lane, std::int64_t at_ns,
                   TraceArgs args = {});

// Records a complete event on the calling thread's lane from its construction to its destruction
// (or end()). When no trace is running it records nothing and costs one check.
class [[nodiscard]] TraceSpan {
 public:
  TraceSpan() = default;
  TraceSpan(std::string_view name, std::string_view category, TraceArgs args);
  TraceSpan(TraceSpan&& other) noexcept : open_(std::exchange(other.open_, nullptr)) {}
  TraceSpan& operator=(TraceSpan&&) = delete;
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;
  ~TraceSpan() {
    if (open_ != nullptr) end();
  }
  // Records the event now (once).
  void end() noexcept;

 private:
  struct Open;  // name, category, arguments and start time; null when nothing is recorded
  Open* open_ = nullptr;
};

inline TraceSpan trace_span(std::string_view name, std::string_view category = "user",
                            TraceArgs args = {}) {
  if (!trace_enabled()) return {};
  return TraceSpan(name, category, args);
}

}  // namespace ddp
#pragma GCC visibility pop
