// The cost of one timeline event (include/ddp/comm/trace.h) in isolation, with google-benchmark:
// a trace_span with one argument and a trace_complete, with tracing off (the one check) and on
// (the cap set high enough that nothing is dropped within a run; the events go to a temporary
// folder that is removed after). Results: docs/observability.md, "Cost of the timeline".
//   build/bin/trace_event_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "ddp/comm/trace.h"

namespace {

std::string trace_folder() {
  static const std::string folder = [] {
    std::string pattern = (std::filesystem::temp_directory_path() / "ddp-trace-bench-XXXXXX");
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    return pattern;
  }();
  return folder;
}

void set_tracing(bool on) {
  if (on) {
    ddp::start_trace({.dir = trace_folder(), .max_events = 100'000'000});
  } else if (ddp::trace_enabled()) {
    ddp::start_trace({.dir = trace_folder(), .max_events = 1});  // forget the events
    ddp::stop_trace();
  }
}

void SpanOff(benchmark::State& state) {
  set_tracing(false);
  std::int64_t step = 0;
  for (auto _ : state) {
    auto span = ddp::trace_span("optimizer step", "train", {{"step", ++step}});
    benchmark::DoNotOptimize(span);
  }
}
BENCHMARK(SpanOff);

void SpanOn(benchmark::State& state) {
  set_tracing(true);
  std::int64_t step = 0;
  for (auto _ : state) {
    auto span = ddp::trace_span("optimizer step", "train", {{"step", ++step}});
    benchmark::DoNotOptimize(span);
  }
  set_tracing(false);
}
BENCHMARK(SpanOn);

void CompleteOn(benchmark::State& state) {
  set_tracing(true);
  const int lane = ddp::trace_lane("bucket 0 collective");
  std::int64_t t = 0;
  for (auto _ : state) {
    ddp::trace_complete("allreduce", "comm", lane, t, t + 10, {{"bucket", 0}, {"bytes", 4096}});
    t += 20;
  }
  set_tracing(false);
}
BENCHMARK(CompleteOn);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::error_code ignored;
  std::filesystem::remove_all(trace_folder(), ignored);
  return 0;
}
