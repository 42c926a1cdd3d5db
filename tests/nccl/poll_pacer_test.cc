// PollPacer (src/comm/nccl/poll_pacer.h): the waits between polls of the device. Checked on the
// CPU with a condition another thread makes true: the waiter sees it, soon, in each of the
// pacer's phases, and its sleeps run with a timer slack of 1 µs (the thread's own setting).
#include "comm/nccl/poll_pacer.h"

#include <gtest/gtest.h>
#include <sys/prctl.h>

#include <atomic>
#include <chrono>
#include <thread>
#include "support/unity_namespace.h"

namespace ddp::comm::nccl {
namespace {
namespace DDP_UNITY_ID {

using Clock = std::chrono::steady_clock;

// Polls `done` with a pacer; returns how long after `done` became true the poller saw it.
Clock::duration lateness_after(std::chrono::microseconds delay) {
  std::atomic<Clock::rep> set_at{0};
  std::thread setter([&] {
    std::this_thread::sleep_for(delay);
    set_at = Clock::now().time_since_epoch().count();
  });
  PollPacer pacer;
  while (set_at.load() == 0)
    pacer.pause();
  const auto seen = Clock::now();
  setter.join();
  return seen - Clock::time_point(Clock::duration(set_at.load()));
}

TEST(PollPacer, AConditionIsSeenSoonInTheSpinningYieldingAndSleepingPhases) {
  // A loose bound: the machine running the tests is shared; docs/gpu.md has the measured lateness.
  constexpr auto kBound = std::chrono::milliseconds(20);
  for (const auto delay : {std::chrono::microseconds(10), std::chrono::microseconds(500),
                           std::chrono::microseconds(5000)}) {
    EXPECT_LT(lateness_after(delay), kBound) << "set after " << delay.count() << " µs";
  }
}

TEST(PollPacer, SleepsWithAOneMicrosecondTimerSlackOnlyInItsOwnThread) {
  const long before = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  long in_poller = 0;
  std::thread poller([&] {
    // Linux's default, whatever this thread inherited (an earlier test may have run a pacer on
    // the main thread).
    (void)::prctl(PR_SET_TIMERSLACK, 50'000UL, 0UL, 0UL, 0UL);
    PollPacer pacer;
    // Until the pacer has slept (it lowers the slack before its first sleep), with a deadline far
    // past its yielding phase: a loaded machine may preempt the poller for milliseconds (CI).
    const auto until = Clock::now() + PollPacer::kYieldFor + std::chrono::seconds(5);
    while (::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0) != 1000 && Clock::now() < until)
      pacer.pause();
    in_poller = ::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  });
  poller.join();
  EXPECT_EQ(in_poller, 1000) << "the sleeping phase did not lower the poller's timer slack";
  EXPECT_EQ(::prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0), before) << "another thread's slack changed";
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm::nccl
