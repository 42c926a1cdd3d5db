#include "support/multiprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <string>
#include <thread>

#include "net/socket.h"

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
      int code = 0;
      try {
        fn(rank);
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
