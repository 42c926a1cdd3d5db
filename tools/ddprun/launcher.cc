#include "ddprun/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ddp/error.h"
#include "ddp/launch/job_secret.h"
#include "ddp/store/tcp_store.h"
#include "ddprun/env_tuning.h"
#include "ddprun/line_assembler.h"
#include "ddprun/restart_round.h"
#include "ddprun/worker_env.h"

namespace ddp::ddprun {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// After SIGKILL, processes die within milliseconds unless stuck in the kernel; this bounds the
// wait for such stragglers so that ddprun itself never hangs.
constexpr milliseconds kKillWait{5000};
// How much one pipe may deliver per loop turn, so that a chatty worker cannot starve the others
// or delay the handling of signals.
constexpr std::size_t kReadChunk = 64 * 1024;
// Upper bound on what is read from one pipe once its writer is known to be gone (a descendant
// that still holds the pipe open could otherwise keep the final drain busy forever).
constexpr std::size_t kFinalDrainLimit = 8 * 1024 * 1024;
// When the first failure looks like a consequence (an exit code, SIGABRT, SIGPIPE), how long
// ddprun waits for a peer's death by signal, the likely cause, before it blames the first:
// a rank whose peer was killed notices within milliseconds (a closed socket, a pidfd) and can
// be reaped before the killed rank when both exit within one turn of the loop.
constexpr milliseconds kBlameSettle{500};
// Elastic jobs: how long agent 0 accepts a member's heartbeat standing still before it calls the
// member's host gone (every agent beats about every 500 ms, also while it stops its workers).
constexpr milliseconds kElasticSilence{10'000};

// Error texts say what failed; whoever prints one says who (main's "ddprun: error: ", note()'s
// "ddprun: "), so that the prefix comes once.
[[noreturn]] void throw_errno(const std::string& what) {
  const int err = errno;
  std::string hint;
  if (err == EMFILE || err == ENFILE) {
    rlimit limit{};
    ::getrlimit(RLIMIT_NOFILE, &limit);
    hint = fmt::format(
        " (out of file descriptors: ddprun holds two or more per worker, and may open {}; "
        "raise ulimit -n)",
        limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                        : std::to_string(limit.rlim_cur));
  }
  throw Error(fmt::format("{} failed: {}{}", what, std::strerror(err), hint));
}

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

// Writes whole buffers to ddprun's stdout or stderr. A closed reader (EPIPE, e.g. `| head`)
// must not kill ddprun while workers run, so that stream's output is dropped from then on.
class OutputSink {
 public:
  explicit OutputSink(int fd) : fd_(fd) {}

  void write(std::string& text) {
    std::size_t done = 0;
    while (!broken_ && done < text.size()) {
      const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && errno == EAGAIN) {
        // Inherited a non-blocking descriptor: wait until the reader catches up.
        pollfd pfd{fd_, POLLOUT, 0};
        ::poll(&pfd, 1, 1000);
      } else {
        broken_ = true;
      }
    }
    text.clear();
  }

 private:
  int fd_;
  bool broken_ = false;
};

// One end of a worker's stdout or stderr pipe, and where what it carries goes: whole lines to
// the console (unless --redirects or --local-ranks-filter keep it off), the bytes as written to
// its --log-dir file.
struct Stream {
  int fd = -1;
  OutputSink* sink = nullptr;  // nullptr: not shown on the console
  LineAssembler lines{""};
  int file_fd = -1;
  std::string file_path;
};

struct Worker {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  int wait_status = 0;
  Stream out;
  Stream err;
};

// kRestartRequested: another node moved the job to the next restart round (restart_round.h).
enum class OutcomeKind { kSucceeded, kWorkerFailed, kSignalled, kRestartRequested };

struct Outcome {
  OutcomeKind kind = OutcomeKind::kSucceeded;
  int rank = -1;                    // kWorkerFailed: the rank blamed (see blame_class)
  int wait_status = 0;              // kWorkerFailed
  int signal = 0;                   // kSignalled
  std::vector<std::string> others;  // kWorkerFailed: how the other failed ranks ended
  // kWorkerFailed by a rank still running --timeout after another exited with 0 (each such rank
  // was named already): how it failed, instead of its wait status.
  std::string how;
};

// How the blamed rank of a kWorkerFailed outcome failed: "exited with code 3", "still running ...".
std::string failure_how(const Outcome& outcome) {
  return outcome.how.empty() ? describe_wait_status(outcome.wait_status) : outcome.how;
}

// How likely a failure is the cause of a job's failure rather than its consequence: a death by
// signal (SIGKILL from an operator or the OOM killer, SIGSEGV, ...) is a cause; an exit code is
// what a rank whose peer died does (CommError), and SIGABRT or SIGPIPE what an uncaught error or
// a write to a dead peer does. Higher is more likely the cause.
int blame_class(int wait_status) {
  if (!WIFSIGNALED(wait_status)) return 1;
  const int sig = WTERMSIG(wait_status);
  return sig == SIGABRT || sig == SIGPIPE ? 1 : 2;
}

class Supervisor {
 public:
  explicit Supervisor(const LaunchOptions& options);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  int run();

