#include "ddp/launch/rendezvous.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "ddp/error.h"
#include "net/socket.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::run_ranks;
using ::testing::HasSubstr;

InitOptions options_for(int rank, int world_size, int port, Milliseconds timeout = 20s) {
  return {.launch = {.rank = rank,
                     .world_size = world_size,
                     .master_addr = "127.0.0.1",
                     .master_port = port},
          .timeout = timeout};
}

TEST(Rendezvous, RanksMeetAndShareOneStore) {
  const int port = test::free_port();
  const auto results = run_ranks(
      4,
      [&](int rank) {
        World world = rendezvous(options_for(rank, 4, port));
        if (world.rank() != rank || world.size() != 4) throw std::runtime_error("wrong rank/size");
        world.store->set("greeting/" + std::to_string(rank), "hello from " + std::to_string(rank));
        for (int peer = 0; peer < 4; ++peer) {
          const auto text = world.store->get_string("greeting/" + std::to_string(peer));
          if (text != "hello from " + std::to_string(peer))
            throw std::runtime_error("bad: " + text);
        }
        // Keep rank 0 (the server) alive until everybody has read.
        if (world.store->add("done", 1) == 4) world.store->set("all-done", "1");
        world.store->wait(std::vector<std::string>{"all-done"}, 10s);
      },
      60s);
  EXPECT_EQ(results.size(), 4u);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rendezvous, ReadsTheLaunchersVariables) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    test::set_launcher_environment(rank, 2, port, /*timeout_seconds=*/20);
    World world = rendezvous();
    if (world.rank() != rank || world.size() != 2 || world.local_size() != 2) {
      throw std::runtime_error("environment not read");
    }
    if (world.timeout != 20s) throw std::runtime_error("DDP_TIMEOUT not read");
    if (rank == 0) world.store->wait(std::vector<std::string>{"bye/1"}, 10s);
    if (rank == 1) world.store->set("bye/1", "x");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rendezvous, UnreachableMasterFailsAfterTheDeadline) {
  const int port = test::free_port();  // nobody listens there
  const auto start = std::chrono::steady_clock::now();
  try {
    rendezvous(options_for(1, 2, port, 1500ms));
    FAIL() << "rendezvous should have failed";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("127.0.0.1:" + std::to_string(port)));
    EXPECT_THAT(e.what(), HasSubstr("MASTER_ADDR"));
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 1400ms);
  EXPECT_LT(elapsed, 10s);
}

TEST(Rendezvous, PortInUseOnRankZeroIsNamed) {
  net::Socket squatter = net::listen_tcp("0.0.0.0", 0);
  try {
    rendezvous(options_for(0, 2, squatter.local_port(), 2s));
    FAIL() << "rendezvous should have failed";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("already in use"));
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(squatter.local_port())));
  }
}

TEST(Rendezvous, TwoProcessesClaimingOneRankAreNamed) {
  const int port = test::free_port();
  // Processes 0, 1, 2 claim ranks 0, 1, 1 of a world of two.
  const auto results = run_ranks(
      3,
      [&](int process) {
        const int rank = process == 0 ? 0 : 1;
        World world = rendezvous(options_for(rank, 2, port, 8s));
        // Winners keep the server up a little so the loser can reach it.
        std::this_thread::sleep_for(1s);
      },
      30s);
  int named = 0;
  for (const auto& r : results) {
    EXPECT_FALSE(r.timed_out) << test::describe(results);
    if (r.error.find("two processes claim rank 1") != std::string::npos) ++named;
  }
  EXPECT_GE(named, 1) << test::describe(results);
}

TEST(Rendezvous, DisagreeingWorldSizesAreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(
      2, [&](int rank) { rendezvous(options_for(rank, rank == 0 ? 2 : 3, port, 8s)); }, 30s);
  int named = 0;
  for (const auto& r : results) {
    EXPECT_FALSE(r.ok()) << test::describe(results);
    if (r.error.find("same world size") != std::string::npos) ++named;
  }
  EXPECT_GE(named, 1) << test::describe(results);
}

TEST(Rendezvous, MissingRanksAreNamedAfterTheDeadline) {
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        rendezvous(options_for(rank, 3, port, 1500ms));  // rank 2 never comes
      },
      30s);
  for (const auto& r : results) {
    EXPECT_EQ(r.exit_code, 1) << test::describe(results);
    EXPECT_THAT(r.error, HasSubstr("missing rank(s): 2")) << test::describe(results);
  }
}

