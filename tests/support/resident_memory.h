// What this process holds in memory, from /proc/self/status, for tests that bound a peak:
//
//   if (status_mib("VmHWM") < 0) GTEST_SKIP() << "no VmHWM";
//   const double added = peak_added_mib([&] { optimizer.step(); });
#pragma once

#include <fstream>
#include <functional>
#include <string>

#include "support/sanitizers.h"

namespace ddp::test {

// Bounds on memory are for the plain build; AddressSanitizer's redzones, shadow and quarantine
// multiply what the same work holds, so a bound is scaled by this under it.
inline constexpr double kSanitizerMemoryFactor = DDP_TEST_UNDER_ASAN ? 4.0 : 1.0;

// A "Field:   N kB" line of /proc/self/status in MiB, or -1 where the kernel gives none.
inline double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return -1.0;
}

// The resident memory `call` adds at its peak, in MiB: the high-water mark (VmHWM, reset through
// clear_refs) over the resident set before it.
inline double peak_added_mib(const std::function<void()>& call) {
  std::ofstream("/proc/self/clear_refs") << "5";
  const double before = status_mib("VmRSS");
  call();
  return status_mib("VmHWM") - before;
}

}  // namespace ddp::test