 private:
  // The round loop of an elastic job (--nnodes MIN:MAX): rounds closed by agent 0 with the nodes
  // that are there; membership changes restart the workers without costing a restart.
  int run_elastic();
  int run_elastic_rounds();
  // This node's index in the current round (static: --node-rank).
  int node_rank() const { return placement_ ? placement_->node_rank : options_.node_rank; }
  // Starts every local worker; on failure to exec one, reports it and returns false.
  bool start_workers(int restart_count);
  pid_t spawn(Worker& worker, const std::vector<std::string>& env_strings, int restart_count);
  // Runs the event loop until every worker succeeded, one failed, ddprun got a signal, or (whole-
  // job restarts) the job moved past `round`.
  Outcome supervise(int round);
  // Whole-job restarts, after this node's workers all succeeded in `round`: waits until every
  // node's did (true) or the job moved to another round (false). Returns a signal ddprun got.
  std::optional<int> await_other_nodes(int round, bool& all_succeeded);
  // Creates rounds_ when the job spans nodes and may restart.
  void start_restart_rounds();
  // Where node 0 serves the restart rounds, as the workers' store listens (src/init/rendezvous.cc,
  // docs/security.md): --agent-listen-addr, else DDP_STORE_LISTEN_ADDR, else --master-addr's
  // interface only; a host name that resolves to loopback addresses only (Debian's 127.0.1.1 for
  // the host's own name) means every interface, since the other nodes could never reach it.
  std::string agent_listen_host() const;
  std::unique_ptr<RestartRounds> make_rounds(const std::string& secret, Milliseconds silence) const;
  // Asks every process ddprun started to stop with `first_signal`, waits up to the grace period,
  // kills what is left, and reaps everything. Returns the signal ddprun received meanwhile, if any.
  std::optional<int> stop_everything(int first_signal, std::optional<int> already_signalled);

  // Reads pending signals; passes SIGUSR1 on to the workers; returns a terminating one
  // (SIGINT/SIGTERM/SIGHUP) if there was one.
  std::optional<int> read_signals();
  // Sends SIGUSR1 to every running worker that catches it (a ddp process group's flight-recorder
  // handler); one that does not would die of it, so it is skipped and named.
  void forward_dump_request();
  // Reaps every exited child and, with `failure`, keeps the rank to blame: the first failure of
  // the highest blame_class. Returns false when ddprun has no children left at all.
  bool reap_children(Outcome* failure);
  // After a failure of blame_class 1: waits up to kBlameSettle for a death by signal among the
  // running workers (see kBlameSettle). Returns a terminating signal ddprun got meanwhile.
  std::optional<int> settle_blame(Outcome& failure);
  void poll_once(int timeout_ms);
  // Once a worker exited with 0, the others get the job's timeout (DDP_TIMEOUT) to finish too: a
  // rank stopped (SIGSTOP) or stuck after its peers finished would hold ddprun forever. Returns a
  // kWorkerFailed outcome naming every rank still running after it, or nothing.
  std::optional<Outcome> check_stragglers(Clock::time_point now);
  void pump(Stream& stream, std::size_t limit);
  void close_stream(Stream& stream);
  void write_file(Stream& stream, std::string_view data);
  void drain_and_close_all();
  // Sends `sig` to every process ddprun started that may still run, skipping those in `already`.
  void signal_all(int sig, std::set<pid_t>& already);
  std::vector<pid_t> direct_children() const;
  Worker* find_worker(pid_t pid);
  void note(const std::string& line);
  // Says which rank failed and how (and which others failed with it); returns "rank R <how>".
  std::string note_worker_failure(const Outcome& outcome);

  const LaunchOptions& options_;
  int master_port_ = 0;
  int cpu_count_ = 1;
  bool same_session_ = false;  // DDP_LAUNCHER_SAME_SESSION=1: workers stay in ddprun's session
  Environment base_env_;
  Environment tuning_;  // added to every worker's environment (env_tuning.h)
  sigset_t original_mask_{};
  sigset_t handled_{};
  struct sigaction original_sigpipe_ {};
  int signal_fd_ = -1;
  int dev_null_ = -1;
  OutputSink stdout_sink_{STDOUT_FILENO};
  OutputSink stderr_sink_{STDERR_FILENO};
  std::vector<Worker> workers_;
  std::unique_ptr<RestartRounds> rounds_;    // whole-job restarts (nnodes > 1, max_restarts > 0)
  std::optional<RoundPlacement> placement_;  // elastic jobs: this node's place in the round
  std::vector<pollfd> pollfds_;
  std::string pending_;  // scratch for assembled lines
  // The first worker of this attempt that exited with 0, and when (check_stragglers).
  int first_done_rank_ = -1;
  Clock::time_point first_done_at_{};
};

Supervisor::Supervisor(const LaunchOptions& options) : options_(options) {
  cpu_count_ = usable_cpu_count();
  base_env_ = current_environment();
  if (options.env_tuning) tuning_ = choose_env_tuning(base_env_);
  if (const auto it = base_env_.find("DDP_LAUNCHER_SAME_SESSION"); it != base_env_.end()) {
    if (it->second != "0" && it->second != "1") {
      throw ConfigError(fmt::format(
          "DDP_LAUNCHER_SAME_SESSION='{}' is neither 1 (keep the workers in ddprun's process "
          "session, a measurement aid) nor 0 (each worker in its own session, the default)",
          it->second));
    }
    same_session_ = it->second == "1";
  }
  master_port_ = options.master_port != 0 ? options.master_port : pick_free_port();

  sigemptyset(&handled_);
  sigaddset(&handled_, SIGCHLD);
  // SIGUSR1 asks every worker for a flight-recorder dump (docs/observability.md): ddprun passes
  // it on to each worker's process group and goes on.
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) {
    // A signal ignored when ddprun started (nohup, `cmd &` in a script) stays ignored, for ddprun
    // as for its workers, which inherit that disposition.
    struct sigaction current {};
    ::sigaction(sig, nullptr, &current);
    if (current.sa_handler != SIG_IGN) sigaddset(&handled_, sig);
  }
  if (::sigprocmask(SIG_BLOCK, &handled_, &original_mask_) != 0) throw_errno("sigprocmask");
  signal_fd_ = ::signalfd(-1, &handled_, SFD_NONBLOCK | SFD_CLOEXEC);
  if (signal_fd_ < 0) throw_errno("signalfd");
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &original_sigpipe_);
  dev_null_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (dev_null_ < 0) throw_errno("open /dev/null");
  // Orphans of our workers (a daemon a worker started) become our children, so none survives us.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
}

