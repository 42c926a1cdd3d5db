// PollPacer: how a thread that waits for the device passes the time between two polls (an event
// query, the communicator's state), with the least lateness it can have without holding a core
// for long (internal).
//
// The first polls follow each other at once; then the thread yields for up to kYieldFor (another
// runnable thread of the host takes the core; an idle core polls again within microseconds);
// then it sleeps kSleep at a time, with its timer slack lowered to 1 µs. Linux's default slack of
// 50 µs made each short sleep last 50 µs or more, and the sleeps grew to 100 µs: every NCCL call
// was seen done up to ~150 µs after the device finished it, and DDP waits on every bucket's call
// (docs/benchmarks.md, "DDP on a GPU"). bench/micro/poll_pacer_bench on the development VM: a call
// of 100 µs to 1 ms is seen 0.3 µs late (median) instead of 60-78 µs; one of 3 ms, in the sleeping
// phase, 27 µs instead of 48 (the VM's wake-up latency, not the slack, is what remains).
#pragma once

#include <chrono>

namespace ddp::comm::nccl {

class PollPacer {
 public:
  static constexpr int kSpins = 64;
  static constexpr std::chrono::microseconds kYieldFor{2000};
  static constexpr std::chrono::microseconds kSleep{20};

  // Called after a poll that found the condition not yet true.
  void pause();

 private:
  int polls_ = 0;
  std::chrono::steady_clock::time_point yielding_since_{};
};

}  // namespace ddp::comm::nccl
