// tcp_roundtrip_bound: what loopback TCP alone allows an RPC round trip on this machine.
//
//   tcp_roundtrip_bound [--calls N] [--echo-calls M] [--echo-bytes B] [--warmup W] [--spin]
//
// Two forked processes, one loopback TCP connection (TCP_NODELAY), one thread each, blocking
// send and recv of one reused buffer: N round trips of 1 byte each way, then M of B bytes each
// way, each timed alone. Nothing else: no framing, no threads handing work over, no serialisation,
// no allocation. bench/compare/compare_rpc.py shows it beside ddp::rpc and PyTorch's TensorPipe
// agent. With --spin, each side never sleeps in recv: it tries a non-blocking recv and yields its
// core between tries, so no wake-up from sleep is on the path (what ddp::rpc's waiting threads do
// for a while, docs/rpc.md): the floor for a round trip that spins; without it, the round trip of
// two threads that sleep. Prints, as rpc-latency does (tcp-bound-spin with --spin):
//   tcp-bound empty_us median=.. p10=.. p90=.. calls=N
//   tcp-bound echo_us bytes=B median=.. p10=.. p90=.. calls=M
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace {

void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(std::string(what) + ": " + std::strerror(errno));
}

bool spin = false;  // --spin: receive without sleeping

void move_all(int fd, std::uint8_t* bytes, std::size_t size, bool sending) {
  while (size > 0) {
    const ssize_t n = sending ? ::send(fd, bytes, size, MSG_NOSIGNAL)
                              : ::recv(fd, bytes, size, spin ? MSG_DONTWAIT : 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && !sending && spin && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      ::sched_yield();
      continue;
    }
    check(n > 0, sending ? "send" : "recv (the peer closed)");
    bytes += n;
    size -= static_cast<std::size_t>(n);
  }
}

void no_delay(int fd) {
  const int one = 1;
  check(::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0, "TCP_NODELAY");
}

void print(const char* what, const std::string& bytes, std::vector<double> micros) {
  std::sort(micros.begin(), micros.end());
  auto at = [&](double q) {
    return micros[static_cast<std::size_t>(q * static_cast<double>(micros.size() - 1))];
  };
  std::printf("%s %s %smedian=%.1f p10=%.1f p90=%.1f calls=%zu\n",
              spin ? "tcp-bound-spin" : "tcp-bound", what, bytes.c_str(), at(0.5), at(0.1), at(0.9),
              micros.size());
}

}  // namespace

int main(int argc, char** argv) {
  int calls = 2000, echo_calls = 200, warmup = 100;
  std::size_t echo_bytes = 1 << 20;
  CLI::App app{"tcp_roundtrip_bound: loopback TCP round trips with nothing else"};
  app.add_option("--calls", calls, "1-byte round trips")->check(CLI::Range(1, 100000000));
  app.add_option("--echo-calls", echo_calls, "round trips of --echo-bytes")
      ->check(CLI::Range(1, 100000000));
  app.add_option("--echo-bytes", echo_bytes, "bytes each way")->check(CLI::Range(1, 1 << 30));
  app.add_option("--warmup", warmup, "untimed round trips of each kind first")
      ->check(CLI::Range(0, 100000000));
  app.add_flag("--spin", spin, "never sleep in recv: try without blocking and yield between tries");
  CLI11_PARSE(app, argc, argv);
  try {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    check(listener >= 0, "socket");
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    check(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0, "bind");
    check(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) == 0,
          "getsockname");
    check(::listen(listener, 1) == 0, "listen");
    std::vector<std::uint8_t> buffer(echo_bytes, 7);
    const int rounds[2] = {warmup + calls, warmup + echo_calls};
    const std::size_t sizes[2] = {1, echo_bytes};
    const pid_t child = ::fork();
    check(child >= 0, "fork");
    if (child == 0) {  // the echoing side
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      check(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0, "connect");
      no_delay(fd);
      for (int kind = 0; kind < 2; ++kind) {
        for (int i = 0; i < rounds[kind]; ++i) {
          move_all(fd, buffer.data(), sizes[kind], false);
          move_all(fd, buffer.data(), sizes[kind], true);
        }
      }
      ::_exit(0);
    }
    const int fd = ::accept(listener, nullptr, nullptr);
    check(fd >= 0, "accept");
    no_delay(fd);
    for (int kind = 0; kind < 2; ++kind) {
      std::vector<double> micros;
      for (int i = 0; i < rounds[kind]; ++i) {
        const auto start = std::chrono::steady_clock::now();
        move_all(fd, buffer.data(), sizes[kind], true);
        move_all(fd, buffer.data(), sizes[kind], false);
        if (i >= warmup) {
          micros.push_back(
              std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
                  .count());
        }
      }
      print(kind == 0 ? "empty_us" : "echo_us",
            kind == 0 ? std::string() : "bytes=" + std::to_string(echo_bytes) + " ", micros);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tcp_roundtrip_bound: %s\n", e.what());
    return 1;
  }
}
