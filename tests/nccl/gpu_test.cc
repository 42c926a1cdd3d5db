// The nccl backend on real GPUs (label gpu): every collective at world 1 and at world = the
// device count (when at least 2: NCCL refuses two ranks on one GPU), checked against values
// computed on the host; the mismatch check; a timeout when a rank does not call. Device memory
// comes from the backend's own dlopen table (torch-free).
//
// The parent process never touches CUDA (a CUDA context does not survive fork): it counts the
// devices in a child, and every rank runs in a child of its own (run_ranks). Each test starts with
// the device check, which skips with "no CUDA device" where there is none.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/file_store.h"
#include "comm/nccl/nccl_library.h"
#include "ddp/comm/comm_error.h"
#include "ddp/comm/nccl_process_group.h"
#include "ddp/error.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;
using comm::nccl::NcclLibrary;

// cudaGetDeviceCount in a child (0 when it fails or the libraries are missing).
int device_count() {
  static const int count = [] {
    const pid_t child = ::fork();
    if (child == 0) {
      int n = 0;
      try {
        if (NcclLibrary::load("").GetDeviceCount(&n) != cudaSuccess) n = 0;
      } catch (...) {
        n = 0;
      }
      ::_exit(std::min(n, 100));
    }
    int status = 0;
    if (child < 0 || ::waitpid(child, &status, 0) != child || !WIFEXITED(status)) return 0;
    return WEXITSTATUS(status);
  }();
  return count;
}