Supervisor::~Supervisor() {
  // Only reached with workers alive when an exception escaped: leave nothing behind.
  for (const Worker& worker : workers_) {
    if (worker.running) ::kill(-worker.pid, SIGKILL);
  }
  for (Worker& worker : workers_) {
    close_stream(worker.out);
    close_stream(worker.err);
  }
  while (::waitpid(-1, nullptr, WNOHANG) > 0) {
  }
  if (dev_null_ >= 0) ::close(dev_null_);
  if (signal_fd_ >= 0) ::close(signal_fd_);
  ::sigaction(SIGPIPE, &original_sigpipe_, nullptr);
  ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
}

void Supervisor::note(const std::string& line) {
  std::string text = fmt::format("ddprun: {}\n", line);
  stderr_sink_.write(text);
}

Worker* Supervisor::find_worker(pid_t pid) {
  for (Worker& worker : workers_) {
    if (worker.pid == pid) return &worker;
  }
  return nullptr;
}

pid_t Supervisor::spawn(Worker& worker, const std::vector<std::string>& env_strings,
                        int restart_count) {
  // The log files first: one that cannot be opened stops the job before this worker starts.
  std::string file_paths[2];
  int file_fds[2] = {-1, -1};
  if (options_.log_dir.enabled()) {
    const char* names[2] = {"stdout.log", "stderr.log"};
    for (int i = 0; i < 2; ++i) {
      file_paths[i] = options_.log_dir.rank_dir(restart_count, worker.global_rank) + "/" + names[i];
      try {
        file_fds[i] = options_.log_dir.open_file(restart_count, worker.global_rank, names[i]);
      } catch (const ConfigError&) {
        if (i == 1) ::close(file_fds[0]);
        throw;
      }
    }
  }
  int out_pipe[2];
  int err_pipe[2];
  int exec_error_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");
  if (::pipe2(exec_error_pipe, O_CLOEXEC) != 0) throw_errno("pipe2");

  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(options_.program.c_str()));
  for (const auto& arg : options_.args)
    argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (const auto& entry : env_strings)
    envp.push_back(const_cast<char*>(entry.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = ::getpid();
  const bool same_session = same_session_;

  const pid_t pid = ::fork();
  if (pid < 0) {
    const int error = errno;
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], exec_error_pipe[0],
                   exec_error_pipe[1], file_fds[0], file_fds[1]}) {
      ::close(fd);
    }
    errno = error;
    throw_errno("fork");
  }
  if (pid == 0) {
    // Its own process session (and so its own process group, whose id is its pid): the kernel's
    // autogroup scheduler shares the CPU between sessions, so workers left in the caller's session
    // share one slice of it against every other session of a loaded machine (docs/ddprun.md,
    // "Process sessions"). DDP_LAUNCHER_SAME_SESSION=1 keeps the caller's session (a measurement
    // aid for bench/probes/launcher_under_load.py).
    if (same_session || ::setsid() < 0) ::setpgid(0, 0);
    // If ddprun is killed outright (SIGKILL), take the worker down with it rather than orphan it.
    // The signal follows the death of the thread that forked: ddprun forks from its main thread,
    // which lives as long as ddprun (run_workers' contract).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // ddprun died before prctl took effect
    ::sigaction(SIGPIPE, &original_sigpipe_, nullptr);
    ::sigprocmask(SIG_SETMASK, &original_mask_, nullptr);
    ::dup2(dev_null_, STDIN_FILENO);
    ::dup2(out_pipe[1], STDOUT_FILENO);
    ::dup2(err_pipe[1], STDERR_FILENO);
    ::execve(options_.program_path.c_str(), argv.data(), envp.data());
    const int error = errno;
    (void)!::write(exec_error_pipe[1], &error, sizeof error);
    ::_exit(127);
  }
  // Not with setsid: a process that is a group leader already cannot start a session. Either way
  // the child has its group once exec succeeded or failed, which is awaited below before anything
  // signals it.
  if (same_session) ::setpgid(pid, pid);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  ::close(exec_error_pipe[1]);
  ::fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
  ::fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);

  // --no-prefix keeps lines whole (two workers' JSON lines must not mix) but adds no byte.
  const std::string prefix =
      options_.prefix_output ? fmt::format("[{}] ", worker.global_rank) : std::string();
  const auto ending = options_.prefix_output ? LineAssembler::Ending::kAddNewline
                                             : LineAssembler::Ending::kVerbatim;
  worker.pid = pid;
  worker.running = true;
  worker.wait_status = 0;
  const auto make_stream = [&](int fd, int stream_bit, OutputSink& sink, int file) {
    return Stream{fd, options_.output.to_console(worker.local_rank, stream_bit) ? &sink : nullptr,
                  LineAssembler(prefix, LineAssembler::kDefaultMaxLine, ending), file_fds[file],
                  file_paths[file]};
  };
  worker.out = make_stream(out_pipe[0], kStdout, stdout_sink_, 0);
  worker.err = make_stream(err_pipe[0], kStderr, stderr_sink_, 1);

  // The pipe closes on a successful exec (CLOEXEC) or carries errno when exec failed.
  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_error_pipe[0], &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  ::close(exec_error_pipe[0]);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) {
    note(fmt::format("cannot start rank {}: executing '{}' failed: {}", worker.global_rank,
                     options_.program_path, std::strerror(exec_errno)));
    return -1;
  }
  return pid;
}

