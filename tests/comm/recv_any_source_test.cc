// Receiving from any source on the ring backend, in real processes: every sender's message is
// received once with its sender's rank (eager and rendezvous sizes); messages already here match
// in arrival order; a receive naming the sender posted earlier takes a message first (and the
// reverse); a count mismatch fails both ranks naming both calls; a receive no rank sends to
// times out alone, naming what arrived instead; one that every other rank leaves without sending
// to fails before its deadline; bad arguments are ConfigErrors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <thread>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::vector<std::uint32_t> message_of(int from, std::size_t count, std::uint32_t salt) {
  std::vector<std::uint32_t> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] =
        static_cast<std::uint32_t>(i) * 2654435761u + static_cast<std::uint32_t>(from) * 97u + salt;
  return v;
}

void expect_true(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

template <class E, class F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const E& e) {
    return e.what();
  }
  throw std::runtime_error("expected an error, but the call succeeded");
}

void expect_contains(const std::string& text, const std::string& part) {
  expect_true(text.find(part) != std::string::npos,
              fmt::format("message lacks '{}': {}", part, text));
}

RingOptions tcp(std::chrono::milliseconds timeout) {
  return {.timeout = timeout, .transport = Transport::kTcp};
}

class RecvAnySource : public ::testing::TestWithParam<int> {};

