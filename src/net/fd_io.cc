#include "net/fd_io.h"

#include <linux/sockios.h>
#include <sys/ioctl.h>

namespace ddp::net {

bool shutdown_socket(int fd, ShutdownHow how) {
  const int kernel_how = how == ShutdownHow::kRead    ? SHUT_RD
                         : how == ShutdownHow::kWrite ? SHUT_WR
                                                      : SHUT_RDWR;
  return ::shutdown(fd, kernel_how) == 0;
}

int poll_fds(std::span<pollfd> fds, int timeout_ms) {
  return ::poll(fds.data(), fds.size(), timeout_ms);
}

int unsent_bytes(int fd) {
  int unsent = 0;
  if (::ioctl(fd, SIOCOUTQ, &unsent) != 0) return -1;
  return unsent;
}

}  // namespace ddp::net