bool Supervisor::start_workers(int restart_count) {
  std::string dump_dir;
  if (options_.log_dir.enabled()) {
    dump_dir = options_.log_dir.attempt_dir(restart_count);
    std::error_code ec;
    if (std::filesystem::exists(dump_dir, ec)) {
      note(fmt::format("replacing the logs of an earlier run in {}", dump_dir));
    }
    note(fmt::format("writing the workers' output to {}/<rank>/{{stdout,stderr}}.log", dump_dir));
  }
  workers_.clear();
  workers_.resize(static_cast<std::size_t>(options_.nproc_per_node));
  for (int local_rank = 0; local_rank < options_.nproc_per_node; ++local_rank) {
    Worker& worker = workers_[static_cast<std::size_t>(local_rank)];
    worker.local_rank = local_rank;
    worker.global_rank =
        placement_ ? placement_->first_rank + local_rank : options_.global_rank(local_rank);
    Environment env = base_env_;
    apply_worker_variables(env, options_,
                           {.local_rank = local_rank,
                            .restart_count = restart_count,
                            .master_port = master_port_,
                            .cpu_count = cpu_count_,
                            .dump_dir = dump_dir,
                            .placement = placement_});
    env.insert(tuning_.begin(), tuning_.end());  // never replaces a variable already there
    if (spawn(worker, to_envp_strings(env), restart_count) < 0) return false;
  }
  return true;
}

std::optional<int> Supervisor::read_signals() {
  std::optional<int> terminating;
  signalfd_siginfo info{};
  for (;;) {
    const ssize_t n = ::read(signal_fd_, &info, sizeof info);
    if (n != static_cast<ssize_t>(sizeof info)) break;  // EAGAIN: nothing more pending
    const int sig = static_cast<int>(info.ssi_signo);
    if (sig == SIGUSR1) {
      forward_dump_request();
      continue;
    }
    if (sig != SIGCHLD && !terminating) terminating = sig;
  }
  return terminating;
}

// Whether `pid` has a handler for `sig`: the SigCgt mask of /proc/PID/status.
bool catches_signal(pid_t pid, int sig) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("SigCgt:", 0) == 0) {
      const unsigned long long mask = std::stoull(line.substr(7), nullptr, 16);
      return (mask >> (sig - 1)) & 1ULL;
    }
  }
  return false;
}

void Supervisor::forward_dump_request() {
  std::vector<int> sent, skipped;
  for (const auto& worker : workers_) {
    if (!worker.running) continue;
    if (catches_signal(worker.pid, SIGUSR1) && ::kill(worker.pid, SIGUSR1) == 0) {
      sent.push_back(worker.global_rank);
    } else {
      skipped.push_back(worker.global_rank);
    }
  }
  note(fmt::format("SIGUSR1 passed on to rank(s) [{}] for flight-recorder dumps{}",
                   fmt::join(sent, ", "),
                   skipped.empty() ? std::string()
                                   : fmt::format("; not to rank(s) [{}], which do not handle it "
                                                 "(no ddp process group yet) and would die of it",
                                                 fmt::join(skipped, ", "))));
}

bool Supervisor::reap_children(Outcome* failure) {
  for (;;) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid == 0) return true;
    if (pid < 0) return errno != ECHILD;
    Worker* worker = find_worker(pid);
    if (worker == nullptr) continue;  // an orphan of a worker, reparented to us: just reap it
    worker->running = false;
    worker->wait_status = status;
    // What the worker wrote before exiting is already in its pipes: relay it before any report.
    pump(worker->out, kFinalDrainLimit);
    pump(worker->err, kFinalDrainLimit);
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (!failed || failure == nullptr) continue;
    if (failure->kind == OutcomeKind::kSucceeded) {
      failure->kind = OutcomeKind::kWorkerFailed;
    } else if (blame_class(status) > blame_class(failure->wait_status)) {
      failure->others.push_back(
          fmt::format("rank {} {}", failure->rank, describe_wait_status(failure->wait_status)));
    } else {
      failure->others.push_back(
          fmt::format("rank {} {}", worker->global_rank, describe_wait_status(status)));
      continue;
    }
    failure->rank = worker->global_rank;
    failure->wait_status = status;
  }
}

