// The nccl backend's unique-id exchange through real stores (a FileStore shared by processes, and
// a TCPStore server in rank 0), with fake ids: no NCCL, no GPU.
#include "comm/nccl/nccl_unique_id.h"

#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "comm/file_store.h"
#include "ddp/comm/comm_error.h"
#include "ddp/store/prefix_store.h"
#include "ddp/store/tcp_store.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::comm::nccl {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

// A fake id that differs per generation, so a rank that read an old one is caught.
UniqueIdBytes fake_id(int generation) {
  UniqueIdBytes id{};
  for (std::size_t i = 0; i < id.size(); ++i) {
    id[i] = static_cast<std::uint8_t>(i * 7 + static_cast<std::size_t>(generation) * 31 + 1);
  }
  return id;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// Every rank sets up two communicators of one group name in a row: each gets rank 0's id of its
// own generation, through its own keys.
void exchange_twice(Store& store, int rank, int size) {
  for (int generation = 0; generation < 2; ++generation) {
    const std::string prefix = next_setup_prefix(store, "default", size);
    require(prefix == fmt::format("nccl/default/{}/", generation),
            fmt::format("rank {}: prefix {} for generation {}", rank, prefix, generation));
    int calls = 0;
    const UniqueIdBytes id = exchange_unique_id(
        store, prefix, "default", rank,
        [&] {
          ++calls;
          return fake_id(generation);
        },
        net::deadline_after(20s));
    require(id == fake_id(generation),
            fmt::format("rank {}: wrong id in generation {}", rank, generation));
    require(calls == (rank == 0 ? 1 : 0),
            fmt::format("rank {} called the generator {} times", rank, calls));
    // The next generation starts only once every rank read this one (setting up is collective).
    store.add(fmt::format("read/{}", generation), 1);
    for (;;) {
      if (store.add(fmt::format("read/{}", generation), 0) == size) break;
      std::this_thread::sleep_for(1ms);
    }
  }
}

TEST(NcclUniqueId, ThroughAFileStoreEveryRankGetsRankZerosIdPerGeneration) {
  test::TempDir dir;
  const auto results = test::run_ranks(3, [&](int rank) {
    test::FileStore store(dir.path());
    exchange_twice(store, rank, 3);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclUniqueId, ThroughATcpStoreEveryRankGetsRankZerosIdPerGeneration) {
  const auto port = static_cast<std::uint16_t>(test::free_port());
  const auto results = test::run_ranks(3, [&](int rank) {
    auto base = std::make_shared<TcpStore>(
        "127.0.0.1", port,
        TcpStoreOptions{.is_server = rank == 0, .timeout = 30s, .connect_timeout = 30s});
    PrefixStore store("ddp/pg", base);
    exchange_twice(store, rank, 3);
    // Rank 0 serves the store: it stays until every rank is done with it.
    base->add("finished", 1);
    if (rank == 0) {
      while (base->add("finished", 0) < 3)
        std::this_thread::sleep_for(1ms);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclUniqueId, RankZerosFailureReachesTheOthersAtOnceByName) {
  test::TempDir dir;
  const auto results = test::run_ranks(3, [&](int rank) {
    test::FileStore store(dir.path());
    const auto start = std::chrono::steady_clock::now();
    try {
      exchange_unique_id(
          store, "nccl/g/0/", "g", rank,
          []() -> UniqueIdBytes { throw std::runtime_error("ncclGetUniqueId: no network"); },
          net::deadline_after(30s));
      throw std::runtime_error("the exchange succeeded");
    } catch (const CommError& e) {
      require(rank != 0, "rank 0 got a CommError instead of its own exception");
      require(e.kind() == CommErrorKind::kSetup, fmt::format("kind {}", to_string(e.kind())));
      require(std::string(e.what()).find("rank 0 could not create the NCCL unique id: "
                                         "ncclGetUniqueId: no network") != std::string::npos,
              e.what());
      require(std::chrono::steady_clock::now() - start < 10s, "it waited for the deadline");
    } catch (const std::runtime_error& e) {
      require(rank == 0 && std::string(e.what()) == "ncclGetUniqueId: no network", e.what());
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclUniqueId, ARankZeroThatNeverComesIsANamedTimeout) {
  test::TempDir dir;
  const auto results = test::run_ranks(2, [&](int rank) {
    if (rank == 0) return;  // never publishes
    test::FileStore store(dir.path());
    const auto start = std::chrono::steady_clock::now();
    try {
      exchange_unique_id(
          store, "nccl/g/0/", "g", rank, [] { return fake_id(0); }, net::deadline_after(1500ms));
      throw std::runtime_error("the exchange succeeded without rank 0");
    } catch (const CommError& e) {
      const auto waited = std::chrono::steady_clock::now() - start;
      require(e.kind() == CommErrorKind::kTimeout, fmt::format("kind {}", to_string(e.kind())));
      require(std::string(e.what()).find("rank 0 did not publish the NCCL unique id") !=
                  std::string::npos,
              e.what());
      require(std::string(e.what()).find("group 'g'") != std::string::npos, e.what());
      require(waited >= 1400ms && waited < 10s, "not bounded by the deadline");
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclUniqueId, AMalformedValueIsRefusedByName) {
  test::TempDir dir;
  test::FileStore store(dir.path());
  store.set("nccl/g/0/unique_id", "not an id");
  try {
    exchange_unique_id(
        store, "nccl/g/0/", "g", 1, [] { return fake_id(0); }, net::deadline_after(5s));
    FAIL() << "a malformed id was accepted";
  } catch (const CommError& e) {
    EXPECT_EQ(e.kind(), CommErrorKind::kSetup);
    EXPECT_NE(std::string(e.what()).find("is malformed"), std::string::npos) << e.what();
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm::nccl
