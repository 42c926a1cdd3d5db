// Socket calls on a raw descriptor, for the event loops that drive many connections themselves
// (the ring's Exchange, the point-to-point engine, the mesh handshake) and so cannot use Socket's
// deadline-bound send_all/recv_all. With socket.h, the only place ddp touches the socket API.
//
// They keep the kernel's conventions and never throw: a result of -1 leaves the reason in errno
// (EAGAIN/EWOULDBLOCK: the socket would block; EINTR: try again; anything else is a failure of
// the connection), and a receive returns 0 at end of stream. The calls on the per-message path
// are inline and are the system call and nothing more. Thread-safety: the kernel's (one thread
// may send while another receives on the same descriptor).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <span>

namespace ddp::net {

// One non-blocking gather-send of `count` buffers. A peer that has gone is EPIPE or ECONNRESET,
// never SIGPIPE. Returns the bytes sent, or -1 with errno set.
inline ssize_t send_iov_nonblocking(int fd, const iovec* iov, int count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);  // sendmsg does not write to the array
  msg.msg_iovlen = static_cast<std::size_t>(count);
  return ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

// One non-blocking scatter-receive into `count` buffers. Returns the bytes received, 0 at end of
// stream, or -1 with errno set.
inline ssize_t recv_iov_nonblocking(int fd, const iovec* iov, int count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);  // recvmsg writes to the buffers, not to the array
  msg.msg_iovlen = static_cast<std::size_t>(count);
  return ::recvmsg(fd, &msg, MSG_DONTWAIT);
}

// One non-blocking receive of at most `size` bytes. Returns the bytes received, 0 at end of stream
// (or when size is 0), or -1 with errno set.
inline ssize_t recv_nonblocking(int fd, void* data, std::size_t size) {
  return ::recv(fd, data, size, MSG_DONTWAIT);
}

// Like recv_nonblocking, but the bytes stay in the socket for the next receive to read again.
inline ssize_t peek_nonblocking(int fd, void* data, std::size_t size) {
  return ::recv(fd, data, size, MSG_PEEK | MSG_DONTWAIT);
}

enum class ShutdownHow {
  kRead,   // no more receiving; the peer is not told
  kWrite,  // no more sending: the peer reads end of stream once it has read what was sent
  kBoth,   // both; wakes every thread of this process blocked on the socket
};

// Shuts the connection down in one or both directions without closing the descriptor (so another
// thread that uses it sees end of stream or an error, never a reused number). Returns false with
// errno set when the kernel refuses (not a socket, not connected).
bool shutdown_socket(int fd, ShutdownHow how);

// poll(2) over `fds`: waits until one is ready or `timeout_ms` passes (-1: no limit). Returns the
// number of entries with revents set, 0 on timeout, or -1 with errno set (EINTR: a signal).
int poll_fds(std::span<pollfd> fds, int timeout_ms);

// Bytes written to the socket that the peer has not acknowledged yet (SIOCOUTQ), or -1 with errno
// set. A sender that wants its last bytes delivered before it closes waits for this to reach 0.
int unsent_bytes(int fd);

}  // namespace ddp::net
