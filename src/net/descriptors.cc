#include "net/descriptors.h"

#include <dirent.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace ddp::net {
namespace {

// Linux refuses a soft limit above fs.nr_open (1,048,576 by default), e.g. for an infinite hard
// limit.
constexpr rlim_t kLargestSoftLimit = rlim_t{1} << 20;

}  // namespace

bool is_out_of_descriptors(int err) {
  return err == EMFILE || err == ENFILE;
}

std::string out_of_descriptors_text(int err) {
  const std::size_t limit = open_files_limit();
  if (err == ENFILE) {
    return fmt::format(
        "out of file descriptors (ENFILE: {}): the system's table of open files is full "
        "(fs.file-max); this process may open {} (ulimit -n); close programs that hold many files "
        "or raise fs.file-max",
        std::strerror(err), limit);
  }
  return fmt::format(
      "out of file descriptors (EMFILE: {}): this process may open {} (ulimit -n); raise the "
      "limit (ulimit -n before starting, or the hard limit: /etc/security/limits.conf, systemd's "
      "LimitNOFILE, docker's --ulimit nofile) or make the program open fewer files",
      std::strerror(err), limit);
}

std::string system_error_text(int err) {
  return is_out_of_descriptors(err) ? out_of_descriptors_text(err) : std::strerror(err);
}

void throw_if_out_of_descriptors(int err, const std::string& what) {
  if (is_out_of_descriptors(err)) {
    throw OutOfDescriptorsError(fmt::format("{}: {}", what, out_of_descriptors_text(err)));
  }
}

std::size_t open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur > kLargestSoftLimit) {
    return kLargestSoftLimit;
  }
  return static_cast<std::size_t>(limit.rlim_cur);
}

std::size_t raise_open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  const rlim_t target = limit.rlim_max == RLIM_INFINITY ? kLargestSoftLimit : limit.rlim_max;
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < target) {
    rlimit raised = limit;
    raised.rlim_cur = target;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  return open_files_limit();
}

std::size_t ensure_open_files_limit(std::size_t needed) {
  const std::size_t soft = open_files_limit();
  return soft >= needed ? soft : raise_open_files_limit();
}

std::size_t hard_open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_max == RLIM_INFINITY || limit.rlim_max > kLargestSoftLimit) {
    return kLargestSoftLimit;
  }
  return static_cast<std::size_t>(limit.rlim_max);
}

std::size_t open_descriptor_count() {
  // opendir needs a descriptor itself: out of them, the count is unknown (0).
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  std::size_t count = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count > 0 ? count - 1 : 0;  // not the directory's own descriptor
}

}  // namespace ddp::net
