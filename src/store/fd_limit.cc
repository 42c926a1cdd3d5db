#include "store/fd_limit.h"

#include <sys/resource.h>

#include <algorithm>

namespace ddp::store {

namespace {

// Linux refuses a soft limit above fs.nr_open (1,048,576 by default), e.g. for an infinite hard
// limit.
constexpr rlim_t kLargestSoftLimit = rlim_t{1} << 20;

}  // namespace

std::size_t raise_open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  const rlim_t target = limit.rlim_max == RLIM_INFINITY ? kLargestSoftLimit : limit.rlim_max;
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < target) {
    rlimit raised = limit;
    raised.rlim_cur = target;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur == RLIM_INFINITY) return kLargestSoftLimit;
  return static_cast<std::size_t>(limit.rlim_cur);
}

std::size_t automatic_max_connections(std::size_t open_files) {
  return std::clamp<std::size_t>(open_files / 2, 1, kMaxAutomaticConnections);
}

}  // namespace ddp::store
