// ddprun: starts the local workers of a data-parallel job, like torchrun. See docs/ddprun.md.
#include <fmt/format.h>

#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "ddprun/launch_options.h"
#include "ddprun/launcher.h"

int main(int argc, char** argv) {
  using namespace ddp::ddprun;
  std::vector<std::string> args(argv + 1, argv + argc);
  LaunchOptions options;
  try {
    auto parsed = parse_command_line(args, std::cout);
    if (!parsed) return 0;
    options = std::move(*parsed);
  } catch (const UsageError& e) {
    std::cerr << fmt::format("ddprun: error: {} (see 'ddprun --help')\n", e.what());
    return kUsageExitCode;
  }
  try {
    return run_workers(options);
  } catch (const std::exception& e) {
    std::cerr << fmt::format("ddprun: error: {}\n", e.what());
    return kWorkerFailedExitCode;
  }
}