std::optional<int> Supervisor::settle_blame(Outcome& failure) {
  const auto deadline = Clock::now() + kBlameSettle;
  while (blame_class(failure.wait_status) < 2 && Clock::now() < deadline &&
         std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    poll_once(static_cast<int>(std::clamp<long long>(left, 0, 50)));
    if (const std::optional<int> sig = read_signals()) return sig;
    reap_children(&failure);
  }
  return std::nullopt;
}

void Supervisor::pump(Stream& stream, std::size_t limit) {
  char buffer[kReadChunk];
  std::size_t total = 0;
  while (stream.fd >= 0 && total < limit) {
    const ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
    if (n > 0) {
      total += static_cast<std::size_t>(n);
      const std::string_view data(buffer, static_cast<std::size_t>(n));
      write_file(stream, data);
      if (stream.sink != nullptr) {
        stream.lines.feed(data, pending_);
        stream.sink->write(pending_);
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    close_stream(stream);  // EOF (every writer closed it) or a read error
  }
}

void Supervisor::write_file(Stream& stream, std::string_view data) {
  std::size_t done = 0;
  while (stream.file_fd >= 0 && done < data.size()) {
    const ssize_t n = ::write(stream.file_fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      // A full disk must not stop the job: say so once, and keep relaying to the console.
      note(fmt::format("cannot write '{}': {}; the rest of this stream is not logged",
                       stream.file_path, n < 0 ? std::strerror(errno) : "no progress"));
      ::close(stream.file_fd);
      stream.file_fd = -1;
    }
  }
}

void Supervisor::close_stream(Stream& stream) {
  if (stream.file_fd >= 0) {
    ::close(stream.file_fd);
    stream.file_fd = -1;
  }
  if (stream.fd < 0) return;
  ::close(stream.fd);
  stream.fd = -1;
  // A last line without a newline is still a line.
  stream.lines.finish(pending_);
  if (stream.sink != nullptr) stream.sink->write(pending_);
}

void Supervisor::drain_and_close_all() {
  for (Worker& worker : workers_) {
    pump(worker.out, kFinalDrainLimit);
    pump(worker.err, kFinalDrainLimit);
    close_stream(worker.out);
    close_stream(worker.err);
  }
}

void Supervisor::poll_once(int timeout_ms) {
  pollfds_.clear();
  pollfds_.push_back({signal_fd_, POLLIN, 0});
  std::vector<Stream*> streams;
  for (Worker& worker : workers_) {
    for (Stream* stream : {&worker.out, &worker.err}) {
      if (stream->fd < 0) continue;
      pollfds_.push_back({stream->fd, POLLIN, 0});
      streams.push_back(stream);
    }
  }
  const int ready = ::poll(pollfds_.data(), pollfds_.size(), timeout_ms);
  if (ready < 0) {
    if (errno == EINTR) return;
    throw_errno("poll");
  }
  for (std::size_t i = 1; i < pollfds_.size(); ++i) {
    if (pollfds_[i].revents != 0) pump(*streams[i - 1], kReadChunk);
  }
}

std::vector<pid_t> Supervisor::direct_children() const {
  // ddprun is single-threaded, so its one task lists all of its children.
  std::vector<pid_t> children;
  std::ifstream list(fmt::format("/proc/self/task/{}/children", ::getpid()));
  pid_t pid = 0;
  while (list >> pid)
    children.push_back(pid);
  return children;
}

void Supervisor::signal_all(int sig, std::set<pid_t>& already) {
  // `already` holds pids (positive) and process groups (negative) that got `sig`: each is asked
  // once, because a worker's handler may not expect the same request twice.
  // A stopped process (SIGSTOP, a debugger's detach, ^Z) handles no signal until it is continued:
  // SIGCONT follows every request to stop, so that a worker's SIGTERM handler runs.
  const auto send = [sig](pid_t target) {
    ::kill(target, sig);
    if (sig != SIGKILL) ::kill(target, SIGCONT);
  };
  const auto signal_group = [&](pid_t group) {
    if (group > 0 && group != ::getpgrp() && already.insert(-group).second) send(-group);
  };
  for (const Worker& worker : workers_) {
    // Only while the leader is unreaped: until then its pid, hence the group id, cannot be reused
    // by an unrelated process. What the group holds after that is reached through ddprun's
    // children below, since orphans are reparented to ddprun.
    if (worker.running) signal_group(worker.pid);
  }
  for (const pid_t pid : direct_children()) {
    if (find_worker(pid) != nullptr) continue;
    // A reparented descendant: itself, and the group it is in (its worker's, or its own after
    // setsid), which holds what it started.
    if (already.insert(pid).second) send(pid);
    signal_group(::getpgid(pid));
  }
}

std::string Supervisor::note_worker_failure(const Outcome& outcome) {
  const std::string what = fmt::format("rank {} {}", outcome.rank, failure_how(outcome));
  if (!outcome.how.empty()) return what;  // named by check_stragglers already
  note(fmt::format("{}; stopping the other workers", what));
  if (!outcome.others.empty()) {
    note(fmt::format("also failed (likely in consequence): {}", fmt::join(outcome.others, "; ")));
  }
  return what;
}

std::optional<Outcome> Supervisor::check_stragglers(Clock::time_point now) {
  if (first_done_rank_ < 0) {
    for (const Worker& worker : workers_) {
      if (!worker.running && WIFEXITED(worker.wait_status) &&
          WEXITSTATUS(worker.wait_status) == 0) {
        first_done_rank_ = worker.global_rank;
        first_done_at_ = now;
        break;
      }
    }
    return std::nullopt;
  }
  if (now < first_done_at_ + options_.timeout) return std::nullopt;
  Outcome outcome{.kind = OutcomeKind::kWorkerFailed};
  const std::string how =
      fmt::format("still running {:g} s after rank {} finished",
                  std::chrono::duration<double>(options_.timeout).count(), first_done_rank_);
  for (const Worker& worker : workers_) {
    if (!worker.running) continue;
    note(fmt::format("rank {} (pid {}) {} (DDP_TIMEOUT); stopping it", worker.global_rank,
                     worker.pid, how));
    if (outcome.rank < 0) {
      outcome.rank = worker.global_rank;
      outcome.how = how;
    } else {
      outcome.others.push_back(fmt::format("rank {} {}", worker.global_rank, how));
    }
  }
  if (outcome.rank < 0) return std::nullopt;
  return outcome;
}

Outcome Supervisor::supervise(int round) {
  Outcome outcome;
  first_done_rank_ = -1;
  for (;;) {
    // The timeout is only a safety net; SIGCHLD and output wake the loop. With whole-job
    // restarts it is also how often the store's round is looked at.
    poll_once(rounds_ ? 200 : 1000);
    const std::optional<int> sig = read_signals();
    reap_children(&outcome);
    if (sig) return Outcome{.kind = OutcomeKind::kSignalled, .signal = *sig};
    if (outcome.kind != OutcomeKind::kWorkerFailed) {
      if (auto stragglers = check_stragglers(Clock::now())) return *std::move(stragglers);
    }
    if (rounds_ && outcome.kind != OutcomeKind::kWorkerFailed) {
      if (const int silent = rounds_->beat(); silent >= 0) {
        rounds_->report_failure(round, fmt::format("{}'s ddprun stopped responding (no heartbeat)",
                                                   rounds_->describe_node(silent)));
      }
      if (rounds_->elastic() && options_.serves_rounds()) rounds_->admit_waiting(round);
      if (rounds_->current_round() > round) return Outcome{.kind = OutcomeKind::kRestartRequested};
    }
    if (outcome.kind == OutcomeKind::kWorkerFailed) {
      if (const auto settle_sig = settle_blame(outcome)) {
        return Outcome{.kind = OutcomeKind::kSignalled, .signal = *settle_sig};
      }
      return outcome;
    }
    if (std::none_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.running; })) {
      return outcome;  // every worker exited with 0
    }
  }
}

