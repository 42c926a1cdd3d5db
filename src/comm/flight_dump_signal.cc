#include "comm/flight_dump_signal.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "comm/flight_recorder.h"

namespace ddp::comm {
namespace {

// The write end of the current process's pipe, for the handler (-1: none).
std::atomic<int> g_wake_fd{-1};

void on_sigusr1(int) {
  const int saved = errno;
  const int fd = g_wake_fd.load(std::memory_order_relaxed);
  if (fd >= 0) {
    const char byte = 1;
    [[maybe_unused]] const ssize_t n = ::write(fd, &byte, 1);  // full pipe: a dump is pending
  }
  errno = saved;
}

struct Registry {
  std::mutex mutex;  // held while dumping: a recorder unregisters only between dumps
  std::vector<FlightRecorder*> recorders;
  pid_t thread_pid = 0;  // the process whose dump thread runs (fork leaves the child none)
  bool handler_checked = false;
};

// Never destroyed: the dump thread may still run while static destructors do at exit.
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

void dump_registered(Registry& r) {
  std::lock_guard lock(r.mutex);
  for (FlightRecorder* recorder : r.recorders)
    recorder->dump("signal", {});
}

void dump_thread(int read_fd) {
  for (;;) {
    char buf[64];
    const ssize_t n = ::read(read_fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    dump_registered(registry());
  }
}

// REQUIRES: r.mutex held.
void install_handler(Registry& r) {
  if (!r.handler_checked) {
    r.handler_checked = true;
    struct sigaction current {};
    if (::sigaction(SIGUSR1, nullptr, &current) == 0 && current.sa_handler != on_sigusr1) {
      if (current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO) != 0) {
        std::fprintf(stderr,
                     "ddp: note: SIGUSR1 already has a handler in this program; the flight "
                     "recorder dumps on failures only\n");
        return;
      }
      struct sigaction action {};
      action.sa_handler = on_sigusr1;
      sigemptyset(&action.sa_mask);
      action.sa_flags = SA_RESTART;
      ::sigaction(SIGUSR1, &action, nullptr);
    }
  }
}

// REQUIRES: r.mutex held. Starts this process's dump thread and pipe (again after a fork).
void ensure_thread(Registry& r) {
  const pid_t pid = ::getpid();
  if (r.thread_pid == pid) return;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return;
  // The reader blocks; only the handler's end must never block.
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) & ~O_NONBLOCK);
  const int old = g_wake_fd.exchange(fds[1]);
  if (old >= 0 && r.thread_pid != 0) ::close(old);  // the parent's pipe, inherited over fork
  try {
    std::thread(dump_thread, fds[0]).detach();
  } catch (const std::exception&) {
    g_wake_fd.store(-1);
    ::close(fds[0]);
    ::close(fds[1]);
    return;
  }
  r.thread_pid = pid;
}

}  // namespace

void register_for_signal_dumps(FlightRecorder* recorder) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  ensure_thread(r);
  install_handler(r);
  r.recorders.push_back(recorder);
}

void unregister_for_signal_dumps(FlightRecorder* recorder) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.recorders.erase(std::remove(r.recorders.begin(), r.recorders.end(), recorder),
                    r.recorders.end());
}

bool signal_dumps_installed() {
  struct sigaction current {};
  return ::sigaction(SIGUSR1, nullptr, &current) == 0 && current.sa_handler == on_sigusr1;
}

void dump_all_flight_recorders() {
  dump_registered(registry());
}

}  // namespace ddp::comm
