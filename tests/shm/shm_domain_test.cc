// ShmDomain in real processes: every collective against a reference computed here, for world
// sizes 1..4 (and 8), every dtype and op, counts around the chunk and small-path limits; long
// sequences of calls; mismatched calls; a peer killed or stopped (also during set-up); nothing
// left in /dev/shm.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <vector>

#include "comm/ring/shm/segment.h"
#include "shm/shm_test_util.h"
#include "support/multiprocess.h"

namespace ddp::test::shm {
namespace {

// Tiny slots so that modest counts take many chunks and the small path has a low limit.
ShmOptions small_slots(const std::string& prefix) {
  ShmOptions o;
  o.slot_bytes = 4096;
  o.small_bytes = 256;
  o.name_prefix = prefix;
  return o;
}

const std::size_t kCounts[] = {0, 1, 3, 7, 64, 65, 1009, 4099};

void check_allreduce_all(int rank, int size, ShmDomain& domain, Store& store) {
  std::uint64_t seq = 0;
  for (DType dtype : kAllDTypes) {
    const std::size_t esize = dtype_size(dtype);
    for (ReduceOp op : kAllOps) {
      if (!test::reduces(dtype, op)) continue;
      for (std::size_t count : kCounts) {
        std::vector<std::byte> send(count * esize + 1), recv(count * esize + 1);
        for (std::size_t i = 0; i < count; ++i)
          store_value(send.data(), i, dtype, input_value(op, dtype, rank, i));
        domain.allreduce(send.data(), recv.data(), count, dtype, op,
                         header(Collective::kAllreduce, dtype, count, seq++, op), after(20s));
        for (std::size_t i = 0; i < count; ++i) {
          expect_close(load_value(recv.data(), i, dtype), expected_value(op, dtype, size, i), dtype,
                       fmt::format("allreduce {} {} count {} element {} (world {})",
                                   to_string(dtype), to_string(op), count, i, size));
        }
        // In place gives the same.
        domain.allreduce(send.data(), send.data(), count, dtype, op,
                         header(Collective::kAllreduce, dtype, count, seq++, op), after(20s));
        if (std::memcmp(send.data(), recv.data(), count * esize) != 0) {
          throw std::runtime_error(fmt::format("in-place allreduce {} {} count {} differs",
                                               to_string(dtype), to_string(op), count));
        }
      }
    }
  }
  (void)store;
}

class ShmWorld : public ::testing::TestWithParam<int> {};

TEST_P(ShmWorld, AllreduceEveryDtypeOpAndCount) {
  const int size = GetParam();
  StoreDir dir;
  const auto prefix = unique_prefix("ar");
  auto results = run_ranks(size, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, size, small_slots(prefix));
    FileStore store(dir.path());
    check_allreduce_all(rank, size, *domain, store);
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

TEST_P(ShmWorld, AllreduceResultsAreBitIdenticalOnEveryRank) {
  const int size = GetParam();
  StoreDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, size, small_slots(unique_prefix("bits")));
    FileStore store(dir.path());
    std::uint64_t seq = 0;
    // Values whose sums and averages round: any difference in order would show.
    for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat64}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        for (std::size_t count : {std::size_t{50}, std::size_t{3001}}) {
          const std::size_t esize = dtype_size(dtype);
          std::vector<std::byte> send(count * esize), recv(count * esize);
          for (std::size_t i = 0; i < count; ++i)
            store_value(send.data(), i, dtype, 1.0 / (1.0 + rank * 3 + i % 17) + i * 1e-3);
          domain->allreduce(send.data(), recv.data(), count, dtype, op,
                            header(Collective::kAllreduce, dtype, count, seq++, op), after(20s));
          expect_same_on_all_ranks(
              store, fmt::format("bits/{}/{}/{}", to_string(dtype), to_string(op), count), rank,
              size, digest(recv.data(), recv.size()));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(ShmWorld, BroadcastReduceAllgatherReduceScatter) {
  const int size = GetParam();
  StoreDir dir;
  const auto prefix = unique_prefix("colls");
  auto results = run_ranks(size, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, size, small_slots(prefix));
    std::uint64_t seq = 0;
    for (DType dtype : {DType::kFloat32, DType::kInt8, DType::kBFloat16, DType::kInt64}) {
      const std::size_t esize = dtype_size(dtype);
      for (std::size_t count : kCounts) {
        const auto where = [&](const char* what, int root) {
          return fmt::format("{} {} count {} root {} (world {}, rank {})", what, to_string(dtype),
                             count, root, size, rank);
        };
        for (int root = 0; root < size; ++root) {
          // broadcast: the root's values everywhere.
          std::vector<std::byte> buf(count * esize + 1);
          for (std::size_t i = 0; i < count; ++i)
            store_value(buf.data(), i, dtype,
                        input_value(ReduceOp::kSum, dtype, rank == root ? root : rank + 1, i));
          domain->broadcast(
              buf.data(), count, dtype, root,
              header(Collective::kBroadcast, dtype, count, seq++, ReduceOp::kSum, root),
              after(20s));
          for (std::size_t i = 0; i < count; ++i)
            expect_close(load_value(buf.data(), i, dtype),
                         input_value(ReduceOp::kSum, dtype, root, i), dtype,
                         where("broadcast", root) + fmt::format(" element {}", i));
          // reduce (max) to the root.
          std::vector<std::byte> send(count * esize + 1), recv(count * esize + 1);
          for (std::size_t i = 0; i < count; ++i)
            store_value(send.data(), i, dtype, input_value(ReduceOp::kMax, dtype, rank, i));
          domain->reduce(
              send.data(), rank == root ? recv.data() : nullptr, count, dtype, ReduceOp::kMax, root,
              header(Collective::kReduce, dtype, count, seq++, ReduceOp::kMax, root), after(20s));
          if (rank == root) {
            for (std::size_t i = 0; i < count; ++i)
              expect_close(load_value(recv.data(), i, dtype),
                           expected_value(ReduceOp::kMax, dtype, size, i), dtype,
                           where("reduce", root) + fmt::format(" element {}", i));
          }
        }
        // allgather: block r holds rank r's values.
        std::vector<std::byte> mine(count * esize + 1), all(size * count * esize + 1);
        for (std::size_t i = 0; i < count; ++i)
          store_value(mine.data(), i, dtype, input_value(ReduceOp::kSum, dtype, rank, i));
        domain->allgather(mine.data(), all.data(), count, dtype,
                          header(Collective::kAllgather, dtype, count, seq++), after(20s));
        for (int r = 0; r < size; ++r)
          for (std::size_t i = 0; i < count; ++i)
            expect_close(load_value(all.data(), r * count + i, dtype),
                         input_value(ReduceOp::kSum, dtype, r, i), dtype,
                         where("allgather", -1) + fmt::format(" block {} element {}", r, i));
        // reduce_scatter (sum): rank r gets the sum of block r; block b element i uses index
        // b * count + i of the input pattern.
        std::vector<std::byte> blocks(size * count * esize + 1), out(count * esize + 1);
        for (std::size_t j = 0; j < size * count; ++j)
          store_value(blocks.data(), j, dtype, input_value(ReduceOp::kSum, dtype, rank, j));
        domain->reduce_scatter(blocks.data(), out.data(), count, dtype, ReduceOp::kSum,
                               header(Collective::kReduceScatter, dtype, count, seq++), after(20s));
        for (std::size_t i = 0; i < count; ++i)
          expect_close(load_value(out.data(), i, dtype),
                       expected_value(ReduceOp::kSum, dtype, size, rank * count + i), dtype,
                       where("reduce_scatter", -1) + fmt::format(" element {}", i));
        domain->barrier(header(Collective::kBarrier, DType::kFloat32, 0, seq++), after(20s));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmWorld, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return fmt::format("world{}", info.param); });

TEST(ShmDomain, EightRanksAllreduceAndBroadcast) {
  StoreDir dir;
  auto results = run_ranks(8, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, 8, small_slots(unique_prefix("eight")));
    std::uint64_t seq = 0;
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProduct}) {
      for (std::size_t count : {std::size_t{5}, std::size_t{1009}, std::size_t{4099}}) {
        std::vector<float> send(count), recv(count);
        for (std::size_t i = 0; i < count; ++i)
          send[i] = static_cast<float>(input_value(op, DType::kFloat32, rank, i));
        domain->allreduce(send.data(), recv.data(), count, DType::kFloat32, op,
                          header(Collective::kAllreduce, DType::kFloat32, count, seq++, op),
                          after(30s));
        for (std::size_t i = 0; i < count; ++i)
          expect_close(recv[i], expected_value(op, DType::kFloat32, 8, i), DType::kFloat32,
                       fmt::format("8 ranks {} count {} element {}", to_string(op), count, i));
      }
    }
    std::vector<std::int32_t> buf(3000, rank);
    domain->broadcast(
        buf.data(), buf.size(), DType::kInt32, 5,
        header(Collective::kBroadcast, DType::kInt32, buf.size(), seq++, ReduceOp::kSum, 5),
        after(30s));
    for (auto v : buf)
      if (v != 5) throw std::runtime_error(fmt::format("broadcast from 5 gave {}", v));
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ShmDomain, ThousandSmallAllreducesThenLargeOnesKeepInStep) {
  StoreDir dir;
  auto results = run_ranks(4, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, 4, ShmOptions{.name_prefix = unique_prefix("seq")});
    std::uint64_t seq = 0;
    std::vector<float> v(16);
    for (int call = 0; call < 1000; ++call) {
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = static_cast<float>(rank + call + i);
      domain->allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum,
                        header(Collective::kAllreduce, DType::kFloat32, v.size(), seq++),
                        after(20s));
      for (std::size_t i = 0; i < v.size(); ++i) {
        const float want = static_cast<float>(6 + 4 * (call + i));
        if (v[i] != want)
          throw std::runtime_error(
              fmt::format("call {} element {}: got {}, want {}", call, i, v[i], want));
      }
    }
    // Interleave the chunked path (3 MiB > slot) with small calls and barriers.
    std::vector<float> big(3 << 18);
    for (int call = 0; call < 5; ++call) {
      std::fill(big.begin(), big.end(), static_cast<float>(rank + call));
      domain->allreduce(big.data(), big.data(), big.size(), DType::kFloat32, ReduceOp::kSum,
                        header(Collective::kAllreduce, DType::kFloat32, big.size(), seq++),
                        after(20s));
      for (float x : big)
        if (x != static_cast<float>(6 + 4 * call))
          throw std::runtime_error(fmt::format("big call {}: got {}", call, x));
      domain->barrier(header(Collective::kBarrier, DType::kFloat32, 0, seq++), after(20s));
      domain->allreduce(v.data(), v.data(), 1, DType::kFloat32, ReduceOp::kSum,
                        header(Collective::kAllreduce, DType::kFloat32, 1, seq++), after(20s));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A rank that finished the last call exits at once; a peer that wakes from a futex nap just then
// must see that the call completed rather than blame the exited rank. Short naps make the window
// frequent.
TEST(ShmDomain, RanksThatFinishAndExitAreNotBlamed) {
  for (int round = 0; round < 10; ++round) {
    StoreDir dir;
    auto results = run_ranks(4, [&](int rank) {
      ShmOptions options = small_slots(unique_prefix("exit"));
      options.liveness_interval = std::chrono::milliseconds(1);
      auto domain = make_domain(dir.path(), rank, 4, options);
      std::vector<float> v(3000, 1.0f);
      // The last call of a round is, in turn, a small allreduce, a chunked one and a barrier.
      const int calls = 30 + round % 3;
      for (int seq = 0; seq < calls; ++seq) {
        const std::size_t count = seq % 3 == 0 ? 10 : v.size();
        if (seq % 3 == 2) {
          domain->barrier(header(Collective::kBarrier, DType::kFloat32, 0, seq), after(20s));
        } else {
          domain->allreduce(
              v.data(), v.data(), count, DType::kFloat32, ReduceOp::kMax,
              header(Collective::kAllreduce, DType::kFloat32, count, seq, ReduceOp::kMax),
              after(20s));
        }
      }
    });
    EXPECT_ALL_RANKS_OK(results);
  }
}

TEST(ShmDomain, MismatchedCallsNameBothCallsAndRanks) {
  StoreDir dir;
  const auto prefix = unique_prefix("mismatch");
  auto results = run_ranks(3, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, 3, ShmOptions{.name_prefix = prefix});
    std::vector<float> v(2000, 1.0f);
    domain->allreduce(v.data(), v.data(), 10, DType::kFloat32, ReduceOp::kSum,
                      header(Collective::kAllreduce, DType::kFloat32, 10, 0), after(20s));
    // Rank 2 asks for more elements (the large path) while the others stay on the small one.
    const std::size_t count = rank == 2 ? 2000 : 10;
    try {
      domain->allreduce(v.data(), v.data(), count, DType::kFloat32, ReduceOp::kSum,
                        header(Collective::kAllreduce, DType::kFloat32, count, 1), after(20s));
    } catch (const CommError& e) {
      const std::string what = e.what();
      if (what.find("allreduce(float32 x 10, sum) #1") == std::string::npos ||
          what.find("allreduce(float32 x 2000, sum) #1") == std::string::npos ||
          what.find("rank 2") == std::string::npos) {
        throw std::runtime_error("mismatch error does not name both calls: " + what);
      }
      // The group is poisoned: the next call fails at once with the same error.
      try {
        domain->barrier(header(Collective::kBarrier, DType::kFloat32, 0, 2), after(20s));
      } catch (const CommError& again) {
        if (std::string(again.what()) != what) throw std::runtime_error("poisoned error differs");
        return;
      }
      throw std::runtime_error("call after a failure succeeded");
    }
    throw std::runtime_error("mismatched allreduce did not throw");
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

TEST(ShmDomain, DifferentKindsAndRootsAreReported) {
  StoreDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto domain =
        make_domain(dir.path(), rank, 2, ShmOptions{.name_prefix = unique_prefix("kind")});
    std::vector<float> v(8, 1.0f);
    try {
      if (rank == 0) {
        domain->broadcast(v.data(), 8, DType::kFloat32, 0,
                          header(Collective::kBroadcast, DType::kFloat32, 8, 0, ReduceOp::kSum, 0),
                          after(20s));
      } else {
        domain->broadcast(v.data(), 8, DType::kFloat32, 1,
                          header(Collective::kBroadcast, DType::kFloat32, 8, 0, ReduceOp::kSum, 1),
                          after(20s));
      }
    } catch (const CommError& e) {
      const std::string what = e.what();
      if (what.find("root 0") == std::string::npos || what.find("root 1") == std::string::npos)
        throw std::runtime_error("error does not name both roots: " + what);
      return;
    }
    throw std::runtime_error("broadcasts with different roots did not throw");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ShmDomain, KilledPeerIsReportedWithinTwoSeconds) {
  StoreDir dir;
  const auto prefix = unique_prefix("kill");
  const auto before = shm_entries(prefix);
  auto results = run_ranks(3, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, 3, ShmOptions{.name_prefix = prefix});
    FileStore store(dir.path());
    store.set(fmt::format("pid/{}", rank), std::to_string(::getpid()));
    const int victim = std::stoi(store.get_string("pid/2"));
    std::vector<float> big(1 << 20);  // 4 MiB: four chunks, so the kill lands mid-call
    auto killed_at = std::chrono::steady_clock::time_point{};
    for (std::uint64_t seq = 0;; ++seq) {
      if (rank == 0 && seq == 20) {
        ::kill(victim, SIGKILL);
        killed_at = std::chrono::steady_clock::now();
      }
      try {
        domain->allreduce(big.data(), big.data(), big.size(), DType::kFloat32, ReduceOp::kSum,
                          header(Collective::kAllreduce, DType::kFloat32, big.size(), seq),
                          after(30s));
      } catch (const CommError& e) {
        const std::string what = e.what();
        if (what.find("rank 2") == std::string::npos)
          throw std::runtime_error("error does not name rank 2: " + what);
        if (rank == 0) {
          const auto took = std::chrono::steady_clock::now() - killed_at;
          if (took > 2s)
            throw std::runtime_error(
                fmt::format("noticed the kill after {} ms",
                            std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
        }
        return;
      }
      if (seq > 10000) throw std::runtime_error("the killed rank was never noticed");
    }
  });
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_TRUE(results[1].ok()) << describe(results);
  EXPECT_EQ(results[2].signal, SIGKILL) << describe(results);
  EXPECT_EQ(shm_entries(prefix), before);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

TEST(ShmDomain, StoppedPeerTimesOutAtTheDeadline) {
  StoreDir dir;
  auto results = run_ranks(
      3,
      [&](int rank) {
        auto domain =
            make_domain(dir.path(), rank, 3, ShmOptions{.name_prefix = unique_prefix("stop")});
        FileStore store(dir.path());
        store.set(fmt::format("pid/{}", rank), std::to_string(::getpid()));
        const int stopped = std::stoi(store.get_string("pid/1"));
        std::vector<float> v(100, 1.0f);
        domain->allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum,
                          header(Collective::kAllreduce, DType::kFloat32, v.size(), 0), after(20s));
        if (rank == 1) {
          ::raise(SIGSTOP);
          return;  // only reached if someone continues it
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          domain->allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum,
                            header(Collective::kAllreduce, DType::kFloat32, v.size(), 1),
                            after(800ms));
        } catch (const CommError& e) {
          const auto took = std::chrono::steady_clock::now() - start;
          const std::string what = e.what();
          if (rank == 0) ::kill(stopped, SIGKILL);
          if (what.find("rank 1") == std::string::npos)
            throw std::runtime_error("error does not name the stopped rank: " + what);
          if (took < 700ms || took > 3s)
            throw std::runtime_error(
                fmt::format("failed after {} ms, deadline was 800 ms",
                            std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
          return;
        }
        if (rank == 0) ::kill(stopped, SIGKILL);
        throw std::runtime_error("allreduce with a stopped peer returned");
      },
      20s);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_TRUE(results[2].ok()) << describe(results);
}

TEST(ShmDomain, SegmentNeverAppearsInDevShm) {
  StoreDir dir;
  const auto prefix = unique_prefix("unlink");
  auto results = run_ranks(2, [&](int rank) {
    auto domain = make_domain(dir.path(), rank, 2, ShmOptions{.name_prefix = prefix});
    // Every rank has returned from create(): nothing in /dev/shm, the mapping works.
    if (!shm_entries(prefix).empty())
      throw std::runtime_error("segment still in /dev/shm after create()");
    float x = 1.0f;
    domain->allreduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum,
                      header(Collective::kAllreduce, DType::kFloat32, 1, 0), after(20s));
    if (x != 2.0f) throw std::runtime_error(fmt::format("1 + 1 = {}", x));
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

TEST(ShmDomain, RankThatNeverJoinsTimesOutAndLeavesNoSegment) {
  StoreDir dir;
  const auto prefix = unique_prefix("nojoin");
  auto results = run_ranks(1, [&](int) {
    try {
      make_domain(dir.path(), 0, 2, ShmOptions{.name_prefix = prefix}, 500ms);
    } catch (const TimeoutError& e) {
      if (std::string(e.what()).find("ranks 1 did not join") == std::string::npos)
        throw std::runtime_error(std::string("unexpected message: ") + e.what());
      return;
    }
    throw std::runtime_error("create() without rank 1 returned");
  });
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

// Forks a process that runs create() as `rank` of a group of `size`; returns its pid.
pid_t start_rank(const std::filesystem::path& dir, int rank, int size, const std::string& prefix) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      auto domain = make_domain(dir, rank, size, ShmOptions{.name_prefix = prefix}, 10s);
      ::pause();  // hold the segment until killed
    } catch (...) {
    }
    ::_exit(1);
  }
  return pid;
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

TEST(ShmDomain, RankKilledAtAnyPointOfSetUpLeavesNothingInDevShm) {
  const auto prefix = unique_prefix("setupkill");
  const auto before = shm_entries(prefix);
  {
    // Rank 0 killed while it waits for a rank that never comes (the segment exists, rank 0 has
    // published it): with a named segment this leaked a file in /dev/shm every time.
    StoreDir dir;
    const pid_t rank0 = start_rank(dir.path(), 0, 2, prefix);
    FileStore store(dir.path(), 10s);
    const std::vector<std::string> name_key{"shm/name"};
    ASSERT_NO_THROW(store.wait(name_key, 10s));
    kill_and_reap(rank0);
    EXPECT_EQ(shm_entries(prefix), before);
    // A rank that comes later is told clearly that rank 0's segment is gone.
    auto results = run_ranks(1, [&](int) {
      try {
        make_domain(dir.path(), 1, 2, ShmOptions{.name_prefix = prefix}, 5s);
      } catch (const CommError& e) {
        if (std::string(e.what()).find("cannot open rank 0's segment") == std::string::npos)
          throw std::runtime_error(std::string("unexpected message: ") + e.what());
        return;
      }
      throw std::runtime_error("joined the segment of a dead rank 0");
    });
    EXPECT_ALL_RANKS_OK(results);
  }
  // Every rank of a group of 3 killed at several points of a set-up in progress: right after
  // fork, while creating or publishing, while joining, and after everyone joined.
  for (const int victim : {0, 1}) {
    for (const int delay_ms : {0, 1, 2, 5, 10, 20, 50, 200}) {
      SCOPED_TRACE(fmt::format("rank {} killed after {} ms", victim, delay_ms));
      StoreDir dir;
      std::vector<pid_t> ranks;
      for (int rank = 0; rank < 3; ++rank)
        ranks.push_back(start_rank(dir.path(), rank, 3, prefix));
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      kill_and_reap(ranks[victim]);
      for (int rank = 0; rank < 3; ++rank) {
        if (rank != victim) kill_and_reap(ranks[rank]);
      }
      EXPECT_EQ(shm_entries(prefix), before);
    }
  }
  EXPECT_TRUE(shm_entries(prefix).empty());
}

TEST(ShmDomain, PeerOpensNothingButASealedSegment) {
  // Whoever can write the store cannot make a rank map (and write into) some other file.
  StoreDir dir;
  FileStore store(dir.path(), 5s);
  const auto file = dir.path() / "precious";
  const std::string content(8192, 'x');
  {
    std::ofstream out(file, std::ios::binary);
    out << content;
  }
  const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::vector<std::pair<std::string, std::string>> cases{
      {file.string(), "not rank 0's segment descriptor"},
      {"/proc/self/../../" + file.string() + "/fd/1", "not rank 0's segment descriptor"},
      {fmt::format("/proc/{}/fd/{}", ::getpid(), fd), "is not a sealed shared-memory segment"},
  };
  for (const auto& [value, message] : cases) {
    SCOPED_TRACE(value);
    store.set("shm/name", value);
    try {
      ShmDomain::create(store, "shm", 1, 2, ShmOptions{.slot_bytes = 4096, .small_bytes = 256},
                        after(2s));
      ADD_FAILURE() << "joined " << value;
    } catch (const CommError& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
  ::close(fd);
  std::ifstream in(file, std::ios::binary);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(in)), {}), content);
}

// Where this process maps the segment that `domain` made (rank 0: its name is "memfd:<name>",
// which /proc/self/maps lists as "/memfd:<name> (deleted)"): what a process of the same user
// reaches through /proc, writable.
comm::shm::SegmentHeader* mapped_segment(const ShmDomain& domain) {
  std::ifstream maps("/proc/self/maps");
  const std::string name = "/" + domain.segment_name() + " ";
  for (std::string line; std::getline(maps, line);) {
    if (line.find(name) == std::string::npos) continue;
    return reinterpret_cast<comm::shm::SegmentHeader*>(std::stoull(line, nullptr, 16));
  }
  throw std::runtime_error("no mapping of " + domain.segment_name() + " in /proc/self/maps");
}

// Rank 0 writes `value` into the segment's aborted_by while rank 1 waits for it in an allreduce:
// a number that names no rank (or names the waiting rank itself) fails rank 1's call at its next
// look, with an error that says the segment is damaged, instead of indexing the ranks' controls
// with it (0x7fffffff: far outside the mapping, SIGSEGV; 5 at world 2: a "reason" read from the
// data slots, or a peer that does not exist blamed).
TEST(ShmDomain, ADamagedAbortedByFailsTheWaitingRankByName) {
  for (const std::int32_t value :
       {std::int32_t{0x7fffffff}, std::int32_t{5}, std::int32_t{-2}, std::int32_t{1}}) {
    SCOPED_TRACE(value);
    StoreDir dir;
    const auto prefix = unique_prefix("damaged");
    auto results = run_ranks(
        2,
        [&](int rank) {
          auto domain = make_domain(dir.path(), rank, 2, small_slots(prefix));
          FileStore store(dir.path(), 15s);
          std::vector<float> v(16, 1.0f);
          domain->allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum,
                            header(Collective::kAllreduce, DType::kFloat32, v.size(), 0),
                            after(10s));
          if (rank == 0) {
            store.get_string("waiting");
            std::this_thread::sleep_for(100ms);  // rank 1 is asleep in its call by now
            std::atomic_ref<std::int32_t>(mapped_segment(*domain)->aborted_by)
                .store(value, std::memory_order_release);
            store.get_string("done");  // alive until rank 1 is done: no death to notice instead
            return;
          }
          store.set("waiting", "1");
          const auto start = std::chrono::steady_clock::now();
          try {
            domain->allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum,
                              header(Collective::kAllreduce, DType::kFloat32, v.size(), 1),
                              after(10s));
          } catch (const CommError& e) {
            store.set("done", "1");
            const std::string what = e.what();
            const std::string named =
                value == 1 ? "aborted_by = 1 names this rank, which did not abort"
                           : fmt::format("aborted_by = {} names no rank of this world of 2", value);
            if (what.find("the shared segment of group 'shm' is damaged: " + named) ==
                    std::string::npos ||
                what.find("another process wrote into it?") == std::string::npos) {
              throw std::runtime_error("the error does not say the segment is damaged: " + what);
            }
            if (std::chrono::steady_clock::now() - start > 5s) {
              throw std::runtime_error("noticed the damage only at the deadline: " + what);
            }
            return;
          }
          store.set("done", "1");
          throw std::runtime_error("the allreduce returned although its peer never came");
        },
        30s);
    EXPECT_ALL_RANKS_OK(results);
    EXPECT_EQ(results[1].signal, 0) << describe(results);
  }
}

TEST(ShmDomain, BadArgumentsAreConfigErrors) {
  StoreDir dir;
  FileStore store(dir.path());
  EXPECT_THROW(ShmDomain::create(store, "x", 2, 2, {}, after(1s)), ConfigError);
  EXPECT_THROW(ShmDomain::create(store, "x", 0, 1, ShmOptions{.slot_bytes = 1000}, after(1s)),
               ConfigError);
  EXPECT_THROW(ShmDomain::create(store, "x", 0, 1, ShmOptions{.ranks = {4, 5}}, after(1s)),
               ConfigError);
  auto domain = ShmDomain::create(store, "y", 0, 1, ShmOptions{.name_prefix = unique_prefix("bad")},
                                  after(5s));
  float x = 3;
  // A header that does not describe the call.
  EXPECT_THROW(domain->allreduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum,
                                 header(Collective::kAllreduce, DType::kFloat32, 2, 0), after(1s)),
               ConfigError);
  EXPECT_THROW(
      domain->broadcast(&x, 1, DType::kFloat32, 3,
                        header(Collective::kBroadcast, DType::kFloat32, 1, 0, ReduceOp::kSum, 3),
                        after(1s)),
      ConfigError);
  EXPECT_FALSE(domain->poisoned());
  domain->allreduce(&x, &x, 1, DType::kFloat32, ReduceOp::kAvg,
                    header(Collective::kAllreduce, DType::kFloat32, 1, 0, ReduceOp::kAvg),
                    after(1s));
  EXPECT_EQ(x, 3.0f);
}

}  // namespace
}  // namespace ddp::test::shm
