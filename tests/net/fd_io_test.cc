// The raw-descriptor socket calls of net/fd_io.h, over loopback connections.
#include "net/fd_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "net/socket.h"
#include "support/unity_namespace.h"

namespace ddp::net {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

struct Connection {
  Socket a;
  Socket b;
};

Connection connect_pair() {
  Socket listener = listen_tcp("127.0.0.1", 0);
  Socket a = connect_tcp("127.0.0.1", listener.local_port(), deadline_after(5s));
  Socket b = accept_tcp(listener, deadline_after(5s));
  return {std::move(a), std::move(b)};
}

// Receives exactly `size` bytes with recv_nonblocking, waiting in between.
std::string receive(Socket& s, std::size_t size) {
  std::string out(size, '\0');
  std::size_t got = 0;
  while (got < size) {
    EXPECT_TRUE(s.wait_readable(deadline_after(5s)));
    const ssize_t n = recv_nonblocking(s.fd(), out.data() + got, size - got);
    if (n <= 0) {
      EXPECT_TRUE(n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) << n << " " << errno;
      if (n == 0) break;
      continue;
    }
    got += static_cast<std::size_t>(n);
  }
  return out;
}

// Sends until the socket would block (the peer reads nothing); returns the bytes sent.
std::size_t fill(Socket& s) {
  s.set_buffer_sizes(4096);
  std::vector<char> chunk(65536, 'x');
  std::size_t sent = 0;
  for (;;) {
    const iovec iov{chunk.data(), chunk.size()};
    const ssize_t n = send_iov_nonblocking(s.fd(), &iov, 1);
    if (n < 0) {
      EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << errno;
      return sent;
    }
    sent += static_cast<std::size_t>(n);
  }
}

TEST(FdIo, SendIovGathersTheBuffersInOrder) {
  Connection c = connect_pair();
  char first[] = "hel";
  char second[] = "lo";
  const iovec iov[2] = {{first, 3}, {second, 2}};
  EXPECT_EQ(send_iov_nonblocking(c.a.fd(), iov, 2), 5);
  EXPECT_EQ(receive(c.b, 5), "hello");
}

TEST(FdIo, SendIovSaysWouldBlockWhenTheSocketIsFull) {
  Connection c = connect_pair();
  c.b.set_buffer_sizes(4096);
  EXPECT_GT(fill(c.a), 0u);
  // What the peer has not taken is still queued on this side.
  EXPECT_GT(unsent_bytes(c.a.fd()), 0);
}

TEST(FdIo, SendIovToAClosedPeerFailsWithoutSigpipe) {
  Connection c = connect_pair();
  c.b.close();
  char byte = 'x';
  const iovec iov{&byte, 1};
  // The first send may still be taken (the peer answers it with a reset); a later one fails.
  const auto deadline = deadline_after(5s);
  ssize_t n = 0;
  while ((n = send_iov_nonblocking(c.a.fd(), &iov, 1)) >= 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(n, -1);
  EXPECT_TRUE(errno == EPIPE || errno == ECONNRESET) << errno;
}

TEST(FdIo, RecvIovScattersIntoTheBuffers) {
  Connection c = connect_pair();
  c.a.send_all("hello world", 11, deadline_after(5s));
  char first[5];
  char second[6];
  const iovec iov[2] = {{first, sizeof first}, {second, sizeof second}};
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(recv_iov_nonblocking(c.b.fd(), iov, 2), 11);
  EXPECT_EQ(std::string(first, 5), "hello");
  EXPECT_EQ(std::string(second, 6), " world");
}

TEST(FdIo, RecvIovSaysWouldBlockThenEndOfStream) {
  Connection c = connect_pair();
  char buf[4];
  const iovec iov{buf, sizeof buf};
  EXPECT_EQ(recv_iov_nonblocking(c.b.fd(), &iov, 1), -1);
  EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << errno;
  c.a.close();
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(recv_iov_nonblocking(c.b.fd(), &iov, 1), 0);
}

TEST(FdIo, RecvSaysWouldBlockThenReadsThenEndOfStream) {
  Connection c = connect_pair();
  char buf[8];
  EXPECT_EQ(recv_nonblocking(c.b.fd(), buf, sizeof buf), -1);
  EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << errno;
  c.a.send_all("abc", 3, deadline_after(5s));
  EXPECT_EQ(receive(c.b, 3), "abc");
  c.a.close();
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(recv_nonblocking(c.b.fd(), buf, sizeof buf), 0);
}

TEST(FdIo, PeekLeavesTheBytesInPlace) {
  Connection c = connect_pair();
  char buf[4];
  EXPECT_EQ(peek_nonblocking(c.b.fd(), buf, sizeof buf), -1);
  EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << errno;
  c.a.send_all("wxyz", 4, deadline_after(5s));
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(peek_nonblocking(c.b.fd(), buf, sizeof buf), 4);
  EXPECT_EQ(std::string(buf, 4), "wxyz");
  EXPECT_EQ(peek_nonblocking(c.b.fd(), buf, 2), 2);
  EXPECT_EQ(receive(c.b, 4), "wxyz");
  EXPECT_EQ(peek_nonblocking(c.b.fd(), buf, sizeof buf), -1);
}

TEST(FdIo, ShutdownWriteSendsEndOfStreamAndStillReceives) {
  Connection c = connect_pair();
  c.a.send_all("last", 4, deadline_after(5s));
  ASSERT_TRUE(shutdown_socket(c.a.fd(), ShutdownHow::kWrite));
  EXPECT_EQ(receive(c.b, 4), "last");
  char byte;
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(recv_nonblocking(c.b.fd(), &byte, 1), 0);
  // The other direction still works.
  c.b.send_all("back", 4, deadline_after(5s));
  EXPECT_EQ(receive(c.a, 4), "back");
}

TEST(FdIo, ShutdownBothEndsBothDirectionsAndWakesABlockedReceiver) {
  Connection c = connect_pair();
  std::thread receiver([&] {
    char byte;
    // Blocks until the shutdown below: end of stream, reported as a closed connection.
    EXPECT_THROW(c.a.recv_all(&byte, 1, deadline_after(10s)), Error);
  });
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(shutdown_socket(c.a.fd(), ShutdownHow::kBoth));
  receiver.join();
  char byte;
  ASSERT_TRUE(c.b.wait_readable(deadline_after(5s)));
  EXPECT_EQ(recv_nonblocking(c.b.fd(), &byte, 1), 0);
}

TEST(FdIo, ShutdownOfANonSocketFails) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  errno = 0;
  EXPECT_FALSE(shutdown_socket(fds[0], ShutdownHow::kBoth));
  EXPECT_EQ(errno, ENOTSOCK);
  ::close(fds[0]);
  ::close(fds[1]);
}

TEST(FdIo, PollReportsTheReadySocketOrTimesOut) {
  Connection quiet = connect_pair();
  Connection busy = connect_pair();
  std::vector<pollfd> fds = {{quiet.b.fd(), POLLIN, 0}, {busy.b.fd(), POLLIN, 0}};
  const auto start = Clock::now();
  EXPECT_EQ(poll_fds(fds, 20), 0);
  EXPECT_GE(Clock::now() - start, 15ms);
  busy.a.send_all("!", 1, deadline_after(5s));
  EXPECT_EQ(poll_fds(fds, 5000), 1);
  EXPECT_EQ(fds[0].revents, 0);
  EXPECT_NE(fds[1].revents & POLLIN, 0);
}

TEST(FdIo, UnsentBytesIsZeroWhenIdleAndFailsOnABadDescriptor) {
  Connection c = connect_pair();
  EXPECT_EQ(unsent_bytes(c.a.fd()), 0);
  EXPECT_EQ(unsent_bytes(-1), -1);
  EXPECT_EQ(errno, EBADF);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::net
