// What one rank of a job costs at start-up (bench/probes/scale.py runs it under ddprun at growing
// worlds): joins the job (init_process_group), runs one allreduce, then measures this process
// (descriptors open, of them sockets, resident memory) and reduces the numbers over the ranks;
// rank 0 prints one JSON line. Then it checks allreduces of several sizes (--sizes) and, with
// --alltoall, an alltoall (which connects every peer of a lazily connected mesh), and prints the
// descriptors again. Public API only, so that the same file builds against an older ddp.
#include <dirent.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/comm/process_group.h"
#include "ddp/runtime/init.h"

namespace {

double unix_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Open descriptors of this process, and how many of them are sockets.
void count_fds(double& fds, double& sockets) {
  fds = 0;
  sockets = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int own = ::dirfd(dir);
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    if (std::atoi(e->d_name) == own) continue;
    fds += 1;
    char target[256];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    if (n > 0 && std::strncmp(target, "socket:", 7) == 0) sockets += 1;
  }
  ::closedir(dir);
}

// VmRSS in KiB.
double resident_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atof(line.c_str() + 6);
  }
  return 0;
}

// Sum, min and max of `values` over the ranks (one allreduce each).
struct Stats {
  std::vector<double> sum, max, min;
};
Stats reduce(ddp::ProcessGroup& pg, const std::vector<double>& values) {
  Stats s{values, values, values};
  const auto n = values.size();
  pg.allreduce(s.sum.data(), n, ddp::DType::kFloat64, ddp::ReduceOp::kSum)->wait();
  pg.allreduce(s.max.data(), n, ddp::DType::kFloat64, ddp::ReduceOp::kMax)->wait();
  pg.allreduce(s.min.data(), n, ddp::DType::kFloat64, ddp::ReduceOp::kMin)->wait();
  return s;
}

std::vector<std::size_t> parse_sizes(const char* text) {
  std::vector<std::size_t> sizes;
  std::string s = text;
  std::size_t at = 0;
  while (at < s.size()) {
    const auto comma = s.find(',', at);
    sizes.push_back(std::stoul(s.substr(at, comma - at)));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{1, 1000, 100000};  // float32 elements
  bool alltoall = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
      sizes = parse_sizes(argv[++i]);
    } else if (std::strcmp(argv[i], "--alltoall") == 0) {
      alltoall = true;
    } else {
      std::fprintf(stderr, "usage: mesh-scale-probe [--sizes N,N,...] [--alltoall]\n");
      return 2;
    }
  }
  try {
    auto pg = ddp::init_process_group();
    const int rank = pg->rank();
    const int world = pg->size();
    float one = 1.0f;
    pg->allreduce(&one, 1, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
    const double done = unix_seconds();
    if (one != static_cast<float>(world)) throw std::runtime_error("first allreduce is wrong");
    double fds = 0, sockets = 0;
    count_fds(fds, sockets);
    const double rss = resident_kib();
    const Stats s = reduce(*pg, {done, fds, sockets, rss});

    // Correctness of allreduces of several sizes (each algorithm).
    long wrong = 0;
    for (const std::size_t count : sizes) {
      std::vector<float> data(count);
      for (std::size_t i = 0; i < count; ++i)
        data[i] = static_cast<float>((rank % 7) + static_cast<int>(i % 5));
      pg->allreduce(data.data(), count, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
      // sum over ranks of rank % 7, plus world * (i % 5): exact in float32 at these magnitudes.
      double ranks = 0;
      for (int r = 0; r < world; ++r)
        ranks += r % 7;
      for (std::size_t i = 0; i < count; ++i) {
        const double expected = ranks + static_cast<double>(world) * static_cast<double>(i % 5);
        if (static_cast<double>(data[i]) != expected) ++wrong;
      }
    }
    double fds_a2a = -1, sockets_a2a = -1;
    if (alltoall) {
      std::vector<int> send(static_cast<std::size_t>(world)), recv(send.size(), -1);
      for (int p = 0; p < world; ++p)
        send[static_cast<std::size_t>(p)] = rank * 1000 + p;
      pg->alltoall(send.data(), recv.data(), 1, ddp::DType::kInt32)->wait();
      for (int p = 0; p < world; ++p)
        if (recv[static_cast<std::size_t>(p)] != p * 1000 + rank) ++wrong;
      count_fds(fds_a2a, sockets_a2a);
    }
    const Stats after = reduce(*pg, {static_cast<double>(wrong), fds_a2a, sockets_a2a});
    if (rank == 0) {
      std::printf(
          "{\"world\": %d, \"first_collective_done\": %.6f, \"fds_mean\": %.2f, \"fds_max\": "
          "%.0f, \"sockets_mean\": %.2f, \"sockets_max\": %.0f, \"rss_kib_mean\": %.0f, "
          "\"rss_kib_max\": %.0f, \"wrong\": %.0f, \"fds_after_alltoall_max\": %.0f, "
          "\"sockets_after_alltoall_max\": %.0f}\n",
          world, s.max[0], s.sum[1] / world, s.max[1], s.sum[2] / world, s.max[2], s.sum[3] / world,
          s.max[3], after.sum[0], after.max[1], after.max[2]);
      std::fflush(stdout);
    }
    pg->barrier()->wait();
    return after.sum[0] == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mesh-scale-probe: %s\n", e.what());
    return 1;
  }
}