TEST(Rendezvous, LongWaitsWarnNamingTheMissingRanksUntilTheDeadline) {
  // Two nodes of two ranks; rank 3 (node 1) never comes. Local rank 0 of each node warns every
  // 300 ms until the 1.6 s deadline; local rank 1 stays quiet.
  const int port = test::free_port();
  const auto results = run_ranks(
      3,
      [&](int rank) {
        std::vector<std::string> lines;
        InitOptions options = options_for(rank, 4, port, 1600ms);
        options.launch.local_rank = rank % 2;
        options.launch.local_world_size = 2;
        options.wait_warning = 300ms;
        options.warn = [&](const std::string& line) { lines.push_back(line); };
        try {
          rendezvous(options);
        } catch (const TimeoutError&) {
        }
        const std::string all = fmt::format("{}", fmt::join(lines, "\n"));
        if (rank == 1) {
          if (!lines.empty()) throw std::runtime_error("local rank 1 warned: " + all);
          return;
        }
        if (lines.size() < 2 || lines.size() > 6) {
          throw std::runtime_error(fmt::format("{} warnings: {}", lines.size(), all));
        }
        for (const std::string& line : lines) {
          for (const std::string& needle :
               {fmt::format("ddp: rank {}: the rendezvous has waited", rank),
                std::string("for 1 of 4 ranks: missing rank(s) 3 on node(s) 1 (of 2)"),
                std::string("it gives up after 1.6 s")}) {
            if (line.find(needle) == std::string::npos) {
              throw std::runtime_error(fmt::format("'{}' lacks '{}'", line, needle));
            }
          }
        }
      },
      30s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rendezvous, ARankWaitingForTheStoreWarnsThatItWaitsForRankZero) {
  const int port = test::free_port();  // nobody listens: rank 0 never starts
  std::vector<std::string> lines;
  InitOptions options = options_for(1, 2, port, 1200ms);
  options.launch.local_rank = 0;  // the first rank of node 1
  options.launch.local_world_size = 1;
  options.wait_warning = 250ms;
  options.warn = [&](const std::string& line) { lines.push_back(line); };
  EXPECT_THROW(rendezvous(options), TimeoutError);
  ASSERT_GE(lines.size(), 2u);
  EXPECT_LE(lines.size(), 5u) << fmt::format("{}", fmt::join(lines, "\n"));
  EXPECT_THAT(lines[0], HasSubstr(fmt::format("ddp: rank 1: the rendezvous has waited 0.2")));
  EXPECT_THAT(lines[0],
              HasSubstr(fmt::format(
                  "for the rendezvous store at 127.0.0.1:{}, which global rank 0 hosts", port)));
  // Zero turns the warnings off.
  lines.clear();
  options.wait_warning = 0ms;
  options.timeout = 600ms;
  EXPECT_THROW(rendezvous(options), TimeoutError);
  EXPECT_TRUE(lines.empty());
}

TEST(Rendezvous, JobOfOneNeedsNoLauncher) {
  World world = rendezvous({.timeout = 5s});
  EXPECT_EQ(world.rank(), 0);
  EXPECT_EQ(world.size(), 1);
  world.store->set("k", "v");
  EXPECT_EQ(world.store->get_string("k"), "v");
}

TEST(ResolveTimeout, PrecedenceAndBadValues) {
  const auto env = [](std::optional<std::string> value) {
    return [value](const std::string& name) -> std::optional<std::string> {
      return name == "DDP_TIMEOUT" ? value : std::nullopt;
    };
  };
  EXPECT_EQ(resolve_timeout(std::nullopt, env(std::nullopt)), kDefaultTimeout);
  EXPECT_EQ(resolve_timeout(std::nullopt, env("2.5")), 2500ms);
  EXPECT_EQ(resolve_timeout(7s, env("2.5")), 7s);
  for (const char* bad : {"", "abc", "0", "-3", "10s", "inf"}) {
    try {
      resolve_timeout(std::nullopt, env(bad));
      ADD_FAILURE() << "accepted DDP_TIMEOUT=" << bad;
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("DDP_TIMEOUT"));
    }
  }
  EXPECT_THROW(resolve_timeout(0ms, env(std::nullopt)), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
