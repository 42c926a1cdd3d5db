// run_ranks: runs a function in `world_size` real processes (fork), one per rank.
//
//   auto results = run_ranks(4, [&](int rank) { ... throw on failure ... });
//   EXPECT_ALL_RANKS_OK(results);
//
// Each child runs fn(rank); returning means success, an exception means failure and its message
// travels back to the parent, and so does an EXPECT_* or ASSERT_* that fails inside fn (GoogleTest
// records it in the child only: run_ranks reports it as the rank's failure, file:line and text). A child still running at the deadline is killed with SIGKILL and
// reported as timed out, so a test can never hang. Call it before the test has started threads
// of its own (fork copies only the calling thread).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace ddp::test {

struct RankResult {
  int rank = 0;
  int exit_code = -1;  // 0: fn returned; 1: fn threw; -1: killed by a signal
  int signal = 0;
  bool timed_out = false;
  std::string error;  // the exception's message, when fn threw
  bool ok() const { return exit_code == 0 && !timed_out; }
};

std::vector<RankResult> run_ranks(int world_size, const std::function<void(int rank)>& fn,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(120));

// A one-line-per-rank description of the results, for assertion messages.
std::string describe(const std::vector<RankResult>& results);

// A TCP port that is free right now (for a store or a master), never one this process was given
// before: two calls give two ports.
int free_port();

// Sets the variables a launcher gives rank `rank` of a one-host job of `world` ranks (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) and DDP_TIMEOUT
// (seconds), in this process: for a rank of run_ranks that calls rendezvous or init_process_group.
void set_launcher_environment(int rank, int world, int port, int timeout_seconds);

}  // namespace ddp::test

#define EXPECT_ALL_RANKS_OK(results)                                                      \
  for (const auto& r_ : (results)) {                                                      \
    EXPECT_TRUE(r_.ok()) << "rank " << r_.rank << ": " << ::ddp::test::describe(results); \
  }
