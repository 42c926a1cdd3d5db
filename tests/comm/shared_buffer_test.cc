// Shared buffers (ProcessGroup::allocate_shared_buffer, issue 28): on one host the ranks map each
// other's buffers and an in-place allreduce of one reduces straight from the peers' copies (a
// reduce-scatter reads its input there, an allgather writes its output there). Real
// rank processes over the ring backend's shared-memory transport: every dtype and op against the
// reference and bit for bit against the copying path; the ranks fall back together (and say why)
// when one cannot make or map its copy; a peer killed in a zero-copy allreduce is named within
// seconds.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "comm/comm_test_util.h"
#include "comm/ring/shm/shared_buffers.h"
#include "ddp/error.h"
#include "support/multiprocess.h"
#include "support/sanitizers.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

std::shared_ptr<ProcessGroup> shm_group(const TempDir& dir, int rank, int size,
                                        Milliseconds timeout = 30s) {
  // 4 KiB chunks (and small messages up to 4 KiB): the copying path streams in many chunks.
  RingOptions options{.timeout = timeout, .transport = Transport::kAuto, .shm_slot_bytes = 4096};
  auto pg = make_group(dir.path(), rank, size, options);
  expect(ring_transport_of(*pg) == "shm", "the group does not run over shared memory");
  return pg;
}

// The lowest descriptor number free now (the next open() gets it).
int lowest_free_fd() {
  const int fd = ::dup(0);
  ::close(fd);
  return fd;
}

