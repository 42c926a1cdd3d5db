// How late a thread waiting for the device sees that a call finished: PollPacer (the nccl
// backend's waits between polls, src/comm/nccl/poll_pacer.h) against the back-off it replaced
// (spin 64, yield 64, then sleeps growing to 100 µs), in alternated trials. Another thread makes
// the condition true after each delay (the "call"), the waiter polls an atomic as it would poll
// the call's CUDA event. Needs no GPU: the lateness is the waiter's alone.
//
//   poll_pacer_bench [--trials 200] [--delays 100,300,1000,3000]   (µs)
// Prints, per delay, the median and 90th percentile lateness of each, in µs.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "comm/nccl/poll_pacer.h"

namespace {

using Clock = std::chrono::steady_clock;

// The nccl backend's waits before PollPacer (kept here as the baseline).
void previous_back_off(int idle) {
  constexpr int kSpins = 64;
  constexpr int kYields = 64;
  if (idle < kSpins) return;
  if (idle < kSpins + kYields) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(
      std::chrono::microseconds(std::min(100, idle - kSpins - kYields + 1)));
}

template <class Wait>
double lateness_us(std::chrono::microseconds delay, Wait wait) {
  std::atomic<Clock::rep> done_at{0};
  std::thread call([&] {
    std::this_thread::sleep_for(delay);
    done_at = Clock::now().time_since_epoch().count();
  });
  wait(done_at);
  const auto seen = Clock::now();
  call.join();
  return std::chrono::duration<double, std::micro>(
             seen - Clock::time_point(Clock::duration(done_at.load())))
      .count();
}

double quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Lateness of PollPacer against the previous back-off"};
  int trials = 200;
  std::vector<int> delays{100, 300, 1000, 3000};
  app.add_option("--trials", trials, "trials of each per delay")->check(CLI::PositiveNumber);
  app.add_option("--delays", delays, "call durations in µs")->delimiter(',');
  CLI11_PARSE(app, argc, argv);

  const auto with_pacer = [](std::atomic<Clock::rep>& done_at) {
    ddp::comm::nccl::PollPacer pacer;
    while (done_at.load() == 0)
      pacer.pause();
  };
  const auto with_previous = [](std::atomic<Clock::rep>& done_at) {
    for (int idle = 0; done_at.load() == 0; ++idle)
      previous_back_off(idle);
  };
  std::printf("%10s %16s %16s %16s %16s\n", "call_us", "previous_p50_us", "previous_p90_us",
              "pacer_p50_us", "pacer_p90_us");
  for (const int delay : delays) {
    std::vector<double> previous;
    std::vector<double> pacer;
    for (int t = 0; t < trials; ++t) {
      const std::chrono::microseconds d(delay);
      if (t % 2 == 0) previous.push_back(lateness_us(d, with_previous));
      pacer.push_back(lateness_us(d, with_pacer));
      if (t % 2 == 1) previous.push_back(lateness_us(d, with_previous));
    }
    std::printf("%10d %16.1f %16.1f %16.1f %16.1f\n", delay, quantile(previous, 0.5),
                quantile(previous, 0.9), quantile(pacer, 0.5), quantile(pacer, 0.9));
  }
  return 0;
}
