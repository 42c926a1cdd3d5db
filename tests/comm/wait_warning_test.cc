// DDP_WAIT_WARN_SECONDS: a collective that waits for a peer longer than the threshold logs one
// warning naming the operation, its sequence number and the rank it waits for, and still completes
// when the peer arrives (over TCP and over shared memory).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <mutex>
#include <thread>

#include <fmt/ranges.h>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

class WaitWarning : public ::testing::TestWithParam<Mode> {};

TEST_P(WaitWarning, ALongWaitNamesTheOperationAndThePeerOnceAndTheCallStillCompletes) {
  TempDir store("ddp-wait-warning");
  auto results = run_ranks(
      2,
      [&](int rank) {
        ::setenv("DDP_WAIT_WARN_SECONDS", "0.2", 1);
        std::mutex mutex;
        std::vector<std::string> lines;
        RingOptions options = apply_mode(GetParam(), rank, 2, {.timeout = 20s});
        options.log = [&](const std::string& line) {
          std::lock_guard lock(mutex);
          lines.push_back(line);
        };
        auto pg = make_group(store.path(), rank, 2, options);
        std::vector<float> buf(256, 1.0f);
        pg->allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum)->wait();  // #0
        if (rank == 1) std::this_thread::sleep_for(1200ms);  // busy elsewhere
        pg->allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum)->wait();  // #1
        if (buf[0] != 4.0f) throw std::runtime_error(fmt::format("result {}", buf[0]));
        if (rank == 1) return;
        std::lock_guard lock(mutex);
        std::vector<std::string> warnings;
        for (const auto& line : lines) {
          if (line.find("warning") != std::string::npos) warnings.push_back(line);
        }
        if (warnings.size() != 1) {
          throw std::runtime_error(fmt::format("{} warnings instead of 1: {}", warnings.size(),
                                               fmt::join(lines, " | ")));
        }
        const std::string& w = warnings[0];
        for (const char* part :
             {"allreduce(float32 x 256, sum) #1", "rank 1", "has waited", "group 'default'"}) {
          if (w.find(part) == std::string::npos) {
            throw std::runtime_error(fmt::format("the warning lacks '{}': {}", part, w));
          }
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Transports, WaitWarning, ::testing::Values(Mode::kTcp, Mode::kShm),
                         [](const auto& info) { return mode_name(info.param); });

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
