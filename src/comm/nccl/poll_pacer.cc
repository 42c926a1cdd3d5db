#include "comm/nccl/poll_pacer.h"

#include <sys/prctl.h>

#include <thread>

namespace ddp::comm::nccl {
namespace {

// Once per thread: a sleep of kSleep then lasts kSleep and a few microseconds, not kSleep + 50 µs.
// The slack is the thread's own (prctl), so nothing else of the process changes.
void lower_timer_slack_once() {
  thread_local bool lowered = false;
  if (lowered) return;
  lowered = true;
  (void)::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);  // nanoseconds; advice only
}

}  // namespace

void PollPacer::pause() {
  ++polls_;
  if (polls_ <= kSpins) return;
  const auto now = std::chrono::steady_clock::now();
  if (polls_ == kSpins + 1) yielding_since_ = now;
  if (now - yielding_since_ < kYieldFor) {
    std::this_thread::yield();
    return;
  }
  lower_timer_slack_once();
  std::this_thread::sleep_for(kSleep);
}

}  // namespace ddp::comm::nccl
