// The flight recorder in real processes: rank 1 skips a collective, so rank 0 times out; both
// ranks' dumps exist, are valid JSON, and `ddp-trace analyze` names rank 1 as behind and the
// collective that never matched. SIGUSR1 dumps a live group, which goes on working.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using nlohmann::json;

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

bool wait_for_file(const std::filesystem::path& path, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

class FlightRecorderJob : public ::testing::TestWithParam<Mode> {};

TEST_P(FlightRecorderJob, RankThatSkipsACollectiveIsNamedBehindByTheAnalyzer) {
  TempDir store("ddp-flight-store");
  TempDir dumps("ddp-flight-dumps");
  const auto rank0_dump = dumps / "ddp_flight_default_rank0.json";
  const auto rank1_dump = dumps / "ddp_flight_default_rank1.json";
  auto results = run_ranks(
      2,
      [&](int rank) {
        ::setenv("DDP_DUMP_DIR", dumps.path().c_str(), 1);
        RingOptions options = apply_mode(GetParam(), rank, 2, {.timeout = 20s});
        auto pg = make_group(store.path(), rank, 2, options);
        std::vector<float> buf(256, 1.0f);
        pg->allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum)->wait();  // #0
        pg->broadcast(buf.data(), buf.size(), DType::kFloat32, 0)->wait();               // #1
        if (rank == 0) {
          // #2: rank 1 never issues it.
          bool failed = false;
          try {
            pg->allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum, {.timeout = 1s})
                ->wait();
          } catch (const CommError&) {
            failed = true;
          }
          require(failed, "rank 0's allreduce #2 did not fail");
          // Written before the error reached the caller.
          require(std::filesystem::exists(rank0_dump), "rank 0 wrote no dump before its error");
        } else {
          // Busy elsewhere until rank 0 has given up; its next calls then fail at once. (Over
          // TCP the first may still complete from what rank 0 sent before it gave up.)
          require(wait_for_file(rank0_dump, 30s), "rank 0 wrote no dump");
          bool failed = false;
          try {
            pg->allreduce(buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum)->wait();
            pg->barrier()->wait();
          } catch (const CommError&) {
            failed = true;
          }
          require(failed, "rank 1's call after rank 0's failure succeeded");
          require(std::filesystem::exists(rank1_dump), "rank 1 wrote no dump");
        }
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
  ASSERT_TRUE(std::filesystem::exists(rank0_dump));
  ASSERT_TRUE(std::filesystem::exists(rank1_dump));
  const json d0 = read_json(rank0_dump);
  const json d1 = read_json(rank1_dump);
  EXPECT_EQ(d0["reason"], "timeout");
  EXPECT_EQ(d0["rank"], 0);
  EXPECT_EQ(d1["rank"], 1);
  EXPECT_EQ(d0["size"], 2);
  EXPECT_EQ(d0["group"], "default");
  ASSERT_EQ(d0["entries"].size(), 3u);
  EXPECT_EQ(d0["entries"][2]["op"], "allreduce");
  EXPECT_EQ(d0["entries"][2]["state"], "failed");
  EXPECT_EQ(d0["entries"][1]["op"], "broadcast");
  EXPECT_EQ(d0["entries"][1]["state"], "completed");

  auto analyzer = Subprocess::start({built_program("ddp-trace"), "analyze", dumps.path()});
  const auto r = analyzer.wait(30s);
  std::cout << "ddp-trace analyze said:\n" << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("rank 1 is behind: it last completed broadcast(float32 x 256, root 0) "
                          "#1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("while rank 0 reached allreduce(float32 x 256, sum) #2"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("collective allreduce(float32 x 256, sum) #2 never matched: issued on "
                          "rank 0, never issued on rank 1"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("first failure: rank 0"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("mismatch at"), std::string::npos) << r.output;
}

TEST_P(FlightRecorderJob, SigUsr1DumpsALiveGroupThatGoesOnWorking) {
  TempDir store("ddp-flight-store");
  TempDir dumps("ddp-flight-dumps");
  auto results = run_ranks(
      2,
      [&](int rank) {
        ::setenv("DDP_DUMP_DIR", dumps.path().c_str(), 1);
        RingOptions options = apply_mode(GetParam(), rank, 2, {.timeout = 20s});
        auto pg = make_group(store.path(), rank, 2, options);
        std::vector<double> buf(16, 1.0);
        for (int i = 0; i < 5; ++i)
          pg->allreduce(buf.data(), buf.size(), DType::kFloat64, ReduceOp::kMax)->wait();
        const auto file = dumps / fmt::format("ddp_flight_default_rank{}.json", rank);
        require(::kill(::getpid(), SIGUSR1) == 0, "kill failed");
        require(wait_for_file(file, 20s), "SIGUSR1 wrote no dump");
        const json d = read_json(file);
        require(d["reason"] == "signal", "reason " + d["reason"].dump());
        require(d["entries"].size() == 5, "entries " + std::to_string(d["entries"].size()));
        require(d["entries"][3]["state"] == "completed", "#3 " + d["entries"][3].dump());
        require(d["entries"][0]["dtype"] == "float64", d["entries"][0].dump());
        require(d["entries"][0]["reduce_op"] == "max", d["entries"][0].dump());
        // The group goes on.
        pg->allreduce(buf.data(), buf.size(), DType::kFloat64, ReduceOp::kMax)->wait();
        pg->barrier()->wait();
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(Transports, FlightRecorderJob, ::testing::Values(Mode::kTcp, Mode::kShm),
                         [](const auto& info) { return mode_name(info.param); });

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
