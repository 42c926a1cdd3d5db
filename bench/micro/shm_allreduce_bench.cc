// shm_allreduce_bench: allreduce (float32, sum) of the shared-memory engine (src/comm/shm), timed
// the way bench/compare/mpi_allreduce.c times OpenMPI so the two can be put side by side.
//
//   shm_allreduce_bench [--world N] [--sizes 1K,64K,1M,16M,64M] [--iters K] [--warmup W]
//                       [--slot-bytes B] [--small-bytes B] [--spin-us U] [--yield-us U]
//                       [--bind|--no-bind] [--memcpy]
//
// Forks N ranks on this host, or, when RANK and WORLD_SIZE are set (ddprun/torchrun), runs as one
// of them and meets the others through the TcpStore at MASTER_ADDR:MASTER_PORT. Every iteration
// starts with a barrier (not timed); each rank times its own allreduce; the per-iteration times
// are reduced with MAX over ranks and rank 0 prints the median: time in µs, algbw (bytes / time)
// and busbw (algbw * 2(N-1)/N). The result of the last iteration is checked. --memcpy also prints
// the single-thread memcpy bandwidth of a 256 MiB buffer, the memory limit the results face.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "byte_sizes.h"
#include "comm/ring/shm/shm_domain.h"
#include "ddp/store/tcp_store.h"
#include "forked_ranks.h"
#include "net/socket.h"

namespace {

using ddp::Collective;
using ddp::comm::OpHeader;
using ddp::comm::shm::ShmDomain;
using ddp::comm::shm::ShmOptions;

struct Args {
  int world = 2;
  std::vector<std::size_t> sizes = {1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  int iters = 0;  // 0: chosen per size
  int warmup = 5;
  ShmOptions shm;
  bool memcpy_bandwidth = false;
  // Pin rank r to core r, as mpirun does (--bind-to core) when ranks do not outnumber cores.
  // -1: bind when world <= cores.
  int bind = -1;
};

int usable_cores() {
  cpu_set_t set;
  return ::sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
}

// Pins this process to the rank-th core it may use; returns the core, or -1.
int bind_to_core(int rank) {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    if (seen++ == rank) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      return ::sched_setaffinity(0, sizeof one, &one) == 0 ? cpu : -1;
    }
  }
  return -1;
}

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
    } else if (flag == "--iters") {
      args.iters = std::stoi(value());
    } else if (flag == "--warmup") {
      args.warmup = std::stoi(value());
    } else if (flag == "--slot-bytes") {
      args.shm.slot_bytes = parse_byte_size(value());
    } else if (flag == "--small-bytes") {
      args.shm.small_bytes = parse_byte_size(value());
    } else if (flag == "--spin-us") {
      args.shm.spin = std::chrono::microseconds(std::stoi(value()));
    } else if (flag == "--yield-us") {
      args.shm.yield = std::chrono::microseconds(std::stoi(value()));
    } else if (flag == "--bind") {
      args.bind = 1;
    } else if (flag == "--no-bind") {
      args.bind = 0;
    } else if (flag == "--memcpy") {
      args.memcpy_bandwidth = true;
    } else if (flag == "--sizes") {
      args.sizes = parse_byte_sizes(value());
    } else {
      throw std::runtime_error(
          "unknown flag " + flag +
          " (--world N --sizes 1K,1M --iters K --warmup W --slot-bytes B "
          "--small-bytes B --spin-us U --yield-us U --bind --no-bind --memcpy)");
    }
  }
  if (args.world < 1) throw std::runtime_error("--world must be at least 1");
  return args;
}

void print_memcpy_bandwidth() {
  const std::size_t bytes = std::size_t{256} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::vector<double> seconds;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(seconds.begin(), seconds.end());
  const double copy = static_cast<double>(bytes) / seconds[seconds.size() / 2] / 1e9;
  std::printf(
      "# memcpy 256 MiB (one thread): %.2f GB/s copied = %.2f GB/s of memory traffic "
      "(read + write)\n",
      copy, 2 * copy);
}

OpHeader make_header(Collective kind, std::size_t count, std::uint64_t sequence,
                     ddp::DType dtype = ddp::DType::kFloat32) {
  OpHeader h;
  h.kind = kind;
  h.dtype = static_cast<std::uint8_t>(dtype);
  h.reduce_op = kind == Collective::kAllreduce ? static_cast<std::uint8_t>(ddp::ReduceOp::kSum)
                                               : ddp::comm::kNoReduceOp;
  h.count = count;
  h.sequence = sequence;
  return h;
}

