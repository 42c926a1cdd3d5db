#include "support/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace ddp::test {

Subprocess Subprocess::start(const std::vector<std::string>& argv,
                             const std::map<std::string, std::optional<std::string>>& env) {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");

  // Build argv and envp before fork: the child may only call async-signal-safe functions.
  std::vector<char*> args;
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string::npos) merged[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  for (const auto& [key, value] : env) {
    if (value) {
      merged[key] = *value;
    } else {
      merged.erase(key);
    }
  }
  std::vector<std::string> env_strings;
  for (const auto& [key, value] : merged)
    env_strings.push_back(key + "=" + value);
  std::vector<char*> envp;
  for (auto& s : env_strings)
    envp.push_back(s.data());
  envp.push_back(nullptr);

  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::execvpe(args[0], args.data(), envp.data());
    const char msg[] = "exec failed\n";
    (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also in the parent, so signal_group works at once
  ::close(pipe_fds[1]);
  ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  return Subprocess(pid, pipe_fds[0]);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(other.pid_),
      output_fd_(other.output_fd_),
      output_(std::move(other.output_)),
      reaped_(other.reaped_) {
  other.pid_ = -1;
  other.output_fd_ = -1;
  other.reaped_ = true;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !reaped_) {
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (output_fd_ >= 0) ::close(output_fd_);
}

void Subprocess::signal_group(int sig) const {
  if (pid_ > 0) ::kill(-pid_, sig);
}

void Subprocess::drain(int poll_ms) {
  if (output_fd_ < 0) return;
  pollfd pfd{output_fd_, POLLIN, 0};
  if (::poll(&pfd, 1, poll_ms) <= 0) return;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(output_fd_, buf, sizeof buf);
    if (n > 0) {
      output_.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0) {  // every writer (the child and whatever it started) closed the pipe
      ::close(output_fd_);
      output_fd_ = -1;
    }
    return;
  }
}

const std::string& Subprocess::output_so_far() {
  drain(0);
  return output_;
}

ExitStatus Subprocess::wait(std::chrono::milliseconds timeout) {
  ExitStatus status;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int wstatus = 0;
  for (;;) {
    const pid_t rc = ::waitpid(pid_, &wstatus, WNOHANG);
    if (rc == pid_) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      status.timed_out = true;
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, &wstatus, 0);
      break;
    }
    drain(20);
    if (output_fd_ < 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  reaped_ = true;
  // Collect what is left in the pipe; grandchildren that still hold it must not block us.
  const auto drain_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (output_fd_ >= 0 && std::chrono::steady_clock::now() < drain_deadline)
    drain(20);
  if (WIFEXITED(wstatus)) {
    status.exit_code = WEXITSTATUS(wstatus);
  } else if (WIFSIGNALED(wstatus)) {
    status.signal = WTERMSIG(wstatus);
  }
  status.output = output_;
  return status;
}

std::string built_program(const std::string& name) {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  return (self.parent_path() / name).string();
}

bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string pid_field, comm, state;
  stat >> pid_field >> comm >> state;
  return state != "Z" && state != "X";
}

}  // namespace ddp::test
