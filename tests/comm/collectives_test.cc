// Every collective of the ring backend against a locally computed reference, in real processes,
// for world sizes 1..8: counts 0, 1, fewer than ranks, a prime, not divisible by the world size,
// and sizes on both sides of the small-message switch; roots other than 0; in place and not.
#include <gtest/gtest.h>

#include <atomic>
#include <numeric>

#include "comm/comm_test_util.h"
#include "ddp/store/tcp_store.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

class Collectives : public ::testing::TestWithParam<std::tuple<int, Mode>> {
 protected:
  int world() const { return std::get<0>(GetParam()); }
  Mode mode() const { return std::get<1>(GetParam()); }
  std::shared_ptr<ProcessGroup> group(const std::filesystem::path& dir, int rank) const {
    auto pg = make_group(dir, rank, world(), apply_mode(mode(), rank, world()));
    expect_transport(mode(), *pg);
    return pg;
  }
};

std::string name(DType d, ReduceOp op, std::size_t count) {
  return fmt::format("{} {} x {}", to_string(d), to_string(op), count);
}

TEST_P(Collectives, AllreduceEveryDtypeAndOp) {
  const int size = world();
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = group(dir.path(), rank);
    int salt = 0;
    // 1009: prime; 40009 x 4 bytes: past the 128 KiB switch (ring from world 3 on); 70001 x 4
    // bytes: past the 256 KiB switch of world 2 as well.
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(size - 1),
                              std::size_t{1009}, std::size_t{40009}, std::size_t{70001}}) {
      for (DType dtype : kAllDTypes) {
        for (ReduceOp op : kAllOps) {
          if (!reduces(dtype, op)) continue;
          ++salt;
          const auto input = make_input(dtype, count, rank, salt);
          const auto want = expected_reduction(dtype, op, count, size, salt);
          if (salt % 2 == 0) {
            auto buf = input;
            pg->allreduce(buf.data(), count, dtype, op)->wait();
            expect_bytes(buf, want, dtype, "in place " + name(dtype, op, count));
          } else {
            std::vector<std::byte> out(input.size(), std::byte{0x77});
            pg->allreduce(input.data(), out.data(), count, dtype, op)->wait();
            expect_bytes(out, want, dtype, "out of place " + name(dtype, op, count));
            expect_bytes(input, make_input(dtype, count, rank, salt), dtype, "input untouched");
          }
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Segments through every transport (the shared-memory path reads and writes them where they lie,
// here with 4 KiB chunks, so pieces cross chunk boundaries; the others pack), mixed with a plain
// allreduce of the same count on odd ranks.
TEST_P(Collectives, AllreduceSegmentsMatchesAPlainAllreduce) {
  const int size = world();
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = group(dir.path(), rank);
    int salt = 7000;
    for (const std::vector<std::size_t>& layout :
         {std::vector<std::size_t>{3}, {700, 0, 1, 2049, 5}, {40009, 1, 29991}}) {
      std::size_t count = 0;
      for (auto n : layout)
        count += n;
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt64}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          ++salt;
          const auto input = make_input(dtype, count, rank, salt);
          const auto want = expected_reduction(dtype, op, count, size, salt);
          if (rank % 2 == 1) {
            auto buf = input;
            pg->allreduce(buf.data(), count, dtype, op)->wait();
            expect_bytes(buf, want, dtype, "plain " + name(dtype, op, count));
            continue;
          }
          const std::size_t esz = dtype_size(dtype);
          std::vector<std::vector<std::byte>> pieces;
          std::vector<BufferSegment> segments;
          std::size_t at = 0;
          for (auto n : layout) {
            pieces.emplace_back(input.begin() + static_cast<std::ptrdiff_t>(at * esz),
                                input.begin() + static_cast<std::ptrdiff_t>((at + n) * esz));
            at += n;
          }
          for (auto& piece : pieces)
            segments.push_back({piece.data(), piece.size() / esz});
          pg->allreduce_segments(segments, dtype, op)->wait();
          std::vector<std::byte> got;
          for (const auto& piece : pieces)
            got.insert(got.end(), piece.begin(), piece.end());
          expect_bytes(got, want, dtype, "segments " + name(dtype, op, count));
        }
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(Collectives, EveryOtherCollective) {
  const int size = world();
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = group(dir.path(), rank);
    const DType dtype = DType::kFloat32;
    int salt = 100;
    for (std::size_t count :
         {std::size_t{0}, std::size_t{1}, std::size_t{1009}, std::size_t{100003}}) {
      const std::string c = fmt::format(" x {}", count);
      for (int root : {0, size - 1, size / 2}) {
        ++salt;
        // broadcast
        auto buf = rank == root ? make_input(dtype, count, root, salt)
                                : std::vector<std::byte>(count * 4, std::byte{1});
        pg->broadcast(buf.data(), count, dtype, root)->wait();
        expect_bytes(buf, make_input(dtype, count, root, salt), dtype,
                     fmt::format("broadcast root {}{}", root, c));
        // reduce (sum and max) to root
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
          ++salt;
          const auto input = make_input(dtype, count, rank, salt);
          std::vector<std::byte> out(rank == root ? input.size() : 0);
          pg->reduce(input.data(), rank == root ? out.data() : nullptr, count, dtype, op, root)
              ->wait();
          if (rank == root) {
            expect_bytes(out, expected_reduction(dtype, op, count, size, salt), dtype,
                         fmt::format("reduce {} root {}{}", to_string(op), root, c));
          }
        }
        // gather
        ++salt;
        {
          const auto input = make_input(dtype, count, rank, salt);
          std::vector<std::byte> out(rank == root ? input.size() * size : 0);
          pg->gather(input.data(), rank == root ? out.data() : nullptr, count, dtype, root)->wait();
          if (rank == root) {
            std::vector<std::byte> want;
            for (int r = 0; r < size; ++r) {
              const auto part = make_input(dtype, count, r, salt);
              want.insert(want.end(), part.begin(), part.end());
            }
            expect_bytes(out, want, dtype, fmt::format("gather root {}{}", root, c));
          }
        }
        // scatter: block r of the root's buffer is make_input(r)
        ++salt;
        {
          std::vector<std::byte> send;
          if (rank == root) {
            for (int r = 0; r < size; ++r) {
              const auto part = make_input(dtype, count, r, salt);
              send.insert(send.end(), part.begin(), part.end());
            }
          }
          std::vector<std::byte> out(count * 4);
          pg->scatter(rank == root ? send.data() : nullptr, out.data(), count, dtype, root)->wait();
          expect_bytes(out, make_input(dtype, count, rank, salt), dtype,
                       fmt::format("scatter root {}{}", root, c));
        }
      }
      // allgather, out of place and in place
      ++salt;
      {
        std::vector<std::byte> want;
        for (int r = 0; r < size; ++r) {
          const auto part = make_input(dtype, count, r, salt);
          want.insert(want.end(), part.begin(), part.end());
        }
        const auto input = make_input(dtype, count, rank, salt);
        std::vector<std::byte> out(want.size());
        pg->allgather(input.data(), out.data(), count, dtype)->wait();
        expect_bytes(out, want, dtype, "allgather" + c);
        std::vector<std::byte> in_place(want.size());
        std::copy(input.begin(), input.end(), in_place.begin() + rank * count * 4);
        pg->allgather(in_place.data() + rank * count * 4, in_place.data(), count, dtype)->wait();
        expect_bytes(in_place, want, dtype, "allgather in place" + c);
      }
      // reduce_scatter: input has size blocks; rank r gets block r of the reduction
      for (ReduceOp op : kAllOps) {
        if (!reduces(dtype, op)) continue;
        ++salt;
        const auto input = make_input(dtype, count * size, rank, salt);
        std::vector<std::byte> out(count * 4);
        pg->reduce_scatter(input.data(), out.data(), count, dtype, op)->wait();
        const auto full = expected_reduction(dtype, op, count * size, size, salt);
        const std::vector<std::byte> want(full.begin() + rank * count * 4,
                                          full.begin() + (rank + 1) * count * 4);
        expect_bytes(out, want, dtype, fmt::format("reduce_scatter {}{}", to_string(op), c));
      }
      // alltoall: block j of rank r's send is make_input(r * size + j)
      ++salt;
      {
        std::vector<std::byte> send, want;
        for (int j = 0; j < size; ++j) {
          const auto mine = make_input(dtype, count, rank * size + j, salt);
          send.insert(send.end(), mine.begin(), mine.end());
          const auto theirs = make_input(dtype, count, j * size + rank, salt);
          want.insert(want.end(), theirs.begin(), theirs.end());
        }
        std::vector<std::byte> out(send.size());
        pg->alltoall(send.data(), out.data(), count, dtype)->wait();
        expect_bytes(out, want, dtype, "alltoall" + c);
        pg->alltoall(send.data(), send.data(), count, dtype)->wait();
        expect_bytes(send, want, dtype, "alltoall in place" + c);
      }
      pg->barrier()->wait();
      // send/recv around the ring, then back (tags and counts must match)
      if (size > 1) {
        ++salt;
        const int next = (rank + 1) % size;
        const int prev = (rank + size - 1) % size;
        const auto mine = make_input(dtype, count, rank, salt);
        std::vector<std::byte> got(count * 4);
        auto s = pg->send(mine.data(), count, dtype, next, /*tag=*/5);
        auto r = pg->recv(got.data(), count, dtype, prev, /*tag=*/5);
        r->wait();
        s->wait();
        expect_bytes(got, make_input(dtype, count, prev, salt), dtype, "send/recv" + c);
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(Collectives, LocalRankAndSizeCountTheRanksOfTheCallersHost) {
  const int size = world();
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = group(dir.path(), rank);
    int want_rank = rank;
    int want_size = size;
    if (mode() == Mode::kHierEqual) {  // host0: ranks below (size + 1) / 2, see apply_mode
      const int first_host = (size + 1) / 2;
      want_rank = rank < first_host ? rank : rank - first_host;
      want_size = rank < first_host ? first_host : size - first_host;
    } else if (mode() == Mode::kHierUneven) {  // rank 0 alone on hostA
      want_rank = rank == 0 ? 0 : rank - 1;
      want_size = rank == 0 ? 1 : size - 1;
    }
    if (pg->local_rank() != want_rank || pg->local_size() != want_size) {
      throw std::runtime_error(fmt::format("local rank/size {}/{}, want {}/{}", pg->local_rank(),
                                           pg->local_size(), want_rank, want_size));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<int, Mode>>& info) {
  return mode_name(std::get<1>(info.param)) + "_world" + std::to_string(std::get<0>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Tcp, Collectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(Mode::kTcp)),
                         param_name);
INSTANTIATE_TEST_SUITE_P(Shm, Collectives,
                         ::testing::Combine(::testing::Values(2, 3, 4, 5, 8),
                                            ::testing::Values(Mode::kShm)),
                         param_name);
// Two pretend hosts: 2+2 and 3+3 (slices), 2+3 (leaders), 1+3 and 1+4 (leaders, a host alone).
INSTANTIATE_TEST_SUITE_P(Hierarchical, Collectives,
                         ::testing::Combine(::testing::Values(4, 5, 6),
                                            ::testing::Values(Mode::kHierEqual)),
                         param_name);
INSTANTIATE_TEST_SUITE_P(HierarchicalUneven, Collectives,
                         ::testing::Combine(::testing::Values(4, 5),
                                            ::testing::Values(Mode::kHierUneven)),
                         param_name);

// The engine's queue, threads and groups, over TCP and over shared memory (one host).
class RingGroup : public ::testing::TestWithParam<Mode> {
 protected:
  RingOptions options(RingOptions o = {}) const {
    o.transport = GetParam() == Mode::kTcp ? Transport::kTcp : Transport::kAuto;
    return o;
  }
};

TEST_P(RingGroup, ManyAsyncCallsInFlightCompleteInOrderWithCallbacks) {
  const int size = 3;
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = make_group(dir.path(), rank, size, options());
    constexpr int kCalls = 50;
    std::vector<std::vector<std::byte>> bufs;
    std::vector<std::shared_ptr<Work>> works;
    std::atomic<int> callbacks{0};
    std::vector<int> completion_order;
    std::mutex order_mutex;
    for (int i = 0; i < kCalls; ++i) {
      // Alternate sizes so both algorithms are queued together.
      const std::size_t count = i % 3 == 0 ? 50'000 : 1000 + i;
      bufs.push_back(make_input(DType::kFloat32, count, rank, i));
      works.push_back(pg->allreduce(bufs.back().data(), count, DType::kFloat32, ReduceOp::kSum));
      works.back()->then([&, i](Work& w) {
        if (!w.error()) ++callbacks;
        std::lock_guard lock(order_mutex);
        completion_order.push_back(i);
      });
    }
    for (auto& w : works)
      w->wait();
    for (int i = 0; i < kCalls; ++i) {
      const std::size_t count = i % 3 == 0 ? 50'000 : 1000 + i;
      expect_bytes(bufs[i], expected_reduction(DType::kFloat32, ReduceOp::kSum, count, size, i),
                   DType::kFloat32, fmt::format("call {}", i));
    }
    if (callbacks != kCalls)
      throw std::runtime_error(fmt::format("{} callbacks", callbacks.load()));
    std::vector<int> sorted(completion_order);
    std::sort(sorted.begin(), sorted.end());
    if (sorted != completion_order) throw std::runtime_error("completed out of issue order");
    // then() on a completed Work runs at once.
    bool ran = false;
    works.front()->then([&](Work&) { ran = true; });
    if (!ran) throw std::runtime_error("then() on a completed Work did not run at once");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(RingGroup, TwoGroupsAndSubgroupsUsedAtOnce) {
  const int size = 4;
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto a = make_group(dir.path(), rank, size, options({.group_name = "a"}));
    auto b = make_group(dir.path(), rank, size, options({.group_name = "b"}));
    auto odd = a->new_group({1, 3});
    auto first3 = a->new_group({0, 1, 2});
    if ((odd != nullptr) != (rank % 2 == 1)) throw std::runtime_error("new_group membership");
    if ((first3 != nullptr) != (rank < 3)) throw std::runtime_error("new_group membership");
    std::vector<std::shared_ptr<Work>> works;
    std::vector<std::vector<std::byte>> bufs;
    struct Check {
      std::size_t buf;
      int group_size;
      int salt;
      std::size_t count;
    };
    std::vector<Check> checks;
    auto issue = [&](ProcessGroup& g, int salt, std::size_t count) {
      bufs.push_back(make_input(DType::kInt32, count, g.rank(), salt));
      works.push_back(g.allreduce(bufs.back().data(), count, DType::kInt32, ReduceOp::kSum));
      checks.push_back({bufs.size() - 1, g.size(), salt, count});
    };
    bufs.reserve(64);
    for (int i = 0; i < 8; ++i) {
      issue(*a, i, 30'000);
      issue(*b, 100 + i, 20'000);
      if (odd) issue(*odd, 200 + i, 1000);
      if (first3) issue(*first3, 300 + i, 40'000);
    }
    for (auto& w : works)
      w->wait();
    for (const auto& c : checks) {
      expect_bytes(bufs[c.buf],
                   expected_reduction(DType::kInt32, ReduceOp::kSum, c.count, c.group_size, c.salt),
                   DType::kInt32, fmt::format("group of {} salt {}", c.group_size, c.salt));
    }
    if (odd && (odd->size() != 2 || odd->rank() != rank / 2)) {
      throw std::runtime_error("subgroup ranks are not renumbered");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// After calls that were waited for at once, the group leaves new small work to its caller instead
// of waking the worker (ring_process_group.cc, worker_idle_wait). A caller that then does NOT
// wait must still see its operation run, and a peer blocked on it must not wait for the deadline:
// rank 0 leaves an allreduce of group `a` unwaited and blocks in group `b`, which rank 1 only
// enters after that allreduce of `a` completed.
TEST_P(RingGroup, WorkNotWaitedForRunsAfterCallsThatWereWaitedAtOnce) {
  const int size = 2;
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto a = make_group(dir.path(), rank, size, options({.timeout = 20s, .group_name = "a"}));
    auto b = make_group(dir.path(), rank, size, options({.timeout = 20s, .group_name = "b"}));
    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < 10; ++i) {  // waited at once: builds the guess
        auto buf = make_input(DType::kFloat32, 256, rank, i);
        a->allreduce(buf.data(), 256, DType::kFloat32, ReduceOp::kSum)->wait();
        expect_bytes(buf, expected_reduction(DType::kFloat32, ReduceOp::kSum, 256, size, i),
                     DType::kFloat32, fmt::format("round {} call {}", round, i));
      }
      auto left = make_input(DType::kFloat32, 256, rank, 50 + round);
      auto through_b = make_input(DType::kFloat32, 256, rank, 60 + round);
      const auto start = std::chrono::steady_clock::now();
      if (rank == 0) {
        auto unwaited = a->allreduce(left.data(), 256, DType::kFloat32, ReduceOp::kSum);
        b->allreduce(through_b.data(), 256, DType::kFloat32, ReduceOp::kSum)->wait();
        // Not wait(): that would run it here. Only the worker can have run it.
        if (!unwaited->wait_for(5s)) throw std::runtime_error("unwaited allreduce never ran");
      } else {
        a->allreduce(left.data(), 256, DType::kFloat32, ReduceOp::kSum)->wait();
        b->allreduce(through_b.data(), 256, DType::kFloat32, ReduceOp::kSum)->wait();
      }
      const auto elapsed = std::chrono::steady_clock::now() - start;
      if (elapsed > 2s) {
        throw std::runtime_error(
            fmt::format("round {}: {} ms for two small allreduces", round,
                        std::chrono::duration_cast<std::chrono::milliseconds>(elapsed).count()));
      }
      expect_bytes(left, expected_reduction(DType::kFloat32, ReduceOp::kSum, 256, size, 50 + round),
                   DType::kFloat32, "unwaited allreduce");
      expect_bytes(through_b,
                   expected_reduction(DType::kFloat32, ReduceOp::kSum, 256, size, 60 + round),
                   DType::kFloat32, "allreduce of b");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(RingGroup, CallsFromSeveralThreadsRunInIssueOrder) {
  // Two threads issue on one rank while the other rank issues the same sequence from one thread:
  // the group must run them in the order they were issued (a mutex makes that order the same).
  const int size = 2;
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = make_group(dir.path(), rank, size, options());
    std::mutex issue_mutex;
    std::vector<std::vector<std::byte>> bufs(40);
    std::vector<std::shared_ptr<Work>> works(40);
    int next = 0;
    auto issuer = [&] {
      for (;;) {
        std::lock_guard lock(issue_mutex);
        if (next == 40) return;
        bufs[next] = make_input(DType::kFloat32, 1000 + next, rank, next);
        works[next] =
            pg->allreduce(bufs[next].data(), 1000 + next, DType::kFloat32, ReduceOp::kSum);
        ++next;
      }
    };
    std::thread t1(issuer), t2(issuer);
    t1.join();
    t2.join();
    for (int i = 0; i < 40; ++i) {
      works[i]->wait();
      expect_bytes(bufs[i], expected_reduction(DType::kFloat32, ReduceOp::kSum, 1000 + i, size, i),
                   DType::kFloat32, fmt::format("call {}", i));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(RingGroup, DroppingTheGroupStillRunsQueuedWorkAndWaitersOnManyThreadsWake) {
  const int size = 2;
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = make_group(dir.path(), rank, size, options());
    std::vector<std::vector<std::byte>> bufs;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 6; ++i) {
      bufs.push_back(make_input(DType::kInt64, 30'000 * (i + 1), rank, i));
      works.push_back(
          pg->allreduce(bufs.back().data(), 30'000 * (i + 1), DType::kInt64, ReduceOp::kMax));
    }
    // Several threads wait at once (any of them may run the queue); then the last reference to
    // the group goes away while work may still be queued: its destructor runs it first.
    std::vector<std::thread> waiters;
    for (int t = 0; t < 3; ++t) {
      waiters.emplace_back([&, t] { works[static_cast<std::size_t>(2 * t + 1)]->wait(); });
    }
    pg.reset();
    for (auto& t : waiters)
      t.join();
    for (int i = 0; i < 6; ++i) {
      works[static_cast<std::size_t>(i)]->wait();
      expect_bytes(bufs[static_cast<std::size_t>(i)],
                   expected_reduction(DType::kInt64, ReduceOp::kMax, 30'000 * (i + 1), size, i),
                   DType::kInt64, fmt::format("call {}", i));
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST_P(RingGroup, BootstrapsOverTcpStore) {
  const int size = 3;
  const auto port = static_cast<std::uint16_t>(free_port());
  auto results = run_ranks(size, [&](int rank) {
    auto store = std::make_shared<TcpStore>(
        "127.0.0.1", port, TcpStoreOptions{.is_server = rank == 0, .timeout = 30s});
    auto pg = make_ring_process_group(store, rank, size,
                                      options({.timeout = 30s, .advertise_host = "127.0.0.1"}));
    expect_transport(GetParam(), *pg);
    auto buf = make_input(DType::kFloat32, 100'000, rank, 1);
    pg->allreduce(buf.data(), 100'000, DType::kFloat32, ReduceOp::kAvg)->wait();
    expect_bytes(buf, expected_reduction(DType::kFloat32, ReduceOp::kAvg, 100'000, size, 1),
                 DType::kFloat32, "allreduce over a TcpStore-bootstrapped group");
    pg->barrier()->wait();  // rank 0 hosts the store: keep it up until everyone is done
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Transports, RingGroup, ::testing::Values(Mode::kTcp, Mode::kShm),
                         [](const auto& info) { return mode_name(info.param); });

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