void Supervisor::start_restart_rounds() {
  // An elastic job always has rounds: nodes joining restart the workers even with no restarts.
  if (!options_.elastic() && (options_.nnodes < 2 || options_.max_restarts < 1)) return;
  const std::string secret = options_.secret_file.empty()
                                 ? resolve_job_secret(std::nullopt)
                                 : read_secret_file(options_.secret_file, "--secret-file");
  // A static job's node does not beat while it stops its workers (up to the grace period plus
  // kKillWait), so silence counts as death only well beyond that. Elastic agents beat while they
  // stop their workers too (stop_everything), so their silence means a dead host much sooner: it
  // decides how fast a round goes on without a host whose workers were idle.
  const Milliseconds silence =
      options_.elastic() ? kElasticSilence
                         : std::max(Milliseconds(30'000),
                                    2 * options_.grace_period + kKillWait + Milliseconds(10'000));
  try {
    rounds_ = make_rounds(secret, silence);
  } catch (const StoreError& e) {
    // The store names its own option for the secret; a ddprun user sets it through ddprun.
    std::string message = e.what();
    if (message.find("secret") == std::string::npos) throw;
    for (const std::string internal :
         {"; set the same secret on every process (TcpStoreOptions::auth_secret)",
          " (TcpStoreOptions::auth_secret)", "TcpStoreOptions::auth_secret"}) {
      if (const auto at = message.find(internal); at != std::string::npos) {
        message.erase(at, internal.size());
      }
    }
    throw StoreError(fmt::format(
        "restart rounds at {}:{}: {}; give every node's ddprun the same secret (--secret-file "
        "FILE, or DDP_SECRET_FILE or DDP_SECRET in its environment), or none to all of them",
        options_.master_addr, options_.agent_port, message));
  }
}

std::string Supervisor::agent_listen_host() const {
  if (options_.agent_listen_addr) return *options_.agent_listen_addr;
  if (const auto it = base_env_.find("DDP_STORE_LISTEN_ADDR"); it != base_env_.end()) {
    if (it->second.empty()) {
      throw ConfigError(
          "DDP_STORE_LISTEN_ADDR is set but empty: give an address of this host (e.g. 0.0.0.0 "
          "for every IPv4 address), or unset it to listen on --master-addr's interface");
    }
    return it->second;
  }
  const std::string& addr = options_.master_addr;
  in6_addr literal{};
  if (::inet_pton(AF_INET, addr.c_str(), &literal) == 1 ||
      ::inet_pton(AF_INET6, addr.c_str(), &literal) == 1) {
    return addr;  // a literal address: listen on it, loopback included (one host only then)
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), nullptr, &hints, &found) != 0) return addr;  // named later
  bool only_loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
      only_loopback = only_loopback && (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    } else if (a->ai_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
      only_loopback = only_loopback && IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr);
    }
  }
  ::freeaddrinfo(found);
  return only_loopback && options_.nnodes > 1 ? std::string() : addr;
}

