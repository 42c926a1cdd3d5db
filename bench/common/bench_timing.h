// Timing helpers shared by the benchmark programs: the median of samples and the wall time of a
// call.
#pragma once

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

// The median (the mean of the middle two for an even count); `values` must not be empty.
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const auto n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Milliseconds that f() took, on the steady clock.
template <class F>
double milliseconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  std::forward<F>(f)();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}