// World 4 (the rank order of a reduction matters from 3 ranks on): every dtype and op, at counts
// around the slices' cache-line rounding, at offset 0 and inside the buffer, equal to the
// reference; random floats bit for bit equal to the copying path; each of these calls counted as
// zero-copy, and none of the calls that cannot be.
TEST(SharedBuffers, InPlaceAllreduceReadsThePeersCopiesAndEqualsTheCopyingPath) {
  constexpr int kWorld = 4;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld);
    constexpr std::size_t kBytes = 3 << 20;
    std::string why = "unset";
    auto buffer = pg->allocate_shared_buffer(kBytes, &why);
    expect(buffer != nullptr, "no shared buffer: " + why);
    expect(why.empty(), "why_not is set on success: " + why);
    auto* base = static_cast<std::byte*>(buffer.get());
    for (std::size_t i = 0; i < kBytes; ++i)
      expect(base[i] == std::byte{0}, "a new shared buffer is not zeroed");
    long long zero_copy = 0;
    auto check_counted = [&](long long expected, const std::string& what) {
      const long long now = ring_shared_buffer_allreduces_of(*pg);
      expect(now == expected, fmt::format("rank {}: {}: {} zero-copy allreduces, expected {}", rank,
                                          what, now, expected));
    };
    int salt = 0;
    for (const DType dtype : kAllDTypes) {
      for (const ReduceOp op : kAllOps) {
        if (!reduces(dtype, op)) continue;
        for (const std::size_t count : {std::size_t{1000}, std::size_t{4099}, std::size_t{65537}}) {
          for (const std::size_t offset : {std::size_t{0}, std::size_t{4096 + 64}}) {
            ++salt;
            const std::size_t bytes = count * dtype_size(dtype);
            const auto input = make_input(dtype, count, rank, salt);
            std::memcpy(base + offset, input.data(), bytes);
            pg->allreduce(base + offset, count, dtype, op)->wait();
            const std::string what = fmt::format("{} {} x {} at offset {}", to_string(op),
                                                 to_string(dtype), count, offset);
            expect_bytes(std::vector<std::byte>(base + offset, base + offset + bytes),
                         expected_reduction(dtype, op, count, kWorld, salt), dtype, what);
            // Messages of at most 4 KiB (the slot size here) take the small path.
            if (bytes > 4096) ++zero_copy;
            check_counted(zero_copy, what);
          }
        }
      }
    }
    // Rounding order: random floats, the same bits as the copying path on a private buffer.
    std::mt19937 random(1234 + rank);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    constexpr std::size_t kCount = 500'001;
    std::vector<float> values(kCount);
    for (auto& v : values)
      v = uniform(random);
    std::vector<float> copied = values;
    auto* shared = reinterpret_cast<float*>(base + 128);
    std::memcpy(shared, values.data(), kCount * sizeof(float));
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::memcpy(shared, values.data(), kCount * sizeof(float));
      copied = values;
      pg->allreduce(shared, kCount, DType::kFloat32, op)->wait();
      pg->allreduce(copied.data(), kCount, DType::kFloat32, op)->wait();
      expect(std::memcmp(shared, copied.data(), kCount * sizeof(float)) == 0,
             fmt::format("rank {}: {} of random floats differs from the copying path", rank,
                         to_string(op)));
      check_counted(++zero_copy, "random floats");
    }
    // Not zero-copy: ranks at different offsets (each reduces its own range, correctly), one rank
    // with a private buffer, and out of place.
    std::vector<float> ones(20'000, 1.0f);
    auto* at = reinterpret_cast<float*>(base + 64 * static_cast<std::size_t>(rank));
    std::memcpy(at, ones.data(), ones.size() * sizeof(float));
    pg->allreduce(at, ones.size(), DType::kFloat32, ReduceOp::kSum)->wait();
    expect(at[0] == kWorld && at[ones.size() - 1] == kWorld, "different offsets: wrong sum");
    std::vector<float> mine = ones;
    float* data = rank == 2 ? mine.data() : reinterpret_cast<float*>(base);
    std::memcpy(data, ones.data(), ones.size() * sizeof(float));
    pg->allreduce(data, ones.size(), DType::kFloat32, ReduceOp::kSum)->wait();
    expect(data[0] == kWorld && data[ones.size() - 1] == kWorld, "one private buffer: wrong sum");
    std::vector<float> out(ones.size());
    std::memcpy(base, ones.data(), ones.size() * sizeof(float));
    pg->allreduce(base, out.data(), ones.size(), DType::kFloat32, ReduceOp::kSum)->wait();
    expect(out[0] == kWorld, "out of place: wrong sum");
    check_counted(zero_copy, "calls that cannot be zero-copy");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// World 4: a reduce-scatter whose input lies in a shared buffer at the same offset on every rank
// reduces each block straight from the peers' copies, and an allgather whose output does writes
// each block straight into them: every dtype and op against the reference, random floats bit for
// bit against the copying path, an in-place allgather, each call counted as zero-copy; calls
// made again at once (a rank overwrites its input while a slow peer might still read it, unless
// the call's last synchronisation holds it); and the calls that cannot be zero-copy correct and
// not counted.
TEST(SharedBuffers, ReduceScatterFromAndAllgatherIntoSharedBuffersEqualTheCopyingPath) {
  constexpr int kWorld = 4;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld);
    constexpr std::size_t kBytes = 5 << 20;
    std::string why;
    auto buffer = pg->allocate_shared_buffer(kBytes, &why);
    expect(buffer != nullptr, "no shared buffer: " + why);
    auto* base = static_cast<std::byte*>(buffer.get());
    long long scatters = 0, gathers = 0;
    auto check_counted = [&](const std::string& what) {
      const long long rs = ring_shared_buffer_reduce_scatters_of(*pg);
      const long long ag = ring_shared_buffer_allgathers_of(*pg);
      expect(rs == scatters && ag == gathers,
             fmt::format("rank {}: {}: {} zero-copy reduce-scatters and {} allgathers, expected "
                         "{} and {}",
                         rank, what, rs, ag, scatters, gathers));
    };
    int salt = 0;
    for (const DType dtype : kAllDTypes) {
      const std::size_t esize = dtype_size(dtype);
      for (const std::size_t per_rank : {std::size_t{1}, std::size_t{1001}, std::size_t{70001}}) {
        for (const std::size_t offset : {std::size_t{0}, std::size_t{4096 + 64}}) {
          const std::size_t count = per_rank * kWorld;
          const std::size_t block = per_rank * esize;
          for (const ReduceOp op : kAllOps) {
            if (!reduces(dtype, op)) continue;
            ++salt;
            const auto input = make_input(dtype, count, rank, salt);
            std::memcpy(base + offset, input.data(), count * esize);
            std::vector<std::byte> out(block);
            pg->reduce_scatter(base + offset, out.data(), per_rank, dtype, op)->wait();
            const std::string what = fmt::format("reduce-scatter {} {} x {} at offset {}",
                                                 to_string(op), to_string(dtype), count, offset);
            const auto all = expected_reduction(dtype, op, count, kWorld, salt);
            const auto* mine = all.data() + static_cast<std::size_t>(rank) * block;
            expect_bytes(out, std::vector<std::byte>(mine, mine + block), dtype, what);
            ++scatters;
            check_counted(what);
          }
          // Allgather: each rank's block is its input (salted), from a private buffer and then in
          // place (send is this rank's block of the shared output).
          ++salt;
          std::vector<std::vector<std::byte>> blocks;
          for (int r = 0; r < kWorld; ++r)
            blocks.push_back(make_input(dtype, per_rank, r, salt));
          for (const bool in_place : {false, true}) {
            std::byte* out = base + offset;
            std::memset(out, 0xab, count * esize);
            std::byte* send = out + static_cast<std::size_t>(rank) * block;
            std::vector<std::byte> own = blocks[static_cast<std::size_t>(rank)];
            if (in_place) {
              std::memcpy(send, own.data(), block);
            } else {
              send = own.data();
            }
            pg->allgather(send, out, per_rank, dtype)->wait();
            for (int r = 0; r < kWorld; ++r) {
              expect(
                  std::memcmp(out + static_cast<std::size_t>(r) * block,
                              blocks[static_cast<std::size_t>(r)].data(), block) == 0,
                  fmt::format("rank {}: allgather{} {} x {} at offset {}: block {} differs", rank,
                              in_place ? " in place" : "", to_string(dtype), per_rank, offset, r));
            }
            ++gathers;
            check_counted("allgather");
          }
        }
      }
    }
    // Rounding order: random floats, the same bits as the copying path from a private buffer.
    std::mt19937 random(99 + rank);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    constexpr std::size_t kPerRank = 250'001;
    std::vector<float> values(kPerRank * kWorld);
    for (auto& v : values)
      v = uniform(random);
    auto* shared = reinterpret_cast<float*>(base + 256);
    std::memcpy(shared, values.data(), values.size() * sizeof(float));
    for (const ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      std::vector<float> zero_copy(kPerRank), copied(kPerRank);
      pg->reduce_scatter(shared, zero_copy.data(), kPerRank, DType::kFloat32, op)->wait();
      pg->reduce_scatter(values.data(), copied.data(), kPerRank, DType::kFloat32, op)->wait();
      expect(std::memcmp(zero_copy.data(), copied.data(), kPerRank * sizeof(float)) == 0,
             fmt::format("rank {}: reduce-scatter {} of random floats differs from the copying "
                         "path",
                         rank, to_string(op)));
      ++scatters;
      check_counted("random floats");
    }
    // Not zero-copy: ranks at different offsets, one rank with a private buffer (each correct).
    constexpr std::size_t kSmall = 5000;
    std::vector<float> ones(kSmall * kWorld, 1.0f), out(kSmall);
    auto* at = reinterpret_cast<float*>(base + 64 * static_cast<std::size_t>(rank));
    std::memcpy(at, ones.data(), ones.size() * sizeof(float));
    pg->reduce_scatter(at, out.data(), kSmall, DType::kFloat32, ReduceOp::kSum)->wait();
    expect(out[0] == kWorld && out[kSmall - 1] == kWorld, "different offsets: wrong sum");
    std::vector<float> gathered(kSmall * kWorld);
    float* into = rank == 2 ? gathered.data() : reinterpret_cast<float*>(base);
    std::vector<float> mine(kSmall, static_cast<float>(rank));
    pg->allgather(mine.data(), into, kSmall, DType::kFloat32)->wait();
    for (int r = 0; r < kWorld; ++r)
      expect(into[static_cast<std::size_t>(r) * kSmall] == static_cast<float>(r),
             "one private output: wrong block");
    check_counted("calls that cannot be zero-copy");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Buffers are freed and made again (DDP rebuilds its buckets): the new ones work, the old ones
// are gone from the registry; a range that runs past the end of a buffer is not zero-copy.
TEST(SharedBuffers, FreedBuffersLeaveAndNewOnesWork) {
  constexpr int kWorld = 2;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld);
    for (int round = 0; round < 5; ++round) {
      const std::size_t count = 100'000 + 1000 * static_cast<std::size_t>(round);
      auto first = pg->allocate_shared_buffer(count * sizeof(float));
      auto second = pg->allocate_shared_buffer(count * sizeof(float));
      expect(first && second, "no shared buffer");
      for (auto* buffer : {&first, &second}) {
        auto* data = static_cast<float*>(buffer->get());
        for (std::size_t i = 0; i < count; ++i)
          data[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 7);
        pg->allreduce(data, count, DType::kFloat32, ReduceOp::kSum)->wait();
        for (std::size_t i = 0; i < count; i += 997)
          expect(data[i] == 3.0f * static_cast<float>(i % 7),
                 fmt::format("round {}: element {} is {}", round, i, data[i]));
      }
      first.reset();
    }
    expect(ring_shared_buffer_allreduces_of(*pg) == 10, "not every allreduce was zero-copy");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A group where rank 1 cannot have shared buffers: `make_it_fail(rank)` runs on every rank before
// its allocation and `restore(rank)` after; every rank must get null, rank 1 saying `reason` and
// the others `others_say`. Then a buffer can be made and used as usual.
void expect_all_refused_then_usable(const std::function<void(int)>& make_it_fail,
                                    const std::function<void(int)>& restore,
                                    const std::string& reason, const std::string& others_say) {
  constexpr int kWorld = 3;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld);
    std::string why;
    make_it_fail(rank);
    auto buffer = pg->allocate_shared_buffer(1 << 20, &why);
    restore(rank);
    expect(buffer == nullptr, "a buffer was made");
    const std::string want = rank == 1 ? reason : others_say;
    expect(why.find(want) != std::string::npos,
           fmt::format("rank {}: '{}' does not say '{}'", rank, why, want));
    // Still usable, and the next buffer works.
    auto good = pg->allocate_shared_buffer(1 << 20, &why);
    expect(good != nullptr, "no buffer after the failure: " + why);
    auto* data = static_cast<float*>(good.get());
    for (int i = 0; i < 1 << 18; ++i)
      data[i] = 1.0f;
    pg->allreduce(data, 1 << 18, DType::kFloat32, ReduceOp::kSum)->wait();
    expect(data[12345] == kWorld, "wrong sum after the failure");
    expect(ring_shared_buffer_allreduces_of(*pg) == 1, "the allreduce was not zero-copy");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// DDP_SHM_SHARED_BUFFERS=0 on one rank: null everywhere, every rank names it. Ranks asking for
// different sizes: a ConfigError on every rank. Over TCP: null, no reason.
TEST(SharedBuffers, OneRankWithSharedBuffersOffOrOtherSizesOrTcpGetNone) {
  expect_all_refused_then_usable(
      [](int rank) {
        if (rank == 1) ::setenv("DDP_SHM_SHARED_BUFFERS", "0", 1);
      },
      [](int) { ::unsetenv("DDP_SHM_SHARED_BUFFERS"); }, "DDP_SHM_SHARED_BUFFERS=0",
      "rank 1 has DDP_SHM_SHARED_BUFFERS=0");
  constexpr int kWorld = 3;
  TempDir dir, tcp_dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld);
    try {
      pg->allocate_shared_buffer(rank == 2 ? 8192 : 4096);
      throw std::runtime_error("different sizes were accepted");
    } catch (const ConfigError& e) {
      expect(std::string(e.what()).find("same size") != std::string::npos, e.what());
    }
    try {
      pg->allocate_shared_buffer(0);
      throw std::runtime_error("a buffer of 0 bytes was accepted");
    } catch (const ConfigError& e) {
      expect(std::string(e.what()).find("bytes is 0") != std::string::npos, e.what());
    }
    auto tcp = make_group(tcp_dir.path(), rank, kWorld,
                          {.timeout = 30s, .group_name = "tcp", .transport = Transport::kTcp});
    std::string why = "unset";
    expect(tcp->allocate_shared_buffer(4096, &why) == nullptr && why.empty(),
           "over TCP: a buffer, or a reason: " + why);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Rank 1 out of descriptors (RLIMIT_NOFILE at its lowest free one): for its own copy, or (one
// more) for opening a peer's. Null everywhere, rank 1 saying why, the others naming rank 1.
TEST(SharedBuffers, RankOutOfDescriptorsForItsCopyOrAPeersFallsBackWithEveryRank) {
#if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
  GTEST_SKIP() << "not under a sanitizer: its own memory checks open a pipe, which a process "
                  "with no free descriptor cannot (false reports)";
#endif
  static rlimit saved{};
  auto limit_descriptors = [](int rank, int extra) {
    if (rank != 1) return;
    ::getrlimit(RLIMIT_NOFILE, &saved);
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(lowest_free_fd() + extra);
    ::setrlimit(RLIMIT_NOFILE, &low);
  };
  auto restore = [](int rank) {
    if (rank == 1) ::setrlimit(RLIMIT_NOFILE, &saved);
  };
  expect_all_refused_then_usable([&](int rank) { limit_descriptors(rank, 0); }, restore,
                                 "Too many open files",
                                 "rank 1 could not make its copy (its log says why)");
  expect_all_refused_then_usable([&](int rank) { limit_descriptors(rank, 1); }, restore,
                                 "could not map rank 0's copy: cannot open",
                                 "rank 1 could not map a peer's copy");
}

// What a rank opens through /proc/<pid>/fd/<fd> must be a sealed memfd of the agreed size: an
// unsealed one, one of another size, or a descriptor that is not open are refused by name.
TEST(SharedBuffers, APeersCopyIsMappedOnlyWhenSealedAndOfTheAgreedSize) {
  constexpr std::size_t kBytes = 8192;
  std::string error;
  const int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, kBytes), 0);
  EXPECT_EQ(comm::shm::map_peer_copy(::getpid(), unsealed, kBytes, error), nullptr);
  EXPECT_NE(error.find("is not a sealed shared buffer of 8192 bytes"), std::string::npos) << error;
  ::close(unsealed);

  comm::shm::OwnSharedMemory own;
  ASSERT_EQ(own.create(kBytes, "ddp-test"), "");
  error.clear();
  EXPECT_EQ(comm::shm::map_peer_copy(::getpid(), own.fd(), 2 * kBytes, error), nullptr);
  EXPECT_NE(error.find("is not a sealed shared buffer of 16384 bytes"), std::string::npos) << error;
  error.clear();
  std::byte* mapped = comm::shm::map_peer_copy(::getpid(), own.fd(), kBytes, error);
  ASSERT_NE(mapped, nullptr) << error;
  ::munmap(mapped, kBytes);

  const int closed = ::dup(0);
  ::close(closed);
  error.clear();
  EXPECT_EQ(comm::shm::map_peer_copy(::getpid(), closed, kBytes, error), nullptr);
  EXPECT_NE(error.find("cannot open /proc/"), std::string::npos) << error;
}

