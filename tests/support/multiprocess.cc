#include "support/multiprocess.h"

#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "net/socket.h"
#include "support/sanitizers.h"

namespace ddp::test {
namespace {

void write_all(int fd, const std::string& text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n <= 0) return;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

std::string read_all_nonblocking(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

// support/throw_recorder.cc, where the test executable has it (every one ddp_add_test makes).
extern "C" const char* ddp_test_last_thrown_exception() __attribute__((weak));

// A rank that crashes says where: the frames go to stderr and, through the error pipe, into the
// test's failure message; then the signal is raised again with its default action, so the parent
// still sees the process killed by it. backtrace_symbols_fd allocates nothing. Not under the
// sanitizers, whose own reports of the same signals say more.
int crash_report_fd = -1;

// Where the faulting instruction is, and every word of the stack above it that points into a
// loaded program or library: when the fault is a jump to a bad address (a call through a dangling
// pointer), the unwinder stops at the signal frame, and the return addresses found here are all
// that says who made the call. The symbolizer (scripts/symbolize_backtraces.py) resolves both.
void report_registers_and_stack(int fd, const siginfo_t* info, const void* context) {
  if (context == nullptr) return;
  const auto& registers = static_cast<const ucontext_t*>(context)->uc_mcontext;
#if defined(__x86_64__)
  void* pc = reinterpret_cast<void*>(registers.gregs[REG_RIP]);
  auto* const* stack = reinterpret_cast<void* const*>(registers.gregs[REG_RSP]);
#elif defined(__aarch64__)
  void* pc = reinterpret_cast<void*>(registers.pc);
  auto* const* stack = reinterpret_cast<void* const*>(registers.sp);
#else
  return;
#endif
  char line[128];
  int length = std::snprintf(line, sizeof line, "faulting instruction %p, fault address %p:\n", pc,
                             info != nullptr ? info->si_addr : nullptr);
  if (length <= 0 || ::write(fd, line, static_cast<std::size_t>(length)) < 0) return;
  ::backtrace_symbols_fd(&pc, 1, fd);
  void* code[48];
  int found = 0;
  for (int word = 0; word < 1024 && found < 48; ++word) {
    Dl_info where{};
    if (::dladdr(stack[word], &where) != 0 && where.dli_fname != nullptr)
      code[found++] = stack[word];
  }
  length = std::snprintf(line, sizeof line, "stack words that point into loaded objects:\n");
  if (length <= 0 || ::write(fd, line, static_cast<std::size_t>(length)) < 0) return;
  ::backtrace_symbols_fd(code, found, fd);
}

// Unused under a sanitizer, which reports crashes itself (install_crash_report).
[[maybe_unused]] void report_crash(int signal_number, siginfo_t* info, void* context) {
  void* frames[64];
  const int count = ::backtrace(frames, 64);
  char head[96];
  const int length =
      std::snprintf(head, sizeof head, "\nrank process crashed: signal %d (%s); backtrace:\n",
                    signal_number, sigabbrev_np(signal_number));
  for (const int fd : {STDERR_FILENO, crash_report_fd}) {
    if (fd < 0 || length <= 0) continue;
    if (::write(fd, head, static_cast<std::size_t>(length)) < 0) continue;
    ::backtrace_symbols_fd(frames, count, fd);
    // A crash while an exception unwinds (a faulting destructor) would hide why it was thrown.
    if (std::uncaught_exceptions() > 0 && ddp_test_last_thrown_exception != nullptr) {
      char line[640];
      const int n = std::snprintf(line, sizeof line, "while an exception propagated: %s\n",
                                  ddp_test_last_thrown_exception());
      if (n > 0 && ::write(fd, line, static_cast<std::size_t>(std::min(n, 639))) < 0) continue;
    }
    // The first fault handled is the first crash; the stack words can only help then.
    if (signal_number != SIGABRT) report_registers_and_stack(fd, info, context);
  }
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

void install_crash_report(int error_fd) {
#if !DDP_TEST_UNDER_ASAN && !DDP_TEST_UNDER_TSAN
  crash_report_fd = error_fd;
  void* warm_up[1];
  ::backtrace(warm_up, 1);  // loads libgcc now: the handler must not be the first caller
  struct sigaction action {};
  action.sa_sigaction = report_crash;
  action.sa_flags = SA_SIGINFO | SA_RESETHAND | SA_NODEFER;
  for (const int signal_number : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT})
    ::sigaction(signal_number, &action, nullptr);
#else
  (void)error_fd;
#endif
}

}  // namespace

std::vector<RankResult> run_ranks(int world_size, const std::function<void(int rank)>& fn,
                                  std::chrono::milliseconds timeout) {
  std::vector<pid_t> pids(world_size, -1);
  std::vector<int> error_fds(world_size, -1);
  for (int rank = 0; rank < world_size; ++rank) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(fds[0]);
      install_crash_report(fds[1]);
      int code = 0;
      // GoogleTest records an EXPECT_* or ASSERT_* that fails in this child in the child's copy
      // of the test's result, which the parent never sees: the failures it adds are this rank's
      // failure, reported as an exception's message would be.
      const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
      const ::testing::TestResult* result = test != nullptr ? test->result() : nullptr;
      const int parts_before = result != nullptr ? result->total_part_count() : 0;
      try {
        fn(rank);
        if (result != nullptr) {
          std::string failures;
          for (int i = parts_before; i < result->total_part_count(); ++i) {
            const ::testing::TestPartResult& part = result->GetTestPartResult(i);
            if (!part.failed()) continue;
            failures += failures.empty() ? "" : "\n";
            failures += std::string(part.file_name() != nullptr ? part.file_name() : "?") + ":" +
                        std::to_string(part.line_number()) + ": " + part.summary();
          }
          if (!failures.empty()) {
            write_all(fds[1], "expectations failed in this rank:\n" + failures);
            code = 1;
          }
        }
      } catch (const std::exception& e) {
        write_all(fds[1], e.what());
        code = 1;
      } catch (...) {
        write_all(fds[1], "unknown exception");
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);  // skip atexit handlers and gtest's teardown in the child
    }
    ::close(fds[1]);
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    pids[rank] = pid;
    error_fds[rank] = fds[0];
  }

