// The process's one trace recorder behind include/ddp/comm/trace.h.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>

#include <fmt/format.h>

#include "comm/json_file.h"
#include "comm/trace/trace_file.h"
#include "ddp/comm/trace.h"

namespace ddp {
namespace detail {
std::atomic<bool> trace_on{false};
}  // namespace detail

namespace {

using SteadyClock = std::chrono::steady_clock;

std::int64_t steady_ns(SteadyClock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Read on every clock call, written by start_trace only (before trace_on is set).
std::atomic<std::int64_t> clock_shift_ns{0};

// Tids of named lanes start here, far above the thread lanes (1, 2, ...).
constexpr int kFirstNamedLane = 1000;

struct Tracer {
  std::mutex mutex;
  bool exit_flush_registered = false;
  std::filesystem::path file;
  comm::TraceRecord record;
  std::map<std::string, int, std::less<>> named_lanes;
  int next_thread_lane = 1;
  std::uint64_t generation = 0;  // bumped by start_trace: thread lanes of an earlier trace
};

Tracer& tracer() {
  // Never destroyed: threads may still record while static destructors run.
  static auto* instance = new Tracer;
  return *instance;
}

// The calling thread's lane in the current trace (0 = none yet).
struct ThreadLane {
  std::uint64_t generation = ~std::uint64_t{0};
  int lane = 0;
};
thread_local ThreadLane this_thread_lane;

// REQUIRES: t.mutex held.
int thread_lane_locked(Tracer& t, std::string_view name = {}) {
  if (this_thread_lane.generation != t.generation || this_thread_lane.lane == 0) {
    const int lane = t.next_thread_lane++;
    this_thread_lane = {.generation = t.generation, .lane = lane};
    t.record.lanes.emplace_back(lane,
                                lane == 1 ? std::string("main") : fmt::format("thread {}", lane));
  }
  if (!name.empty()) {
    for (auto& [tid, lane_name] : t.record.lanes) {
      if (tid == this_thread_lane.lane) lane_name = std::string(name);
    }
  }
  return this_thread_lane.lane;
}

std::string args_text(TraceArgs args) {
  std::string text;
  for (const auto& [name, value] : args) {
    if (!text.empty()) text += ", ";
    text += comm::json_string(name);
    text += ": ";
    text += value.json();
  }
  return text;
}

void record(comm::TraceEvent event) {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  if (!detail::trace_on.load(std::memory_order_relaxed)) return;
  if (t.record.events.size() >= t.record.max_events) {
    ++t.record.dropped_events;
    return;
  }
  t.record.events.push_back(std::move(event));
}

std::string flush_locked(Tracer& t) {
  std::string text;
  try {
    text = comm::format_trace(t.record);
  } catch (const std::exception& e) {  // allocation
    throw TraceError(fmt::format("ddp trace: rank {} could not format its trace ({} events): {}",
                                 t.record.rank, t.record.events.size(), e.what()));
  }
  const std::string problem = comm::write_file_atomically(t.file, text);
  if (!problem.empty()) {
    throw TraceError(fmt::format(
        "ddp trace: rank {} could not write its trace file {} ({}); the previous flush of it, if "
        "any, is intact. Point DDP_TRACE (TraceOptions::dir) at a folder with room that this "
        "process can write",
        t.record.rank, t.file.string(), problem));
  }
  return t.file.string();
}

void flush_at_exit() {
  try {
    flush_trace();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp: warning: %s\n", e.what());
  }
}

}  // namespace

std::string TraceArg::json() const {
  switch (kind_) {
    case Kind::kInteger:
      return std::to_string(integer_);
    case Kind::kBool:
      return integer_ != 0 ? "true" : "false";
    case Kind::kText:
      return comm::json_string(text_);
    case Kind::kReal:
      break;
  }
  std::string text = fmt::format("{}", real_);
  // JSON has no literal for infinities and NaN.
  return std::isfinite(real_) ? text : comm::json_string(text);
}

std::int64_t trace_clock_ns() noexcept {
  return steady_ns(SteadyClock::now()) + clock_shift_ns.load(std::memory_order_relaxed);
}

std::int64_t trace_clock_ns(SteadyClock::time_point t) noexcept {
  return steady_ns(t) + clock_shift_ns.load(std::memory_order_relaxed);
}

void start_trace(const TraceOptions& options) {
  if (options.dir.empty()) {
    throw TraceError(
        "ddp trace: the trace folder is empty; give TraceOptions::dir (DDP_TRACE=DIR)");
  }
  if (options.rank < 0 || options.world_size < 1 || options.rank >= options.world_size) {
    throw TraceError(fmt::format("ddp trace: rank {} of world size {} is not a place in a job",
                                 options.rank, options.world_size));
  }
  const std::filesystem::path dir(options.dir);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw TraceError(fmt::format(
        "ddp trace: rank {} cannot create the trace folder '{}' ({}); tracing is off. Point "
        "DDP_TRACE at a folder this process can write",
        options.rank, options.dir, ec.message()));
  }
  // Find out now, not at exit, whether files can be made there.
  const auto probe = dir / fmt::format(".trace_rank{}.probe.{}", options.rank, ::getpid());
  const std::string problem = comm::write_file_atomically(probe, "probe\n");
  if (!problem.empty()) {
    throw TraceError(fmt::format(
        "ddp trace: rank {} cannot write in the trace folder '{}' ({}); tracing is off. Point "
        "DDP_TRACE at a folder this process can write",
        options.rank, options.dir, problem));
  }
  std::filesystem::remove(probe, ec);

  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  detail::trace_on.store(false, std::memory_order_relaxed);
  clock_shift_ns.store(options.clock_shift.count(), std::memory_order_relaxed);
  t.file = dir / fmt::format("trace_rank{}.json", options.rank);
  t.record = comm::TraceRecord{};
  t.record.rank = options.rank;
  t.record.world_size = options.world_size;
  t.record.max_events = options.max_events;
  t.record.events.reserve(std::min<std::size_t>(options.max_events, 4096));
  t.record.clock.steady_origin_ns = trace_clock_ns();
  t.record.clock.system_origin_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count() +
                                    options.clock_shift.count();
  t.named_lanes.clear();
  t.next_thread_lane = 1;
  ++t.generation;
  if (!t.exit_flush_registered) {
    t.exit_flush_registered = true;
    std::atexit(flush_at_exit);
  }
  detail::trace_on.store(true, std::memory_order_relaxed);
}

std::string flush_trace() {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  if (!detail::trace_on.load(std::memory_order_relaxed)) return {};
  return flush_locked(t);
}

void stop_trace() {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  if (!detail::trace_on.load(std::memory_order_relaxed)) return;
  detail::trace_on.store(false, std::memory_order_relaxed);
  flush_locked(t);
}

namespace detail {
// For synchronize_trace_clock (clock_sync.cc).
void record_trace_clock_offset(std::int64_t offset_ns, std::int64_t error_ns,
                               std::int64_t round_trip_ns, int rounds) {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  if (!trace_on.load(std::memory_order_relaxed)) return;
  t.record.clock.offset_measured = true;
  t.record.clock.offset_to_rank0_ns = offset_ns;
  t.record.clock.offset_error_ns = error_ns;
  t.record.clock.offset_round_trip_ns = round_trip_ns;
  t.record.clock.offset_rounds = rounds;
}
}  // namespace detail

int trace_lane(std::string_view name) {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  if (const auto it = t.named_lanes.find(name); it != t.named_lanes.end()) return it->second;
  const int lane = kFirstNamedLane + static_cast<int>(t.named_lanes.size());
  t.named_lanes.emplace(std::string(name), lane);
  t.record.lanes.emplace_back(lane, std::string(name));
  return lane;
}

int trace_thread_lane() {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  return thread_lane_locked(t);
}

void trace_name_thread(std::string_view name) {
  auto& t = tracer();
  std::lock_guard lock(t.mutex);
  thread_lane_locked(t, name);
}

void trace_complete(std::string_view name, std::string_view category, int lane,
                    std::int64_t start_ns, std::int64_t end_ns, TraceArgs args) {
  if (!trace_enabled()) return;
  record({.phase = 'X',
          .lane = lane,
          .start_ns = start_ns,
          .duration_ns = std::max<std::int64_t>(0, end_ns - start_ns),
          .name = std::string(name),
          .category = std::string(category),
          .args = args_text(args)});
}

void trace_instant(std::string_view name, std::string_view category, int lane, std::int64_t at_ns,
                   TraceArgs args) {
  if (!trace_enabled()) return;
  record({.phase = 'i',
          .lane = lane,
          .start_ns = at_ns,
          .duration_ns = 0,
          .name = std::string(name),
          .category = std::string(category),
          .args = args_text(args)});
}

struct TraceSpan::Open {
  std::string name;
  std::string category;
  std::string
      args;  // JSON members, formatted at the start (the argument strings may not outlive it)
  std::int64_t start_ns = 0;
};

TraceSpan::TraceSpan(std::string_view name, std::string_view category, TraceArgs args) {
  open_ = new Open{.name = std::string(name),
                   .category = std::string(category),
                   .args = args_text(args),
                   .start_ns = trace_clock_ns()};
}

void TraceSpan::end() noexcept {
  std::unique_ptr<Open> open(std::exchange(open_, nullptr));
  if (!open || !trace_enabled()) return;
  try {
    const std::int64_t end_ns = trace_clock_ns();
    auto& t = tracer();
    int lane = 0;
    {
      std::lock_guard lock(t.mutex);
      lane = thread_lane_locked(t);
    }
    record({.phase = 'X',
            .lane = lane,
            .start_ns = open->start_ns,
            .duration_ns = end_ns - open->start_ns,
            .name = std::move(open->name),
            .category = std::move(open->category),
            .args = std::move(open->args)});
  } catch (...) {  // out of memory: the event is lost, the program goes on
  }
}

}  // namespace ddp