std::unique_ptr<RestartRounds> Supervisor::make_rounds(const std::string& secret,
                                                       Milliseconds silence) const {
  return std::make_unique<RestartRounds>(
      RestartRoundsOptions{.host = options_.master_addr,
                           .port = options_.agent_port,
                           .listen_host = agent_listen_host(),
                           .nnodes = options_.nnodes,
                           .node_rank = options_.node_rank,
                           .run_id = options_.run_id,
                           .secret = secret,
                           .join_timeout = options_.timeout,
                           .heartbeat_timeout = silence,
                           .min_nodes = options_.min_nnodes,
                           .nproc = options_.nproc_per_node,
                           .last_call = options_.rdzv_last_call,
                           .max_restarts = options_.max_restarts});
}

std::optional<int> Supervisor::await_other_nodes(int round, bool& all_succeeded) {
  rounds_->report_success(round);
  for (;;) {
    if (rounds_->all_succeeded(round)) {
      all_succeeded = true;
      return std::nullopt;
    }
    if (rounds_->current_round() > round) {
      all_succeeded = false;
      return std::nullopt;
    }
    if (const int silent = rounds_->beat(); silent >= 0) {
      rounds_->report_failure(round, fmt::format("{}'s ddprun stopped responding (no heartbeat)",
                                                 rounds_->describe_node(silent)));
    }
    poll_once(200);
    if (const std::optional<int> sig = read_signals()) return sig;
  }
}

std::optional<int> Supervisor::stop_everything(int first_signal,
                                               std::optional<int> already_signalled) {
  std::optional<int> received = already_signalled;
  int current_signal = first_signal;
  std::set<pid_t> asked;
  auto deadline = Clock::now() + options_.grace_period;
  for (;;) {
    if (!reap_children(nullptr)) break;  // nothing left
    // Every turn, since descendants get orphaned into ddprun as their parents die.
    signal_all(current_signal, asked);
    if (Clock::now() >= deadline) {
      if (current_signal == SIGKILL) {
        note("some processes did not exit even after SIGKILL; giving up on them");
        break;
      }
      current_signal = SIGKILL;
      asked.clear();
      deadline = Clock::now() + kKillWait;
      continue;
    }
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    poll_once(static_cast<int>(std::clamp<long long>(left, 0, 100)));
    if (rounds_ && rounds_->elastic()) {
      // Stopping can take the grace period: agent 0 must not take this host for dead meanwhile.
      // A store that is gone shows again at the next call that needs it.
      try {
        rounds_->beat();
      } catch (const Error&) {
      }
    }
    if (const std::optional<int> sig = read_signals()) {
      // A second request to stop means "now": skip the rest of the grace period.
      if (current_signal != SIGKILL) deadline = Clock::now();
      if (!received) received = sig;
    }
  }
  drain_and_close_all();
  return received;
}

int Supervisor::run() {
  start_restart_rounds();
  if (options_.elastic()) return run_elastic();
  // Whole-job restarts: the job's failure of the round, named on every node when it gives up.
  const auto give_up_or_restart = [&](int restart_count, const std::string& cause) {
    if (restart_count >= options_.max_restarts) {
      if (options_.max_restarts > 0) {
        note(fmt::format("giving up after {} restarts{}", options_.max_restarts,
                         cause.empty() ? "" : "; the job's last failure: " + cause));
      }
      if (rounds_) rounds_->leave();
      return false;
    }
    note(fmt::format("restart {} of {}: starting the {} again{}", restart_count + 1,
                     options_.max_restarts, rounds_ ? "workers of every node" : "local workers",
                     cause.empty() ? "" : " (" + cause + ")"));
    return true;
  };
  for (int restart_count = 0;; ++restart_count) {
    if (rounds_) rounds_->join(restart_count);
    if (!start_workers(restart_count)) {
      stop_everything(SIGTERM, std::nullopt);
      if (rounds_) {
        rounds_->report_failure(
            restart_count, fmt::format("node {} could not start its workers", options_.node_rank));
        rounds_->leave();
      }
      return kWorkerFailedExitCode;
    }
    const Outcome outcome = supervise(restart_count);
    switch (outcome.kind) {
      case OutcomeKind::kSucceeded: {
        // Every worker is done; stop whatever they left running in the background.
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        if (!rounds_) return 0;
        bool all_succeeded = false;
        if (const auto sig = await_other_nodes(restart_count, all_succeeded)) return 128 + *sig;
        if (all_succeeded) {
          rounds_->leave();
          return 0;
        }
        // Another node failed after this one's workers were done: the whole job goes again.
        if (!give_up_or_restart(restart_count, rounds_->failure(restart_count))) {
          return kWorkerFailedExitCode;
        }
        break;
      }
      case OutcomeKind::kSignalled: {
        note(fmt::format("received {}; forwarding it to the workers", signal_name(outcome.signal)));
        stop_everything(outcome.signal, outcome.signal);
        return 128 + outcome.signal;
      }
      case OutcomeKind::kWorkerFailed: {
        const std::string what = note_worker_failure(outcome);
        std::string cause;
        if (rounds_) {
          // Before stopping anything (that takes up to the grace period), so that this cause is
          // recorded before the consequences on other nodes; it moves every node to the next
          // round, and the first failure recorded is the one every node names.
          cause = rounds_->report_failure(
              restart_count, fmt::format("rank {} (node {}) {}", outcome.rank, options_.node_rank,
                                         failure_how(outcome)));
        }
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        if (!give_up_or_restart(restart_count, cause)) return kWorkerFailedExitCode;
        break;
      }
      case OutcomeKind::kRestartRequested: {
        const std::string cause = rounds_->failure(restart_count);
        note(fmt::format("another node failed ({}); stopping the local workers",
                         cause.empty() ? "no cause recorded" : cause));
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        if (!give_up_or_restart(restart_count, cause)) return kWorkerFailedExitCode;
        break;
      }
    }
  }
}