  std::vector<RankResult> results(world_size);
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (remaining > 0) {
    for (int rank = 0; rank < world_size; ++rank) {
      if (done[rank]) continue;
      int status = 0;
      if (::waitpid(pids[rank], &status, WNOHANG) != pids[rank]) continue;
      auto& r = results[rank];
      r.rank = rank;
      if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
      r.error = read_all_nonblocking(error_fds[rank]);
      done[rank] = true;
      --remaining;
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      for (int rank = 0; rank < world_size; ++rank) {
        if (done[rank]) continue;
        ::kill(pids[rank], SIGKILL);
        ::waitpid(pids[rank], nullptr, 0);
        auto& r = results[rank];
        r.rank = rank;
        r.timed_out = true;
        r.signal = SIGKILL;
        r.error = read_all_nonblocking(error_fds[rank]);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int fd : error_fds)
    ::close(fd);
  return results;
}

std::string describe(const std::vector<RankResult>& results) {
  std::ostringstream out;
  for (const auto& r : results) {
    out << "\n  rank " << r.rank << ": ";
    if (r.timed_out) {
      out << "timed out (killed)";
    } else if (r.signal != 0) {
      out << "killed by signal " << r.signal << " (" << strsignal(r.signal) << ")";
    } else {
      out << "exit " << r.exit_code;
    }
    if (!r.error.empty()) out << ": " << r.error;
  }
  return out.str();
}

int free_port() {
  // Two calls in a row may return the same port (the first is free again by the second call), and
  // a test that asks for two ports needs two (ddprun refuses --agent-port equal to --master-port):
  // no port is handed out twice in a process.
  static std::mutex mutex;
  static std::set<int> given;
  const std::lock_guard<std::mutex> lock(mutex);
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int port = ddp::net::pick_free_port();
    if (given.insert(port).second) return port;
  }
  return ddp::net::pick_free_port();
}

void set_launcher_environment(int rank, int world, int port, int timeout_seconds) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("DDP_TIMEOUT", std::to_string(timeout_seconds).c_str(), 1);
}

}  // namespace ddp::test
