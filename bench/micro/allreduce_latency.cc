// allreduce_latency: time of one allreduce of the ring backend, by message size, with N local
// ranks (forked) over loopback TCP. Rank 0 prints one line per size: median and mean microseconds
// and bus bandwidth (2(N-1)/N * bytes / time, the bytes each rank must move, per second).
//
//   allreduce_latency [--world N] [--algorithm auto|ring|rd] [--iters K] [--sizes 1024,65536,...]
//                     [--socket-buffer BYTES] [--chunk BYTES]
//
// --algorithm forces the ring (small_message_bytes = 0) or recursive doubling (huge threshold);
// this is how docs/algorithms.md chose the switch point.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "byte_sizes.h"
#include "ddp/comm/ring_process_group.h"
#include "ddp/store/tcp_store.h"
#include "forked_ranks.h"

namespace {

struct Args {
  int world = 2;
  std::string algorithm = "auto";
  int iters = 0;          // 0: chosen per size
  int socket_buffer = 0;  // 0: the default
  std::size_t chunk = 0;  // 0: the default
  std::vector<std::size_t> sizes = {4,      64,      1024,    4096,     16384,   65536,
                                    262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
};

Args parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--world") {
      args.world = std::stoi(value());
    } else if (flag == "--algorithm") {
      args.algorithm = value();
    } else if (flag == "--socket-buffer") {
      args.socket_buffer = std::stoi(value());
    } else if (flag == "--chunk") {
      args.chunk = std::stoull(value());
    } else if (flag == "--iters") {
      args.iters = std::stoi(value());
    } else if (flag == "--sizes") {
      args.sizes = parse_byte_sizes(value());
    } else {
      throw std::runtime_error("unknown flag " + flag +
                               " (--world N --algorithm auto|ring|rd --iters K --sizes a,b,c "
                               "--socket-buffer B --chunk B)");
    }
  }
  return args;
}

void run_rank(const Args& args, int rank, std::uint16_t port) {
  auto store = std::make_shared<ddp::TcpStore>(
      "127.0.0.1", port, ddp::TcpStoreOptions{.is_server = rank == 0, .num_workers = args.world});
  ddp::RingOptions options{.advertise_host = "127.0.0.1"};
  if (args.socket_buffer > 0) options.socket_buffer_bytes = args.socket_buffer;
  if (args.chunk > 0) options.chunk_bytes = args.chunk;
  if (args.algorithm == "ring") options.small_message_bytes = 0;
  if (args.algorithm == "rd") options.small_message_bytes = std::size_t{1} << 40;
  auto pg = ddp::make_ring_process_group(store, rank, args.world, options);
  if (rank == 0) {
    std::printf("# world %d, algorithm %s, float32 sum, loopback TCP\n", args.world,
                args.algorithm.c_str());
    std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "median_us", "mean_us",
                "busbw_GB/s");
  }
  for (std::size_t bytes : args.sizes) {
    const std::size_t count = std::max<std::size_t>(1, bytes / 4);
    std::vector<float> buf(count, 1.0f);
    const int iters = args.iters > 0 ? args.iters
                                     : static_cast<int>(std::clamp<std::size_t>(
                                           (std::size_t{256} << 20) / (bytes + 4096), 5, 2000));
    for (int i = 0; i < std::max(3, iters / 10); ++i) {
      pg->allreduce(buf.data(), count, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
    }
    pg->barrier()->wait();
    std::vector<double> micros;
    micros.reserve(static_cast<std::size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      pg->allreduce(buf.data(), count, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
      micros.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    if (rank == 0) {
      std::vector<double> sorted = micros;
      std::sort(sorted.begin(), sorted.end());
      const double median = sorted[sorted.size() / 2];
      double mean = 0;
      for (double m : micros)
        mean += m;
      mean /= static_cast<double>(micros.size());
      const double busbw = 2.0 * (args.world - 1) / args.world * static_cast<double>(count * 4) /
                           (median * 1e-6) / 1e9;
      std::printf("%12zu %8d %12.1f %12.1f %12.3f\n", count * 4, iters, median, mean, busbw);
      std::fflush(stdout);
    }
  }
  pg->barrier()->wait();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    const std::uint16_t port = ddp::pick_free_port();
    return run_forked_ranks(args.world, [&](int rank) {
      run_rank(args, rank, port);
      return 0;
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "allreduce_latency: %s\n", e.what());
    return 2;
  }
}
