// The group's watchdog thread: deadlines and stall checks of the blocking call in flight, and
// polling of pending point-to-point operations.
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

void MpiProcessGroup::ensure_watchdog() {
  // On every blocking call: a flag read, not std::call_once's thread-local bookkeeping.
  if (watchdog_started_.load(std::memory_order_acquire)) return;
  std::call_once(watchdog_once_, [this] {
    watchdog_ = std::thread([this, weak = weak_from_this(), destroyed = destroyed_] {
      watchdog_loop(weak, destroyed);
    });
    watchdog_started_.store(true, std::memory_order_release);
  });
}

// Every kWatchdogInterval: the blocking call in flight. Every kP2pPollInterval while
// point-to-point operations are pending (or at once when one is posted): polls them, completing
// them and running their callbacks without a waiter.
void MpiProcessGroup::watchdog_loop(const std::weak_ptr<MpiProcessGroup>& weak,
                                    const std::shared_ptr<std::atomic<bool>>& destroyed_here) {
  constexpr auto kP2pPollInterval = std::chrono::microseconds(500);
  std::uint64_t announced_id = 0;
  auto next_blocking_check = Clock::now() + kWatchdogInterval;
  for (;;) {
    {
      const bool p2p = !p2p_pending_.empty();
      std::unique_lock lock(watch_.mutex);
      watch_.cv.wait_for(lock,
                         p2p ? std::chrono::duration_cast<Clock::duration>(kP2pPollInterval)
                             : std::chrono::duration_cast<Clock::duration>(kWatchdogInterval),
                         [&] { return watch_.stop || watch_.p2p_posted; });
      if (watch_.stop) return;
      watch_.p2p_posted = false;
    }
    {
      // Held while the group is used: a callback run here cannot destroy it meanwhile.
      const std::shared_ptr<MpiProcessGroup> self = weak.lock();
      if (!self) return;
      p2p_pending_.poll_all();
      if (Clock::now() >= next_blocking_check) {
        next_blocking_check = Clock::now() + kWatchdogInterval;
        check_blocking_call(announced_id);
      }
    }
    // Released `self` last: the destructor ran on this thread, which must leave at once.
    if (destroyed_here->load()) return;
  }
}

void MpiProcessGroup::check_blocking_call(std::uint64_t& announced_id) {
  const std::uint64_t id = watch_.id.load(std::memory_order_acquire);
  if (id % 2 == 0) return;  // no call in flight
  std::uint64_t words[4];
  for (int i = 0; i < 4; ++i)
    words[i] = watch_.header[i].load(std::memory_order_relaxed);
  const Clock::time_point deadline{
      Clock::duration(watch_.deadline_ns.load(std::memory_order_relaxed))};
  const milliseconds timeout{watch_.timeout_ms.load(std::memory_order_relaxed)};
  std::atomic_thread_fence(std::memory_order_acquire);
  if (watch_.id.load(std::memory_order_relaxed) != id) return;  // changed while read
  const auto now = Clock::now();
  if (now - (deadline - timeout) < options_.stall_check_after) return;
  Call op;  // for the message
  std::memcpy(&op.header, words, sizeof words);
  op.kind = op.header.kind;
  bool announced = announced_id == id;
  announced_id = id;
  if (const auto problem = stall_problem(op, announced)) {
    queue().dump_flight_recorder(comm::dump_reason(problem->kind()), problem->what());
    MpiRuntime::abort_job(problem->what());
  }
  if (now >= deadline) {
    const std::string text = fmt::format(
        "rank {} of group '{}' (mpi backend): {} did not complete within {} ms: "
        "a rank of the group did not issue it, or is stuck or gone",
        rank(), name(), op.description(), timeout.count());
    queue().dump_flight_recorder("timeout", text);  // before the job ends
    MpiRuntime::abort_job(text);
  }
}

}  // namespace ddp::comm::mpi