int Supervisor::run_elastic() {
  try {
    return run_elastic_rounds();
  } catch (const JobEnded& e) {
    note(e.what());
    return e.exit_code();
  } catch (const StoreError& e) {
    if (options_.serves_rounds()) throw;
    stop_everything(SIGTERM, std::nullopt);
    note(fmt::format(
        "error: lost the elastic rendezvous at {}:{} ({}): the ddprun with --node-rank 0, which "
        "serves it, is gone, and an elastic job ends with it (as torchrun's c10d rendezvous); "
        "start the job again",
        options_.master_addr, options_.agent_port, e.what()));
    return kWorkerFailedExitCode;
  }
}

int Supervisor::run_elastic_rounds() {
  for (int round = rounds_->current_round();; ++round) {
    const JoinedRound joined = rounds_->join_elastic(round);
    round = joined.round;
    placement_ = joined.placement;
    std::vector<int> agents;
    for (const RoundMember& m : joined.members)
      agents.push_back(m.agent);
    note(fmt::format(
        "elastic round {}: {} node(s) (agents [{}], --nnodes {}:{}), world size {}; this node is "
        "node {}, ranks {} to {}; {} of {} restarts used",
        round, placement_->nnodes, fmt::join(agents, ", "), options_.min_nnodes, options_.nnodes,
        placement_->world_size, placement_->node_rank, placement_->first_rank,
        placement_->first_rank + options_.nproc_per_node - 1, joined.restarts_used,
        options_.max_restarts));
    if (!start_workers(round)) {
      stop_everything(SIGTERM, std::nullopt);
      rounds_->report_failure(round,
                              fmt::format("node {} could not start its workers", node_rank()));
      rounds_->leave();
      return kWorkerFailedExitCode;
    }
    const Outcome outcome = supervise(round);
    switch (outcome.kind) {
      case OutcomeKind::kSucceeded: {
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        bool all_succeeded = false;
        if (const auto sig = await_other_nodes(round, all_succeeded)) return 128 + *sig;
        if (all_succeeded) {
          if (options_.serves_rounds()) rounds_->finish(round);
          rounds_->leave();
          return 0;
        }
        note(
            fmt::format("another node failed after this node's workers were done ({}); joining "
                        "round {}",
                        rounds_->failure(round), round + 1));
        break;
      }
      case OutcomeKind::kSignalled: {
        note(fmt::format("received {}; forwarding it to the workers", signal_name(outcome.signal)));
        stop_everything(outcome.signal, outcome.signal);
        return 128 + outcome.signal;
      }
      case OutcomeKind::kWorkerFailed: {
        const std::string what = note_worker_failure(outcome);
        // Recorded before stopping anything, as in a static job (see run()).
        std::string cause = rounds_->report_failure(
            round,
            fmt::format("rank {} (node {}) {}", outcome.rank, node_rank(), failure_how(outcome)));
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        if (cause.empty()) {
          note(
              fmt::format("the job had left round {} already ({}); restarting the workers in "
                          "round {} (not counted against --max-restarts)",
                          round, rounds_->membership_change(round), round + 1));
        } else {
          note(fmt::format("round {} failed ({}); joining round {}", round, cause, round + 1));
        }
        break;
      }
      case OutcomeKind::kRestartRequested: {
        const std::string cause = rounds_->failure(round);
        if (cause.empty()) {
          note(
              fmt::format("{}; restarting the workers in round {} (not counted against "
                          "--max-restarts)",
                          rounds_->membership_change(round), round + 1));
        } else {
          note(fmt::format("another node failed ({}); stopping the local workers", cause));
        }
        if (const auto sig = stop_everything(SIGTERM, std::nullopt)) return 128 + *sig;
        break;
      }
    }
  }
}

}  // namespace

std::string describe_wait_status(int wait_status) {
  if (WIFEXITED(wait_status)) return fmt::format("exited with code {}", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const int sig = WTERMSIG(wait_status);
    const char* description = ::sigdescr_np(sig);
    return fmt::format("was killed by signal {} ({}){}", sig,
                       description != nullptr ? description : "unknown signal",
                       WCOREDUMP(wait_status) ? ", core dumped" : "");
  }
  return fmt::format("ended with wait status {:#x}", wait_status);
}

int run_workers(const LaunchOptions& options) {
  Supervisor supervisor(options);
  return supervisor.run();
}

}  // namespace ddp::ddprun
