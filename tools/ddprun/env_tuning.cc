#include "ddprun/env_tuning.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

namespace ddp::ddprun {
namespace {

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  // SkylakeX kernels use F, CD, BW, DQ and VL.
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// Runs in the forked child: load OpenBLAS single-threaded, write its core name to `fd`.
[[noreturn]] void report_openblas_core(int fd) {
  ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
  ::unsetenv("OPENBLAS_CORETYPE");
  const char* name = "";
  if (void* lib = ::dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL)) {
    using CoreName = char* (*)();
    if (auto get = reinterpret_cast<CoreName>(::dlsym(lib, "openblas_get_corename"))) {
      if (const char* got = get()) name = got;
    }
  }
  const std::size_t n = std::strlen(name);
  const ssize_t written = ::write(fd, name, n);
  ::_exit(written == static_cast<ssize_t>(n) ? 0 : 1);
}

}  // namespace

std::string openblas_coretype_for(std::string_view detected_core, bool has_avx512, bool has_avx2) {
  if (!iequals(detected_core, "Prescott")) return {};
  if (has_avx512) return "SkylakeX";
  if (has_avx2) return "Haswell";
  return {};
}

std::string probe_openblas_core() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return {};
  }
  if (pid == 0) {
    ::close(fds[0]);
    report_openblas_core(fds[1]);
  }
  ::close(fds[1]);
  std::string name;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{.fd = fds[0], .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
    char buf[64];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;  // EOF: the child is done
    name.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  ::kill(pid, SIGKILL);  // harmless when it has exited; bounds a child stuck in a constructor
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return name;
}

Environment choose_env_tuning(const Environment& base) {
  Environment tuning;
  if (!base.contains("GLIBC_TUNABLES")) tuning["GLIBC_TUNABLES"] = std::string(kMallocTunables);
  if (!base.contains("OPENBLAS_CORETYPE")) {
    const std::string coretype =
        openblas_coretype_for(probe_openblas_core(), cpu_has_avx512(), cpu_has_avx2());
    if (!coretype.empty()) tuning["OPENBLAS_CORETYPE"] = coretype;
  }
  return tuning;
}

}  // namespace ddp::ddprun
