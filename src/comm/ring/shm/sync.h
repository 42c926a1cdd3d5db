// Synchronisation primitives of the shared-memory domain (internal): futexes on the shared
// mapping, atomic views of its words, and whether a peer process is still alive.
//
// The futexes carry no FUTEX_PRIVATE_FLAG: the waiters live in other processes. A spurious or
// early return of futex_wait is harmless: every caller re-checks its condition.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#include "net/shared_memory.h"

namespace ddp::comm::shm {

// A pause for busy-wait loops.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Sleeps while *word == expected, at most `timeout` (returns at once for a non-positive one).
using net::futex_wait;
using net::futex_wake_all;

inline std::atomic_ref<std::uint32_t> atomic(std::uint32_t& word) {
  return std::atomic_ref<std::uint32_t>(word);
}
inline std::atomic_ref<std::int32_t> atomic(std::int32_t& word) {
  return std::atomic_ref<std::int32_t>(word);
}

// Wrap-safe "counter has reached target" (counters are 32-bit for the futex).
inline bool reached(std::uint32_t counter, std::uint32_t target) {
  return static_cast<std::int32_t>(counter - target) >= 0;
}

// A pidfd of `pid` (readable once the process exits), or -1 where pidfd_open is unavailable.
int open_pidfd(int pid);
// Without a pidfd: whether `pid` runs (a zombie counts as dead).
bool pid_alive(int pid);

}  // namespace ddp::comm::shm
