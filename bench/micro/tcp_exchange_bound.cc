// tcp_exchange_bound: what loopback TCP alone allows a world-2 allreduce, without any reduction.
//
//   tcp_exchange_bound [--sizes 1M,16M,64M] [--iters 20] [--warmup 5] [--socket-buffer BYTES]
//
// A ring allreduce of S bytes at world 2 sends S/2 bytes each way twice (reduce-scatter, then
// allgather). This program does exactly that data movement between two forked processes over one
// loopback TCP connection (TCP_NODELAY, 4 MiB socket buffers like the ring backend), each
// direction on its own thread so that both directions flow at once, and nothing else: no
// reduction, no framing, no queue. Its busbw is therefore an upper bound for any TCP allreduce of
// this pattern on this machine, and bench/compare/compare_allreduce.py shows it as the peer
// `tcp-bound`. It starts a thread per exchange (tens of µs), so it bounds large messages only
// (16 MiB and up; the ring, which pipelines chunks, matched it within 3 % at 16 and 64 MiB).
//
// Timing as ddp-bench: a 1-byte exchange before every iteration (not timed), each process times
// its own iteration, the slower one counts, and rank 0 prints the median as one JSON object per
// size with ddp-bench's fields (`wrong` is 0: the received bytes are checked against the
// pattern the peer sent).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "byte_sizes.h"
#include "forked_ranks.h"

namespace {

struct Args {
  std::vector<std::size_t> sizes = {1 << 20, 16 << 20, 64 << 20};
  int iters = 20;
  int warmup = 5;
  int socket_buffer = 4 * 1024 * 1024;
};

void check(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(fmt::format("{}: {}", what, std::strerror(errno)));
}

void send_all(int fd, const std::uint8_t* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    check(n > 0, "send");
    data += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void recv_all(int fd, std::uint8_t* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, data, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) throw std::runtime_error("recv: the peer closed the connection");
    check(n > 0, "recv");
    data += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

void set_options(int fd, int buffer_bytes) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof buffer_bytes);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof buffer_bytes);
}

// Sends `out` while receiving into `in`, both `bytes` long, each direction on its own thread.
void exchange(int fd, const std::uint8_t* out, std::uint8_t* in, std::size_t bytes) {
  std::exception_ptr send_error;
  std::thread sender([&] {
    try {
      send_all(fd, out, bytes);
    } catch (...) {
      send_error = std::current_exception();
    }
  });
  recv_all(fd, in, bytes);
  sender.join();
  if (send_error) std::rethrow_exception(send_error);
}

int run_rank(const Args& args, int rank, int listener, std::uint16_t port) {
  int fd = -1;
  if (rank == 0) {
    fd = ::accept(listener, nullptr, nullptr);
    check(fd >= 0, "accept");
  } else {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    check(fd >= 0, "socket");
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    check(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0, "connect");
  }
  ::close(listener);
  set_options(fd, args.socket_buffer);

  const std::size_t largest = *std::max_element(args.sizes.begin(), args.sizes.end());
  std::vector<std::uint8_t> out(largest / 2 + 1, static_cast<std::uint8_t>(rank + 1));
  std::vector<std::uint8_t> in(largest / 2 + 1, 0);
  const auto expected = static_cast<std::uint8_t>(2 - rank);  // the peer's pattern
  std::uint8_t token_out = 0, token_in = 0;
  for (const std::size_t bytes : args.sizes) {
    const std::size_t half = std::max<std::size_t>(bytes / 2, 1);
    std::vector<double> times;
    long long wrong = 0;
    for (int it = 0; it < args.warmup + args.iters; ++it) {
      exchange(fd, &token_out, &token_in, 1);  // both ready: the barrier
      const auto start = std::chrono::steady_clock::now();
      exchange(fd, out.data(), in.data(), half);  // reduce-scatter's traffic
      exchange(fd, out.data(), in.data(), half);  // allgather's traffic
      const auto stop = std::chrono::steady_clock::now();
      if (it >= args.warmup) {
        times.push_back(std::chrono::duration<double, std::micro>(stop - start).count());
      }
      if (it + 1 == args.warmup + args.iters) {
        wrong = std::count_if(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(half),
                              [&](std::uint8_t b) { return b != expected; });
      }
    }
    // The slower process's time per iteration counts: rank 1 sends its times to rank 0.
    std::vector<double> peer(times.size());
    exchange(fd, reinterpret_cast<const std::uint8_t*>(times.data()),
             reinterpret_cast<std::uint8_t*>(peer.data()), times.size() * sizeof(double));
    long long peer_wrong = 0;
    exchange(fd, reinterpret_cast<const std::uint8_t*>(&wrong),
             reinterpret_cast<std::uint8_t*>(&peer_wrong), sizeof wrong);
    if (rank != 0) continue;
    for (std::size_t i = 0; i < times.size(); ++i)
      times[i] = std::max(times[i], peer[i]);
    std::sort(times.begin(), times.end());
    const std::size_t n = times.size();
    const double median = n % 2 ? times[n / 2] : (times[n / 2 - 1] + times[n / 2]) / 2;
    const double algbw = static_cast<double>(bytes) / (median * 1e-6) / 1e9;
    // busbw at world 2: 2(n-1)/n = 1 times algbw.
    std::printf(
        "{\"op\":\"allreduce\",\"bytes\":%zu,\"count\":%zu,\"dtype\":\"float32\","
        "\"reduce_op\":\"sum\",\"time_us\":%.3f,\"time_min_us\":%.3f,\"time_max_us\":%.3f,"
        "\"algbw_gbps\":%.6f,\"busbw_gbps\":%.6f,\"wrong\":%lld,\"iters\":%d,\"warmup\":%d,"
        "\"world_size\":2,\"backend\":\"tcp-bound\"}\n",
        bytes, bytes / 4, median, times.front(), times.back(), algbw, algbw, wrong + peer_wrong,
        args.iters, args.warmup);
    std::fflush(stdout);
  }
  ::close(fd);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"tcp_exchange_bound: a world-2 ring allreduce's traffic over loopback TCP alone"};
  std::string sizes = "1M,16M,64M";
  app.add_option("--sizes", sizes, "allreduce sizes in bytes (1024, 64K, 1M, ...)");
  app.add_option("--iters", args.iters, "timed iterations per size")->check(CLI::PositiveNumber);
  app.add_option("--warmup", args.warmup, "untimed iterations first")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--socket-buffer", args.socket_buffer, "SO_SNDBUF/SO_RCVBUF bytes")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    args.sizes = parse_byte_sizes(sizes);
    // Listen before forking, so that the child's connect cannot come too early.
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    check(listener >= 0, "socket");
    set_options(listener, args.socket_buffer);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    check(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0, "bind");
    check(::listen(listener, 1) == 0, "listen");
    socklen_t length = sizeof address;
    check(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length) == 0,
          "getsockname");
    const std::uint16_t port = ntohs(address.sin_port);
    return run_forked_ranks(2, [&](int rank) { return run_rank(args, rank, listener, port); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tcp_exchange_bound: %s\n", e.what());
    return 2;
  }
}