// A peer killed before a zero-copy allreduce: the others fail within seconds with an error naming
// it (the domain's failure rules hold on this path too).
TEST(SharedBuffers, PeerKilledBeforeAZeroCopyAllreduceIsNamedWithinSeconds) {
  constexpr int kWorld = 3;
  TempDir dir;
  auto results = run_ranks(kWorld, [&](int rank) {
    auto pg = shm_group(dir, rank, kWorld, 60s);
    constexpr std::size_t kCount = 1 << 20;
    auto buffer = pg->allocate_shared_buffer(kCount * sizeof(float));
    expect(buffer != nullptr, "no shared buffer");
    auto* data = static_cast<float*>(buffer.get());
    pg->allreduce(data, kCount, DType::kFloat32, ReduceOp::kSum)->wait();
    pg->barrier()->wait();
    if (rank == 2) ::kill(::getpid(), SIGKILL);
    const auto start = std::chrono::steady_clock::now();
    try {
      pg->allreduce(data, kCount, DType::kFloat32, ReduceOp::kSum)->wait();
      throw std::runtime_error("the allreduce succeeded without rank 2");
    } catch (const CommError& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      expect(took < 10s, fmt::format("the error took {} ms",
                                     std::chrono::duration_cast<Milliseconds>(took).count()));
      // Rank 0 or 1 may learn it from the other, which aborts the group naming rank 2.
      const std::string what = e.what();
      expect(what.find("rank 2 (pid") != std::string::npos &&
                 what.find("exited or was killed") != std::string::npos,
             "the error does not name rank 2: " + what);
    }
  });
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_TRUE(results[1].ok()) << describe(results);
  EXPECT_EQ(results[2].signal, SIGKILL) << describe(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