#define REQUIRE_CUDA_DEVICES(n)                                                                \
  do {                                                                                         \
    if (device_count() == 0) GTEST_SKIP() << "no CUDA device";                                 \
    if (device_count() < (n))                                                                  \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, this machine has " << device_count(); \
  } while (false)

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// A device array of T on the current device, through the backend's table.
template <class T>
class DeviceArray {
 public:
  DeviceArray(const NcclLibrary& lib, std::size_t n) : lib_(lib), n_(n) {
    require(lib_.Malloc(&data_, std::max<std::size_t>(n, 1) * sizeof(T)) == cudaSuccess,
            "cudaMalloc");
    require(
        lib_.Memcpy(data_, std::vector<T>(std::max<std::size_t>(n, 1)).data(),
                    std::max<std::size_t>(n, 1) * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess,
        "cudaMemcpy (zeroing)");
  }
  DeviceArray(const NcclLibrary& lib, const std::vector<T>& values)
      : DeviceArray(lib, values.size()) {
    upload(values);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { lib_.Free(data_); }
  T* get() const { return static_cast<T*>(data_); }
  void upload(const std::vector<T>& values) {
    require(values.size() == n_, "upload size");
    require(
        lib_.Memcpy(data_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess,
        "cudaMemcpy to the device");
  }
  std::vector<T> download() const {
    std::vector<T> values(n_);
    require(
        lib_.Memcpy(values.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess,
        "cudaMemcpy to the host");
    return values;
  }

 private:
  const NcclLibrary& lib_;
  std::size_t n_;
  void* data_ = nullptr;
};

template <class T>
void expect_values(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  if (got != want) {
    throw std::runtime_error(fmt::format(
        "{}: got {} want {}", what,
        fmt::join(got.begin(), got.begin() + std::min<std::size_t>(got.size(), 16), ", "),
        fmt::join(want.begin(), want.begin() + std::min<std::size_t>(want.size(), 16), ", ")));
  }
}

std::shared_ptr<ProcessGroup> make_group(const std::filesystem::path& dir, int rank, int size,
                                         std::chrono::milliseconds timeout = 60s) {
  auto store = std::make_shared<test::FileStore>(dir);
  return make_nccl_process_group(store, rank, size, {.timeout = timeout, .device = rank});
}

// Every collective of the front on one rank of `pg`, checked against the host's arithmetic.
void check_every_collective(ProcessGroup& pg, const NcclLibrary& lib) {
  const int n = pg.size();
  const int r = pg.rank();
  const auto N = static_cast<std::size_t>(n);
  require(pg.backend() == "nccl", "backend");
  require(pg.memory_space() == MemorySpace::kCuda, "memory space");
  constexpr std::size_t c = 5;

  // allreduce: sum, avg, max, product (float32), a large sum (several NCCL chunks), int64 sum.
  {
    // Small integers, so that sums, minima and maxima are exact in any order; the product's
    // factors are 1 and 2 (exact powers of two for any world size).
    const auto value = [](ReduceOp op, int q, std::size_t i) {
      if (op == ReduceOp::kProduct) return q % 2 == 0 ? 2.0f : 1.0f;
      return static_cast<float>(q + 1) + static_cast<float>(i);
    };
    for (ReduceOp op :
         {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProduct}) {
      std::vector<float> x(c);
      for (std::size_t i = 0; i < c; ++i)
        x[i] = value(op, r, i);
      DeviceArray<float> send(lib, x);
      DeviceArray<float> recv(lib, c);
      pg.allreduce(send.get(), recv.get(), c, DType::kFloat32, op)->wait();
      std::vector<float> want(c);
      for (std::size_t i = 0; i < c; ++i) {
        float acc = op == ReduceOp::kProduct ? 1.0f : (op == ReduceOp::kMin ? 1e30f : 0.0f);
        for (int q = 0; q < n; ++q) {
          const float v = value(op, q, i);
          if (op == ReduceOp::kSum || op == ReduceOp::kAvg) acc += v;
          if (op == ReduceOp::kMax) acc = std::max(acc, v);
          if (op == ReduceOp::kMin) acc = std::min(acc, v);
          if (op == ReduceOp::kProduct) acc *= v;
        }
        want[i] = op == ReduceOp::kAvg ? acc / static_cast<float>(n) : acc;
      }
      const auto got = recv.download();
      if (op == ReduceOp::kAvg) {
        // NCCL averages floats by pre-multiplying with 1/n, which is not exact for every n.
        for (std::size_t i = 0; i < c; ++i) {
          require(std::abs(got[i] - want[i]) <= 1e-5f * std::abs(want[i]),
                  fmt::format("allreduce avg: element {} is {}, expected {}", i, got[i], want[i]));
        }
      } else {
        expect_values(got, want, fmt::format("allreduce {}", to_string(op)));
      }
    }
    const std::size_t big = (std::size_t{1} << 22) + 3;  // 16 MiB of float32, odd length
    DeviceArray<float> in_place(lib, std::vector<float>(big, static_cast<float>(r + 1)));
    pg.allreduce(in_place.get(), big, DType::kFloat32, ReduceOp::kSum)->wait();
    expect_values(in_place.download(), std::vector<float>(big, static_cast<float>(n * (n + 1) / 2)),
                  "allreduce (16 MiB, in place)");
    DeviceArray<std::int64_t> ints(lib, std::vector<std::int64_t>(c, (std::int64_t{1} << 40) + r));
    pg.allreduce(ints.get(), c, DType::kInt64, ReduceOp::kSum, {.blocking = true});
    expect_values(ints.download(),
                  std::vector<std::int64_t>(c, n * (std::int64_t{1} << 40) + n * (n - 1) / 2),
                  "allreduce int64 (blocking)");
  }
  // allreduce_segments: two separate allocations, one call.
  {
    DeviceArray<float> a(lib, std::vector<float>(3, 1.0f));
    DeviceArray<float> b(lib, std::vector<float>(4, static_cast<float>(r)));
    pg.allreduce_segments({{a.get(), 3}, {b.get(), 4}}, DType::kFloat32, ReduceOp::kSum)->wait();
    expect_values(a.download(), std::vector<float>(3, static_cast<float>(n)), "segments (a)");
    expect_values(b.download(), std::vector<float>(4, static_cast<float>(n * (n - 1) / 2)),
                  "segments (b)");
  }
  // broadcast from the last rank.
  {
    std::vector<float> x(c);
    for (std::size_t i = 0; i < c; ++i)
      x[i] = static_cast<float>(r * 100 + static_cast<int>(i));
    DeviceArray<float> buf(lib, x);
    pg.broadcast(buf.get(), c, DType::kFloat32, n - 1)->wait();
    std::vector<float> want(c);
    for (std::size_t i = 0; i < c; ++i)
      want[i] = static_cast<float>((n - 1) * 100 + static_cast<int>(i));
    expect_values(buf.download(), want, "broadcast");
  }
  // reduce to rank 0.
  {
    DeviceArray<float> send(lib, std::vector<float>(c, static_cast<float>(r + 1)));
    DeviceArray<float> recv(lib, c);
    pg.reduce(send.get(), r == 0 ? recv.get() : nullptr, c, DType::kFloat32, ReduceOp::kSum, 0)
        ->wait();
    if (r == 0) {
      expect_values(recv.download(), std::vector<float>(c, static_cast<float>(n * (n + 1) / 2)),
                    "reduce");
    }
  }
  // allgather, gather (to the last rank), scatter (from rank 0), reduce_scatter, alltoall.
  {
    std::vector<float> mine(c);
    for (std::size_t i = 0; i < c; ++i)
      mine[i] = static_cast<float>(r * 10 + static_cast<int>(i));
    std::vector<float> all(c * N);
    for (int q = 0; q < n; ++q) {
      for (std::size_t i = 0; i < c; ++i)
        all[q * c + i] = static_cast<float>(q * 10 + static_cast<int>(i));
    }
    DeviceArray<float> send(lib, mine);
    DeviceArray<float> recv(lib, c * N);
    pg.allgather(send.get(), recv.get(), c, DType::kFloat32)->wait();
    expect_values(recv.download(), all, "allgather");

    DeviceArray<float> gathered(lib, c * N);
    pg.gather(send.get(), r == n - 1 ? gathered.get() : nullptr, c, DType::kFloat32, n - 1)->wait();
    if (r == n - 1) expect_values(gathered.download(), all, "gather");

    DeviceArray<float> source(lib, all);
    DeviceArray<float> piece(lib, c);
    pg.scatter(r == 0 ? source.get() : nullptr, piece.get(), c, DType::kFloat32, 0)->wait();
    expect_values(piece.download(), mine, "scatter");

    // reduce_scatter: every rank sends `all` + r; block r of the sum is n * block r + n(n-1)/2.
    std::vector<float> shifted = all;
    for (float& v : shifted)
      v += static_cast<float>(r);
    DeviceArray<float> rs_send(lib, shifted);
    DeviceArray<float> rs_recv(lib, c);
    pg.reduce_scatter(rs_send.get(), rs_recv.get(), c, DType::kFloat32, ReduceOp::kSum)->wait();
    std::vector<float> rs_want(c);
    for (std::size_t i = 0; i < c; ++i) {
      rs_want[i] = static_cast<float>(n) * all[static_cast<std::size_t>(r) * c + i] +
                   static_cast<float>(n * (n - 1) / 2);
    }
    expect_values(rs_recv.download(), rs_want, "reduce_scatter");

    // alltoall: block j of rank r's send is r*100 + j*10 + i; block j of its recv is rank j's
    // block r. In place as well (staged on the device).
    std::vector<float> a2a(c * N);
    std::vector<float> a2a_want(c * N);
    for (int j = 0; j < n; ++j) {
      for (std::size_t i = 0; i < c; ++i) {
        a2a[j * c + i] = static_cast<float>(r * 100 + j * 10 + static_cast<int>(i));
        a2a_want[j * c + i] = static_cast<float>(j * 100 + r * 10 + static_cast<int>(i));
      }
    }
    DeviceArray<float> a2a_send(lib, a2a);
    DeviceArray<float> a2a_recv(lib, c * N);
    pg.alltoall(a2a_send.get(), a2a_recv.get(), c, DType::kFloat32)->wait();
    expect_values(a2a_recv.download(), a2a_want, "alltoall");
    pg.alltoall(a2a_send.get(), a2a_send.get(), c, DType::kFloat32)->wait();
    expect_values(a2a_send.download(), a2a_want, "alltoall in place");
  }
  pg.barrier()->wait();
  // The uneven collectives: counts through device scratch, padding on the device.
  {
    std::vector<std::size_t> counts(N);
    std::iota(counts.begin(), counts.end(), std::size_t{1});  // rank q has q + 1 elements
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    DeviceArray<float> send(
        lib, std::vector<float>(static_cast<std::size_t>(r) + 1, static_cast<float>(r)));
    DeviceArray<float> recv(lib, total);
    pg.allgather_v(send.get(), static_cast<std::size_t>(r) + 1, recv.get(), counts, DType::kFloat32)
        ->wait();
    std::vector<float> want;
    for (int q = 0; q < n; ++q)
      want.insert(want.end(), static_cast<std::size_t>(q) + 1, static_cast<float>(q));
    expect_values(recv.download(), want, "allgather_v");

    // alltoall_v: every rank sends j + 1 elements (value r*10 + j) to rank j.
    std::vector<std::size_t> send_counts(N);
    std::iota(send_counts.begin(), send_counts.end(), std::size_t{1});
    std::vector<std::size_t> recv_counts(N, static_cast<std::size_t>(r) + 1);
    std::vector<float> a2a;
    for (int j = 0; j < n; ++j)
      a2a.insert(a2a.end(), static_cast<std::size_t>(j) + 1, static_cast<float>(r * 10 + j));
    std::vector<float> a2a_want;
    for (int j = 0; j < n; ++j)
      a2a_want.insert(a2a_want.end(), static_cast<std::size_t>(r) + 1,
                      static_cast<float>(j * 10 + r));
    DeviceArray<float> a2a_send(lib, a2a);
    DeviceArray<float> a2a_recv(lib, a2a_want.size());
    pg.alltoall_v(a2a_send.get(), send_counts, a2a_recv.get(), recv_counts, DType::kFloat32)
        ->wait();
    expect_values(a2a_recv.download(), a2a_want, "alltoall_v");

    DeviceArray<float> rs_send(lib, std::vector<float>(total, 1.0f));
    DeviceArray<float> rs_recv(lib, static_cast<std::size_t>(r) + 1);
    pg.reduce_scatter_v(rs_send.get(), rs_recv.get(), counts, DType::kFloat32, ReduceOp::kSum)
        ->wait();
    expect_values(rs_recv.download(),
                  std::vector<float>(static_cast<std::size_t>(r) + 1, static_cast<float>(n)),
                  "reduce_scatter_v");
  }
  // Ordering after the caller's stream: a copy queued on it before the call is seen by the call.
  {
    cudaStream_t stream = nullptr;
    require(lib.StreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "stream");
    void* pinned = nullptr;
    require(lib.MallocHost(&pinned, c * sizeof(float)) == cudaSuccess, "cudaMallocHost");
    for (std::size_t i = 0; i < c; ++i)
      static_cast<float*>(pinned)[i] = static_cast<float>(r + 7);
    DeviceArray<float> buf(lib, c);
    require(lib.MemcpyAsync(buf.get(), pinned, c * sizeof(float), cudaMemcpyHostToDevice, stream) ==
                cudaSuccess,
            "cudaMemcpyAsync");
    pg.allreduce(buf.get(), c, DType::kFloat32, ReduceOp::kSum, {.cuda_stream = stream})->wait();
    expect_values(buf.download(),
                  std::vector<float>(c, static_cast<float>(n * 7 + n * (n - 1) / 2)),
                  "allreduce after the caller's stream");
    lib.StreamSynchronize(stream);
    lib.FreeHost(pinned);
    lib.StreamDestroy(stream);
  }
  // Point to point around a ring (small messages: NCCL's buffers hold them, so the send of every
  // rank completes before its recv is posted).
  if (n >= 2) {
    const int next = (r + 1) % n;
    const int prev = (r + n - 1) % n;
    DeviceArray<float> out(lib, std::vector<float>(c, static_cast<float>(r)));
    DeviceArray<float> in(lib, c);
    auto sent = pg.send(out.get(), c, DType::kFloat32, next, 3);
    pg.recv(in.get(), c, DType::kFloat32, prev, 3)->wait();
    sent->wait();
    expect_values(in.download(), std::vector<float>(c, static_cast<float>(prev)), "send/recv");
    // A subgroup of ranks 0 and 1: a communicator of its own.
    auto sub = pg.new_group({0, 1});
    require((sub != nullptr) == (r < 2), "new_group membership");
    if (sub) {
      DeviceArray<float> x(lib, std::vector<float>(c, static_cast<float>(r + 1)));
      sub->allreduce(x.get(), c, DType::kFloat32, ReduceOp::kSum)->wait();
      expect_values(x.download(), std::vector<float>(c, 3.0f), "subgroup allreduce");
    }
  }
  pg.barrier({.blocking = true});
}

TEST(NcclGpu, EveryCollectiveAtWorldOne) {
  REQUIRE_CUDA_DEVICES(1);
  test::TempDir dir;
  const auto results = test::run_ranks(
      1,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 1);
        check_every_collective(*pg, NcclLibrary::load(""));
      },
      240s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclGpu, EveryCollectiveAtOneRankPerDevice) {
  REQUIRE_CUDA_DEVICES(2);
  test::TempDir dir;
  const auto results = test::run_ranks(
      device_count(),
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, device_count());
        check_every_collective(*pg, NcclLibrary::load(""));
      },
      240s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclGpu, AHostBufferIsRefusedByNameBeforeAnythingRuns) {
  REQUIRE_CUDA_DEVICES(1);
  test::TempDir dir;
  const auto results = test::run_ranks(
      1,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 1);
        std::vector<float> host(8, 1.0f);
        for (const bool broadcast : {false, true}) {
          try {
            if (broadcast) {
              pg->broadcast(host.data(), host.size(), DType::kFloat32, 0)->wait();
            } else {
              pg->allreduce(host.data(), host.size(), DType::kFloat32, ReduceOp::kSum)->wait();
            }
            throw std::runtime_error("a host buffer was handed to NCCL");
          } catch (const ConfigError& e) {
            const std::string text = e.what();
            require(text.find("is host memory") != std::string::npos &&
                        text.find("device memory only") != std::string::npos,
                    "the message does not say why: " + text);
          }
        }
        // Nothing was queued: the group still works.
        DeviceArray<float> buf(NcclLibrary::load(""), std::vector<float>(8, 2.0f));
        pg->allreduce(buf.get(), 8, DType::kFloat32, ReduceOp::kSum, {.blocking = true});
        expect_values(buf.download(), std::vector<float>(8, 2.0f), "allreduce after the refusal");
      },
      120s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclGpu, MismatchedCallsAreNamedOnEveryRank) {
  REQUIRE_CUDA_DEVICES(2);
  test::TempDir dir;
  const auto results = test::run_ranks(
      2,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 2, 30s);
        const auto& lib = NcclLibrary::load("");
        DeviceArray<float> buf(lib, 8);
        try {
          pg->allreduce(buf.get(), rank == 0 ? 8 : 4, DType::kFloat32, ReduceOp::kSum)->wait();
        } catch (const CommError& e) {
          const std::string text = e.what();
          require(e.kind() == CommErrorKind::kMismatch,
                  fmt::format("kind {}: {}", to_string(e.kind()), text));
          require(text.find("allreduce(float32 x 8, sum) #0") != std::string::npos &&
                      text.find("allreduce(float32 x 4, sum) #0") != std::string::npos,
                  "the message does not name both calls: " + text);
          // The group is poisoned: a later call fails at once with the same error.
          try {
            pg->barrier()->wait();
          } catch (const CommError& later) {
            require(later.kind() == CommErrorKind::kMismatch, "a later call failed differently");
            return;
          }
          throw std::runtime_error("a call after the mismatch succeeded");
        }
        throw std::runtime_error("mismatched allreduces succeeded");
      },
      120s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclGpu, ARankThatDoesNotCallIsANamedTimeout) {
  REQUIRE_CUDA_DEVICES(2);
  test::TempDir dir;
  const auto results = test::run_ranks(
      2,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, 2, 30s);
        test::FileStore store(dir.path());
        if (rank == 1) {
          // Alive but silent until rank 0 has its error, so the error is the deadline's.
          store.get("timeout_seen", 60s);
          return;
        }
        const auto& lib = NcclLibrary::load("");
        DeviceArray<float> buf(lib, 8);
        const auto start = std::chrono::steady_clock::now();
        try {
          pg->allreduce(buf.get(), 8, DType::kFloat32, ReduceOp::kSum, {.timeout = 2s})->wait();
        } catch (const CommError& e) {
          store.set("timeout_seen", "1");
          const auto waited = std::chrono::steady_clock::now() - start;
          require(e.kind() == CommErrorKind::kTimeout,
                  fmt::format("kind {}: {}", to_string(e.kind()), e.what()));
          require(
              std::string(e.what()).find("did not complete within 2000 ms") != std::string::npos,
              e.what());
          require(waited >= 1900ms && waited < 20s, "the timeout was not the call's deadline");
          return;
        }
        store.set("timeout_seen", "1");
        throw std::runtime_error("an allreduce without its peer succeeded");
      },
      120s);
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace
}  // namespace ddp
