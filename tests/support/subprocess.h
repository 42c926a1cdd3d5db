// Subprocess: runs a program for a test, captures its output, never outlives its deadline.
//
//   auto p = Subprocess::start({"ddprun", "--nproc-per-node", "2", "/bin/true"});
//   auto r = p.wait(std::chrono::seconds(30));   // kills the process group at the deadline
//   EXPECT_EQ(r.exit_code, 0) << r.output;
//
// The child runs in its own process group so a test can signal it and everything it started.
// stdout and stderr are merged into `output`.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ddp::test {

struct ExitStatus {
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;      // the signal that killed it, 0 otherwise
  bool timed_out = false;
  std::string output;  // stdout and stderr, merged
};

class Subprocess {
 public:
  // `env` entries are added to (or replace in) the current environment; a value of std::nullopt
  // removes the variable.
  static Subprocess start(const std::vector<std::string>& argv,
                          const std::map<std::string, std::optional<std::string>>& env = {});
  Subprocess(Subprocess&&) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  ~Subprocess();  // kills the process group if still running

  pid_t pid() const { return pid_; }
  // Sends `sig` to the child's process group.
  void signal_group(int sig) const;
  // Output read so far (also drains the pipe without blocking).
  const std::string& output_so_far();
  // Waits for exit; at the deadline kills the group with SIGKILL and sets timed_out.
  ExitStatus wait(std::chrono::milliseconds timeout);

 private:
  Subprocess(pid_t pid, int output_fd) : pid_(pid), output_fd_(output_fd) {}
  void drain(int poll_ms);

  pid_t pid_ = -1;
  int output_fd_ = -1;
  std::string output_;
  bool reaped_ = false;
};

// Path of a program built by this project (in the build tree's bin/ folder).
std::string built_program(const std::string& name);

// True when a process with this pid exists (and is not a zombie).
bool process_alive(pid_t pid);

}  // namespace ddp::test