// Rank 0 posts one receive from any source per other rank, half before and half after the
// messages arrive; each other rank sends one (small ones eagerly, the others by rendezvous).
TEST_P(RecvAnySource, EveryRanksMessageArrivesOnceWithItsSender) {
  const int size = GetParam();
  TempDir dir;
  auto results = run_ranks(size, [&](int rank) {
    auto pg = make_group(dir.path(), rank, size, tcp(30s));
    auto count_of = [](int from) {
      return from % 2 == 1 ? std::size_t{100} : std::size_t{1} << 18;
    };
    if (rank == 0) {
      const std::size_t largest = std::size_t{1} << 18;
      std::vector<std::vector<std::uint32_t>> bufs(static_cast<std::size_t>(size - 1));
      std::vector<int> sources(static_cast<std::size_t>(size - 1), -1);
      std::vector<std::shared_ptr<Work>> works;
      const int early = (size - 1) / 2;
      for (int k = 0; k < size - 1; ++k) {
        bufs[static_cast<std::size_t>(k)].assign(largest, 0);
      }
      // A count that fits every sender is impossible (counts must agree), so rank 0 receives by
      // count class: odd senders send 100 elements, even ones 2^18.
      std::vector<int> counts;
      for (int from = 1; from < size; ++from)
        counts.push_back(static_cast<int>(count_of(from)));
      std::sort(counts.begin(), counts.end());
      for (int k = 0; k < early; ++k) {
        auto& b = bufs[static_cast<std::size_t>(k)];
        works.push_back(pg->recv_any_source(b.data(), static_cast<std::size_t>(counts[k]),
                                            DType::kInt32, &sources[static_cast<std::size_t>(k)],
                                            counts[k] == 100 ? 1 : 2));
      }
      pg->barrier()->wait();  // the senders send after this
      pg->barrier()->wait();  // and have posted their sends before this
      for (int k = early; k < size - 1; ++k) {
        auto& b = bufs[static_cast<std::size_t>(k)];
        works.push_back(pg->recv_any_source(b.data(), static_cast<std::size_t>(counts[k]),
                                            DType::kInt32, &sources[static_cast<std::size_t>(k)],
                                            counts[k] == 100 ? 1 : 2));
      }
      for (auto& w : works)
        w->wait();
      std::set<int> seen;
      for (int k = 0; k < size - 1; ++k) {
        const int from = sources[static_cast<std::size_t>(k)];
        expect_true(from >= 1 && from < size, fmt::format("receive {}: source {}", k, from));
        expect_true(seen.insert(from).second, fmt::format("rank {} received twice", from));
        const auto want = message_of(from, count_of(from), 5);
        const auto& got = bufs[static_cast<std::size_t>(k)];
        expect_true(std::equal(want.begin(), want.end(), got.begin()),
                    fmt::format("receive {}: the data is not rank {}'s message", k, from));
      }
    } else {
      pg->barrier()->wait();
      const auto mine = message_of(rank, count_of(rank), 5);
      // A rendezvous send completes only once rank 0 posts its late receive, after the barrier.
      auto sent = pg->send(mine.data(), mine.size(), DType::kInt32, 0, rank % 2 == 1 ? 1 : 2);
      pg->barrier()->wait();
      sent->wait();
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Worlds, RecvAnySource, ::testing::Values(2, 3, 4));

// Rank 1's message is here before rank 2's (rank 0 has received rank 1's later message on the
// same connection, then rank 2's): a receive from any source takes rank 1's.
TEST(RecvAnySourceRules, MessagesAlreadyHereMatchInArrivalOrder) {
  TempDir dir;
  auto results = run_ranks(3, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 3, tcp(30s));
    std::uint32_t marker = 0;
    if (rank == 0) {
      for (int from : {1, 2}) {
        pg->recv(&marker, 1, DType::kInt32, from, 8)->wait();
        pg->barrier()->wait();
      }
      std::vector<std::uint32_t> first(10), second(10);
      int source_first = -1, source_second = -1;
      pg->recv_any_source(first.data(), 10, DType::kInt32, &source_first, 7)->wait();
      pg->recv_any_source(second.data(), 10, DType::kInt32, &source_second, 7)->wait();
      expect_true(
          source_first == 1 && source_second == 2,
          fmt::format("sources {} then {}, expected 1 then 2", source_first, source_second));
      expect_true(first == message_of(1, 10, 0) && second == message_of(2, 10, 0),
                  "the data does not match the senders");
    } else {
      const auto mine = message_of(rank, 10, 0);
      for (int turn : {1, 2}) {
        if (turn == rank) {
          pg->send(mine.data(), 10, DType::kInt32, 0, 7)->wait();
          pg->send(&marker, 1, DType::kInt32, 0, 8)->wait();
        }
        pg->barrier()->wait();
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Rank 1 sends A then B with one tag. Posted in the order (from rank 1, from any), the receive
// naming rank 1 takes A; posted in the order (from any, from rank 1), the other one does.
TEST(RecvAnySourceRules, TheReceivePostedFirstTakesTheMessageFirst) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, tcp(30s));
    const auto a = message_of(1, 1000, 1);
    const auto b = message_of(1, 1000, 2);
    for (bool specific_first : {true, false}) {
      if (rank == 0) {
        std::vector<std::uint32_t> by_name(1000), by_any(1000);
        int source = -1;
        std::shared_ptr<Work> named, any;
        if (specific_first) {
          named = pg->recv(by_name.data(), 1000, DType::kInt32, 1, 3);
          any = pg->recv_any_source(by_any.data(), 1000, DType::kInt32, &source, 3);
        } else {
          any = pg->recv_any_source(by_any.data(), 1000, DType::kInt32, &source, 3);
          named = pg->recv(by_name.data(), 1000, DType::kInt32, 1, 3);
        }
        pg->barrier()->wait();
        named->wait();
        any->wait();
        expect_true(source == 1, fmt::format("source {}", source));
        expect_true(specific_first ? (by_name == a && by_any == b) : (by_any == a && by_name == b),
                    fmt::format("posted {}: the first message went to the wrong receive",
                                specific_first ? "named first" : "any first"));
      } else {
        pg->barrier()->wait();
        pg->send(a.data(), 1000, DType::kInt32, 0, 3)->wait();
        pg->send(b.data(), 1000, DType::kInt32, 0, 3)->wait();
      }
      pg->barrier()->wait();
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RecvAnySourceRules, CountMismatchFailsBothRanksNamingBothCalls) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, tcp(10s));
    std::vector<std::uint32_t> buf(200, 0);
    if (rank == 0) {
      int source = -1;
      const std::string message = error_of<CommError>(
          [&] { pg->recv_any_source(buf.data(), 100, DType::kInt32, &source, 4)->wait(); });
      expect_contains(message, "from any rank");
      expect_contains(message, "int32 x 131072");
      expect_true(std::all_of(buf.begin(), buf.end(), [](auto v) { return v == 0; }),
                  "the receive buffer was written");
    } else {
      // Above the eager limit: the sender learns of the rejection before its payload goes.
      std::vector<std::uint32_t> big(1 << 17, 1);
      const std::string message = error_of<CommError>(
          [&] { pg->send(big.data(), big.size(), DType::kInt32, 0, 4)->wait(); });
      expect_contains(message, "mismatch");
      static_cast<void>(buf);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// No rank sends with tag 9 (rank 1 sends tag 6): the receive fails at its own deadline, names
// the tag 6 message, and the connection still works afterwards.
TEST(RecvAnySourceRules, AReceiveNoRankSendsToTimesOutAloneNamingWhatArrived) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, tcp(20s));
    std::vector<std::uint32_t> buf(10, 0);
    if (rank == 1) pg->send(buf.data(), 10, DType::kInt32, 0, 6)->wait();
    pg->barrier()->wait();
    if (rank == 0) {
      int source = -1;
      const auto start = Clock::now();
      CommError caught(CommErrorKind::kInternal, "", "", "", 0, -1);
      const std::string message = error_of<CommError>([&] {
        try {
          pg->recv_any_source(buf.data(), 10, DType::kInt32, &source, 9, {.timeout = 300ms})
              ->wait();
        } catch (const CommError& e) {
          caught = e;
          throw;
        }
      });
      expect_true(caught.kind() == CommErrorKind::kTimeout, message);
      expect_true(Clock::now() - start < 5s, "the timeout took more than 5 s");
      expect_contains(message, "no rank sent a message with tag 9");
      expect_contains(message, "tag 6");
      pg->recv(buf.data(), 10, DType::kInt32, 1, 6)->wait();  // the connection still works
    }
    pg->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Rank 1 destroys its group without sending: rank 0's receive from any source fails long
// before its 30 s deadline, saying that no rank is left.
TEST(RecvAnySourceRules, EveryOtherRankLeavingFailsItBeforeTheDeadline) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, tcp(30s));
    std::uint32_t x = 0;
    if (rank == 0) {
      int source = -1;
      auto work = pg->recv_any_source(&x, 1, DType::kInt32, &source, 0);
      pg->barrier()->wait();
      const auto start = Clock::now();
      const std::string message = error_of<CommError>([&] { work->wait(); });
      expect_true(Clock::now() - start < 15s, "it waited for its deadline");
      expect_contains(message, "from any rank");
      expect_contains(message, "every other rank");
    } else {
      pg->barrier()->wait();
      pg.reset();
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RecvAnySourceRules, BadArgumentsAreConfigErrors) {
  TempDir dir;
  auto results = run_ranks(2, [&](int rank) {
    auto pg = make_group(dir.path(), rank, 2, tcp(10s));
    std::uint32_t x = 0;
    int source = -1;
    expect_contains(
        error_of<ConfigError>([&] { pg->recv_any_source(&x, 1, DType::kInt32, nullptr, 0); }),
        "`source` is null");
    expect_contains(
        error_of<ConfigError>([&] { pg->recv_any_source(nullptr, 1, DType::kInt32, &source, 0); }),
        "recv_any_source");
    pg->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
  TempDir alone;
  auto single = run_ranks(1, [&](int rank) {
    auto pg = make_group(alone.path(), rank, 1, tcp(10s));
    std::uint32_t x = 0;
    int source = -1;
    expect_contains(
        error_of<ConfigError>([&] { pg->recv_any_source(&x, 1, DType::kInt32, &source, 0); }),
        "one rank");
  });
  EXPECT_ALL_RANKS_OK(single);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
