// ddp-trace: tools for what ddp records while a job runs (docs/observability.md).
//   ddp-trace analyze DIR   reads every rank's flight recorder dump in DIR and says which rank is
//                           behind, which collective never matched, and where calls disagree.
//   ddp-trace merge DIR -o merged.json
//                           joins every rank's timeline (DDP_TRACE=DIR) into one trace on rank 0's
//                           clock, for Perfetto or chrome://tracing.
// Exit codes: 0 nothing wrong found, 1 a problem found, 2 bad usage or unreadable dumps/traces.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "ddp-trace/analyze.h"
#include "ddp-trace/flight_dump.h"
#include "ddp-trace/timeline_merge.h"

namespace {

constexpr int kProblemExitCode = 1;
constexpr int kUsageExitCode = 2;

int analyze_command(const std::string& dir) {
  try {
    const auto report = ddp::trace::analyze(ddp::trace::read_flight_dumps(dir));
    for (const auto& line : report.lines)
      std::cout << line << '\n';
    return report.problem ? kProblemExitCode : 0;
  } catch (const ddp::trace::TraceError& e) {
    std::cerr << "ddp-trace: error: " << e.what() << '\n';
    return kUsageExitCode;
  }
}

int merge_command(const std::string& dir, const std::string& output) {
  try {
    const auto merged = ddp::trace::merge_timelines(ddp::trace::read_timelines(dir));
    const std::string temp = output + ".tmp";
    {
      std::ofstream out(temp, std::ios::trunc);
      out << merged.trace.dump() << '\n';
      out.flush();
      if (!out) {
        std::remove(temp.c_str());
        throw ddp::trace::TraceError(fmt::format("cannot write {}", temp));
      }
    }
    if (std::rename(temp.c_str(), output.c_str()) != 0) {
      std::remove(temp.c_str());
      throw ddp::trace::TraceError(fmt::format("cannot rename {} to {}", temp, output));
    }
    for (const auto& line : merged.lines)
      std::cout << line << '\n';
    std::cout << fmt::format("wrote {} ({} ranks)\n", output, merged.alignment.size());
    return 0;
  } catch (const ddp::trace::TraceError& e) {
    std::cerr << "ddp-trace: error: " << e.what() << '\n';
    return kUsageExitCode;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ddp-trace: reads what ddp records while a job runs.\n"
      "  ddp-trace analyze DIR    which rank is behind, which collective never matched\n"
      "  ddp-trace merge DIR -o merged.json   every rank's timeline in one trace\n"
      "Exit codes: 0 nothing wrong found, 1 a problem found, 2 bad usage or unreadable dumps."};
  app.require_subcommand(1);
  std::string dir;
  auto* analyze = app.add_subcommand(
      "analyze",
      "Read every rank's flight recorder dump (ddp_flight_*.json, written on a timeout, a "
      "failure, a mismatch or SIGUSR1 into DDP_DUMP_DIR) and name the rank that is behind, the "
      "collective that never matched and mismatched calls");
  analyze->add_option("DIR", dir, "The folder holding the dumps")->required();
  std::string merge_dir;
  std::string merge_output = "merged.json";
  auto* merge = app.add_subcommand(
      "merge",
      "Join the per-rank timelines (trace_rank<R>.json, written under DDP_TRACE=DIR) into one "
      "Chrome/Perfetto trace with the ranks' clocks aligned on rank 0's");
  merge->add_option("DIR", merge_dir, "The folder holding the ranks' traces")->required();
  merge->add_option("-o,--output", merge_output, "The merged trace (default merged.json)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << fmt::format("ddp-trace: error: {} (see 'ddp-trace --help')\n", e.what());
    return kUsageExitCode;
  }
  if (analyze->parsed()) return analyze_command(dir);
  if (merge->parsed()) return merge_command(merge_dir, merge_output);
  return kUsageExitCode;
}