int run_rank(const Args& args, int rank, int world, const std::string& host, std::uint16_t port) {
  const bool bind = args.bind == 1 || (args.bind == -1 && world <= usable_cores());
  if (bind) {
    const char* local_rank = std::getenv("LOCAL_RANK");  // under ddprun/torchrun
    bind_to_core((local_rank != nullptr ? std::atoi(local_rank) : rank) % usable_cores());
  }
  auto store = std::make_shared<ddp::TcpStore>(
      host, port, ddp::TcpStoreOptions{.is_server = rank == 0, .num_workers = world});
  auto deadline = [] { return ddp::net::deadline_after(std::chrono::seconds(120)); };
  auto domain = ShmDomain::create(*store, "shm_bench", rank, world, args.shm, deadline());
  std::uint64_t seq = 0;
  if (rank == 0) {
    if (args.memcpy_bandwidth) print_memcpy_bandwidth();
    std::printf(
        "# world %d, float32 sum, shared memory (slot %zu B, small <= %zu B, spin %lld us when "
        "ranks <= cores, yield until %lld us), ranks %s\n",
        world, args.shm.slot_bytes, args.shm.small_bytes,
        static_cast<long long>(args.shm.spin.count()),
        static_cast<long long>(args.shm.yield.count()), bind ? "bound to cores" : "not bound");
    std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "median_us", "algbw_GB/s",
                "busbw_GB/s");
  }
  const std::size_t largest = *std::max_element(args.sizes.begin(), args.sizes.end());
  std::vector<float> send(std::max<std::size_t>(1, largest / 4), 1.0f);
  std::vector<float> recv(send.size(), 0.0f);
  int wrong_total = 0;
  for (std::size_t bytes : args.sizes) {
    const std::size_t count = std::max<std::size_t>(1, bytes / 4);
    const int iters = args.iters > 0 ? args.iters
                                     : static_cast<int>(std::clamp<std::size_t>(
                                           (std::size_t{512} << 20) / (bytes + 4096), 10, 2000));
    for (int i = 0; i < args.warmup; ++i) {
      domain->allreduce(send.data(), recv.data(), count, ddp::DType::kFloat32, ddp::ReduceOp::kSum,
                        make_header(Collective::kAllreduce, count, seq++), deadline());
    }
    std::vector<double> micros(static_cast<std::size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      domain->barrier(make_header(Collective::kBarrier, 0, seq++), deadline());
      const auto t0 = std::chrono::steady_clock::now();
      domain->allreduce(send.data(), recv.data(), count, ddp::DType::kFloat32, ddp::ReduceOp::kSum,
                        make_header(Collective::kAllreduce, count, seq++), deadline());
      micros[static_cast<std::size_t>(i)] =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    int wrong = 0;
    for (std::size_t i = 0; i < count; ++i)
      wrong += recv[i] != static_cast<float>(world);
    wrong_total += wrong;
    // The slowest rank decides each iteration.
    std::vector<double> slowest(micros.size());
    OpHeader h = make_header(Collective::kAllreduce, micros.size(), seq++, ddp::DType::kFloat64);
    h.reduce_op = static_cast<std::uint8_t>(ddp::ReduceOp::kMax);
    domain->allreduce(micros.data(), slowest.data(), micros.size(), ddp::DType::kFloat64,
                      ddp::ReduceOp::kMax, h, deadline());
    if (rank == 0) {
      std::sort(slowest.begin(), slowest.end());
      const double median = slowest[slowest.size() / 2];
      const double algbw = static_cast<double>(count * 4) / (median * 1e-6) / 1e9;
      std::printf("%12zu %8d %12.1f %12.3f %12.3f%s\n", count * 4, iters, median, algbw,
                  algbw * 2.0 * (world - 1) / world,
                  wrong ? fmt::format("  WRONG: {} elements", wrong).c_str() : "");
      std::fflush(stdout);
    }
  }
  domain->barrier(make_header(Collective::kBarrier, 0, seq++), deadline());
  return wrong_total == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args args = parse(argc, argv);
    const char* env_rank = std::getenv("RANK");
    const char* env_world = std::getenv("WORLD_SIZE");
    if (env_rank != nullptr && env_world != nullptr) {  // launched by ddprun / torchrun
      const char* addr = std::getenv("MASTER_ADDR");
      const char* port = std::getenv("MASTER_PORT");
      if (addr == nullptr || port == nullptr) {
        throw std::runtime_error("RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not");
      }
      return run_rank(args, std::stoi(env_rank), std::stoi(env_world), addr,
                      static_cast<std::uint16_t>(std::stoi(port)));
    }
    const std::uint16_t port = ddp::net::pick_free_port();
    return run_forked_ranks(
        args.world, [&](int rank) { return run_rank(args, rank, args.world, "127.0.0.1", port); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shm_allreduce_bench: %s\n", e.what());
    return 2;
  }
}
