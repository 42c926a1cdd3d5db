// Timelines: a 2-rank DDP run writes valid Chrome traces with the expected events; merge puts
// ranks whose clocks disagree (shifted on purpose) on one time line within the measured bound;
// an unusable trace folder or a full disk is a named error and the training goes on; and
// DistributedDataParallel::logging_data() reports buckets and iterations that add up.
#include <sys/resource.h>

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ddp-trace/timeline_merge.h"
#include "ddp/comm/trace.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_util.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return nlohmann::json::parse(in);
}

struct SmallNet : torch::nn::Module {
  SmallNet() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(torch::relu(fc1->forward(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// A few DDP steps marked the way a training script marks them. Returns the logging data.
DdpLoggingData train_steps(const std::shared_ptr<ProcessGroup>& group, int steps,
                           DdpOptions options = {}) {
  torch::manual_seed(1 + group->rank());
  auto model = DistributedDataParallel(std::make_shared<SmallNet>(), group, options);
  torch::optim::SGD optimizer(model->parameters(), 0.1);
  for (int step = 0; step < steps; ++step) {
    torch::Tensor x, y;
    {
      auto span = trace_span("data loading", "train", {{"step", step}});
      x = torch::randn({8, 16});
      y = torch::randint(0, 4, {8});
    }
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    {
      auto span = trace_span("backward", "train", {{"step", step}});
      loss.backward();
    }
    auto span = trace_span("optimizer step", "train", {{"step", step}});
    optimizer.step();
  }
  return model->logging_data();
}

TEST(Timeline, TwoRankDdpRunWritesAChromeTracePerRankWithTheTrainingAndBucketEvents) {
  TempDir dir("ddp-timeline");
  const int port = free_port();
  constexpr int kSteps = 3;
  const auto results = run_ranks(2, [&](int rank) {
    auto group = join_group(rank, 2, port);
    start_trace({.dir = dir.path().string(), .rank = rank, .world_size = 2});
    synchronize_trace_clock(*group);
    // Small buckets: several collectives per pass.
    const auto data =
        train_steps(group, kSteps, {.bucket_cap_mb = 0.0001, .first_bucket_cap_mb = 0.0001});
    stop_trace();
    if (data.iteration != kSteps)
      throw std::runtime_error(fmt::format("iteration {}", data.iteration));
    if (data.bucket_sizes.size() < 2) throw std::runtime_error("expected several buckets");
  });
  EXPECT_ALL_RANKS_OK(results);

  std::set<int> bucket_lanes;
  for (int rank = 0; rank < 2; ++rank) {
    const auto trace = read_json(dir / fmt::format("trace_rank{}.json", rank));
    ASSERT_TRUE(trace.contains("traceEvents"));
    std::map<std::string, int> count;
    for (const auto& e : trace["traceEvents"]) {
      EXPECT_EQ(e["pid"].get<int>(), rank);
      const std::string phase = e["ph"];
      if (phase == "M") continue;
      ++count[e["name"].get<std::string>()];
      EXPECT_GE(e["ts"].get<double>(), 0.0) << e.dump();
      if (phase == "X") {
        EXPECT_GE(e["dur"].get<double>(), 0.0) << e.dump();
      }
      if (e["name"] == "allreduce") {
        EXPECT_TRUE(e["args"].contains("bucket")) << e.dump();
        EXPECT_GT(e["args"]["bytes"].get<int>(), 0) << e.dump();
        bucket_lanes.insert(e["tid"].get<int>());
      }
    }
    for (const char* name : {"data loading", "forward", "backward", "optimizer step",
                             "backward compute (DDP)", "wait for gradient buckets"}) {
      EXPECT_EQ(count[name], kSteps) << "rank " << rank << ": " << name;
    }
    EXPECT_GE(count["allreduce"], 2 * kSteps) << "rank " << rank;
    EXPECT_EQ(count["bucket ready"], count["allreduce"]) << "rank " << rank;
    const auto& other = trace["otherData"];
    EXPECT_EQ(other["rank"], rank);
    EXPECT_EQ(other["world_size"], 2);
    EXPECT_EQ(other["dropped_events"], 0);
    EXPECT_TRUE(other["clock"]["offset_measured"].get<bool>());
  }
  EXPECT_GE(bucket_lanes.size(), 2u) << "each bucket's collective has a lane of its own";
  // No temporary files left behind.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
  }
}

TEST(Timeline, MergeAlignsRanksWhoseClocksDisagreeWithinTheMeasuredBound) {
  TempDir dir("ddp-timeline-merge");
  const int port = free_port();
  constexpr auto kShift = std::chrono::seconds(7);  // rank 1's clocks run 7 s ahead
  constexpr int kRounds = 3;
  const auto results = run_ranks(2, [&](int rank) {
    auto group = join_group(rank, 2, port);
    start_trace({.dir = dir.path().string(),
                 .rank = rank,
                 .world_size = 2,
                 .clock_shift = rank == 1 ? std::chrono::nanoseconds(kShift) : 0ns});
    synchronize_trace_clock(*group);
    // Causality fixes the answer whatever the scheduling: rank 0 records "ping sent", rank 1
    // "ping seen" after receiving it, rank 0 "pong seen" after the answer; on a common clock the
    // middle one lies between the other two.
    const int lane = trace_thread_lane();
    std::int64_t token = 0;
    for (int i = 0; i < kRounds; ++i) {
      if (rank == 0) {
        trace_instant("ping sent", "test", lane, trace_clock_ns(), {{"i", i}});
        group->send(&token, 1, DType::kInt64, 1, 7)->wait();
        group->recv(&token, 1, DType::kInt64, 1, 7)->wait();
        trace_instant("pong seen", "test", lane, trace_clock_ns(), {{"i", i}});
      } else {
        group->recv(&token, 1, DType::kInt64, 0, 7)->wait();
        trace_instant("ping seen", "test", lane, trace_clock_ns(), {{"i", i}});
        group->send(&token, 1, DType::kInt64, 0, 7)->wait();
      }
    }
    stop_trace();
  });
  EXPECT_ALL_RANKS_OK(results);

  const auto merged = trace::merge_timelines(trace::read_timelines(dir.path()));
  ASSERT_EQ(merged.alignment.size(), 2u);
  const auto& rank1 = merged.alignment[1];
  EXPECT_EQ(rank1.method, "ping-pong");
  ASSERT_GE(rank1.error_bound_ns, 0);
  EXPECT_LT(rank1.error_bound_ns, 500'000'000) << "half the best of 16 round trips on loopback";
  const double bound_us = static_cast<double>(rank1.error_bound_ns) / 1000.0;
  std::map<int, std::map<std::string, double>> ts;  // round -> event -> merged ts (µs)
  for (const auto& e : merged.trace["traceEvents"]) {
    if (e.value("cat", "") == "test") {
      ts[e["args"]["i"].get<int>()][e["name"].get<std::string>()] = e["ts"].get<double>();
    }
  }
  ASSERT_EQ(ts.size(), static_cast<std::size_t>(kRounds));
  for (const auto& [i, at] : ts) {
    ASSERT_EQ(at.size(), 3u) << "round " << i;
    const double sent = at.at("ping sent");
    const double seen = at.at("ping seen");
    const double back = at.at("pong seen");
    EXPECT_GE(seen, sent - bound_us) << "round " << i << ": rank 1 saw the ping before it was sent";
    EXPECT_LE(seen, back + bound_us) << "round " << i << ": rank 1 saw the ping after the pong";
    // The window is narrow next to the 7 s shift, so an unaligned rank 1 could not pass.
    EXPECT_LT(back - sent, 3.5e6) << "round " << i;
  }
}

TEST(Timeline, MergeNamesAFileThatIsNotATrace) {
  TempDir dir("ddp-timeline-bad");
  std::ofstream(dir / "trace_rank0.json") << "{\"traceEvents\": [";
  try {
    trace::read_timelines(dir.path());
    FAIL() << "expected TraceError";
  } catch (const trace::TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("trace_rank0.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
  }
  TempDir empty("ddp-timeline-empty");
  EXPECT_THROW(trace::read_timelines(empty.path()), trace::TraceError);
}

TEST(Timeline, AnUnwritableTraceFolderIsANamedErrorAtStartTraceAndAtInit) {
  TempDir dir("ddp-timeline-unwritable");
  std::ofstream(dir / "a-file") << "x";
  const std::string bad = (dir / "a-file" / "traces").string();  // a folder under a file
  const int port = free_port();
  const auto results = run_ranks(2, [&](int rank) {
    try {
      start_trace({.dir = bad, .rank = rank, .world_size = 2});
      throw std::runtime_error("start_trace accepted a folder under a file");
    } catch (const TraceError& e) {
      if (std::string(e.what()).find(bad) == std::string::npos) {
        throw std::runtime_error(std::string("error does not name the folder: ") + e.what());
      }
    }
    if (trace_enabled()) throw std::runtime_error("tracing on after a failed start");
    // The same through the environment: refused at init, naming the variable and the folder,
    // before any rank waits for another.
    ::setenv("DDP_TRACE", bad.c_str(), 1);
    try {
      join_group(rank, 2, port);
      throw std::runtime_error("init_process_group accepted DDP_TRACE under a file");
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      if (what.find("DDP_TRACE") == std::string::npos || what.find(bad) == std::string::npos) {
        throw std::runtime_error("error does not name DDP_TRACE and the folder: " + what);
      }
    }
    if (trace_enabled()) throw std::runtime_error("tracing on after DDP_TRACE failed");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Timeline, AFullDiskIsANamedErrorAndLeavesThePreviousFileIntact) {
  TempDir dir("ddp-timeline-full");
  const auto results = run_ranks(1, [&](int) {
    start_trace({.dir = dir.path().string(), .rank = 0, .world_size = 1});
    trace_instant("first", "test", trace_thread_lane(), trace_clock_ns());
    const std::string path = flush_trace();
    const auto first_size = std::filesystem::file_size(path);
    for (int i = 0; i < 2000; ++i)
      trace_instant("filler", "test", trace_thread_lane(), trace_clock_ns(), {{"i", i}});
    // Files may not grow past the first flush's size: the second write runs out of room.
    std::signal(SIGXFSZ, SIG_IGN);
    const rlim_t limit = static_cast<rlim_t>(first_size + 100);
    const rlimit small{limit, limit};
    if (::setrlimit(RLIMIT_FSIZE, &small) != 0) throw std::runtime_error("setrlimit failed");
    try {
      flush_trace();
      throw std::runtime_error("flush into a full disk did not fail");
    } catch (const TraceError& e) {
      const std::string what = e.what();
      if (what.find("trace_rank0.json") == std::string::npos ||
          what.find("intact") == std::string::npos) {
        throw std::runtime_error("error does not name the file: " + what);
      }
    }
    const auto kept = read_json(path);  // still the first flush, whole
    if (kept["otherData"]["events"] != 1) throw std::runtime_error("previous file changed");
    for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
      if (entry.path().filename().string().find(".tmp") != std::string::npos) {
        throw std::runtime_error("temporary file left: " + entry.path().string());
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Timeline, EventsPastTheCapAreCountedAndTheFileSaysSo) {
  TempDir dir("ddp-timeline-cap");
  const auto results = run_ranks(1, [&](int) {
    start_trace({.dir = dir.path().string(), .rank = 0, .world_size = 1, .max_events = 10});
    for (int i = 0; i < 25; ++i) {
      auto span = trace_span("step", "test", {{"i", i}});
    }
    stop_trace();
  });
  EXPECT_ALL_RANKS_OK(results);
  const auto trace = read_json(dir / "trace_rank0.json");
  EXPECT_EQ(trace["otherData"]["events"], 10);
  EXPECT_EQ(trace["otherData"]["dropped_events"], 15);
  bool truncated = false;
  for (const auto& e : trace["traceEvents"])
    truncated = truncated || e.value("name", "") == "trace truncated";
  EXPECT_TRUE(truncated);
}

TEST(Timeline, LoggingDataBucketsAddUpToTheParametersAndIterationsAreCounted) {
  const int port = free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto group = join_group(rank, 2, port);
    const auto data = train_steps(group, 4, {.find_unused_parameters = true});
    std::int64_t bucket_bytes = 0;
    for (const auto b : data.bucket_sizes)
      bucket_bytes += b;
    std::int64_t bucket_params = 0;
    for (const auto p : data.bucket_parameter_counts)
      bucket_params += p;
    const std::int64_t expected_bytes = (16 * 32 + 32 + 32 * 4 + 4) * 4;
    const auto fail = [&](const std::string& what) {
      throw std::runtime_error(what + ": " + data.to_json());
    };
    if (data.world_size != 2 || data.rank != rank) fail("place");
    if (data.total_parameter_size_bytes != expected_bytes) fail("parameter bytes");
    if (bucket_bytes != expected_bytes) fail("bucket sizes do not sum to the parameter bytes");
    if (bucket_params != 4 || data.num_parameter_tensors != 4) fail("parameter counts");
    if (data.iteration != 4 || data.forward_passes != 4) fail("iterations");
    if (!data.has_rebuilt_buckets) fail("buckets rebuilt after the first iteration");
    if (!data.find_unused_parameters || !data.unused_parameter_names.empty()) fail("unused");
    if (data.comm_hook != "allreduce") fail("comm hook");
    if (data.avg_forward_compute_time <= 0 || data.avg_backward_compute_time <= 0 ||
        data.avg_backward_comm_time <= 0) {
      fail("average times");
    }
    if (data.last_bytes_sent != expected_bytes) fail("bytes sent");
    const auto json = nlohmann::json::parse(data.to_json());
    if (json["bucket_sizes"].size() != data.bucket_sizes.size()) fail("to_json");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A layer that forward never uses: find_unused_parameters reports it by name and size.
struct NetWithUnusedLayer : torch::nn::Module {
  NetWithUnusedLayer() {
    used = register_module("used", torch::nn::Linear(16, 4));
    unused = register_module("unused", torch::nn::Linear(16, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used->forward(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};

TEST(Timeline, LoggingDataNamesUnusedParametersAndTheCommHook) {
  const int port = free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto group = join_group(rank, 2, port);
    auto model = DistributedDataParallel(std::make_shared<NetWithUnusedLayer>(), group,
                                         {.find_unused_parameters = true});
    model->register_comm_hook(fp16_compress_hook(), "fp16_compress_hook");
    for (int step = 0; step < 2; ++step) {
      model->forward(torch::randn({4, 16})).sum().backward();
    }
    const auto data = model->logging_data();
    const auto fail = [&](const std::string& what) {
      throw std::runtime_error(what + ": " + data.to_json());
    };
    if (data.unused_parameter_names.size() != 2) fail("two unused parameters");
    for (const auto& name : data.unused_parameter_names) {
      if (name.find("unused") == std::string::npos) fail("unused parameter misnamed");
    }
    if (data.unused_parameter_size != (16 * 8 + 8) * 4) fail("unused parameter bytes");
    if (data.comm_hook != "fp16_compress_hook") fail("comm hook name");
    if (data.iteration != 2) fail("iterations");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace
}  // namespace ddp::test
