// ddp-trace: tools for what ddp records while a job runs (docs/observability.md).
//   ddp-trace analyze DIR   reads every rank's flight recorder dump in DIR and says which rank is
//                           behind, which collective never matched, and where calls disagree.
// Exit codes: 0 nothing wrong found, 1 a problem found, 2 bad usage or unreadable dumps.
#include <iostream>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "ddp-trace/analyze.h"
#include "ddp-trace/flight_dump.h"

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ddp-trace: reads what ddp records while a job runs.\n"
      "  ddp-trace analyze DIR    which rank is behind, which collective never matched\n"
      "Exit codes: 0 nothing wrong found, 1 a problem found, 2 bad usage or unreadable dumps."};
  app.require_subcommand(1);
  std::string dir;
  auto* analyze = app.add_subcommand(
      "analyze",
      "Read every rank's flight recorder dump (ddp_flight_*.json, written on a timeout, a "
      "failure, a mismatch or SIGUSR1 into DDP_DUMP_DIR) and name the rank that is behind, the "
      "collective that never matched and mismatched calls");
  analyze->add_option("DIR", dir, "The folder holding the dumps")->required();
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
  return kUsageExitCode;
}
