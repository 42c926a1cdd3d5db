#include "ddp/runtime/init.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "ddp/error.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

TEST(InitProcessGroup, RingGroupFromTheLaunchersVariablesAllreduces) {
  const int port = test::free_port();
  const auto results = test::run_ranks(3, [&](int rank) {
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "3", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("DDP_TIMEOUT", "30", 1);
    auto group = init_process_group();
    if (group->backend() != "ring") throw std::runtime_error("expected the ring backend");
    if (default_process_group() != group) throw std::runtime_error("not the default group");
    std::int64_t value = rank + 1;
    group->allreduce(&value, 1, DType::kInt64, ReduceOp::kSum)->wait();
    if (value != 6) throw std::runtime_error("allreduce gave " + std::to_string(value));
    group->barrier()->wait();
    destroy_process_group();
    if (default_process_group()) throw std::runtime_error("default group not destroyed");
  });
  EXPECT_ALL_RANKS_OK(results);
}

// DDP_BACKEND=auto: the default group is a ring group; a nccl group for CUDA tensors exists only
// where every rank can drive a GPU of its own, and otherwise the reason names the first rank that
// could not. Rank 1 is given a libnccl that does not exist, so that some rank always cannot.
TEST(InitProcessGroup, AutoMakesARingGroupAndNamesTheRankThatCannotUseNccl) {
  const int port = test::free_port();
  const auto results = test::run_ranks(2, [&](int rank) {
    test::set_launcher_environment(rank, 2, port, /*timeout_seconds=*/30);
    ::setenv("DDP_BACKEND", "auto", 1);
    ::setenv("DDP_QUIET", "1", 1);
    if (rank == 1) ::setenv("DDP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    auto group = init_process_group();
    const auto require = [](bool ok, const std::string& what) {
      if (!ok) throw std::runtime_error(what);
    };
    require(group->backend() == "ring", "the default group under auto is not a ring group");
    require(default_process_group() == group, "not the default group");
    require(default_cuda_process_group() == nullptr,
            "a nccl group was made although rank 1 has no libnccl");
    const std::string reason = cuda_process_group_absent_reason();
    // Rank 0 may lack a GPU too: then it is the first named, and both are counted.
    require(reason.find(" of 2 ranks cannot use nccl; the first, rank ") != std::string::npos,
            "the reason does not count and name the ranks: " + reason);
    if (reason.rfind("1 of 2", 0) == 0) {
      require(reason.find("rank 1: ") != std::string::npos &&
                  reason.find("/nonexistent/libnccl.so.2") != std::string::npos,
              "rank 1's reason does not name its libnccl: " + reason);
    }
    std::int64_t value = rank + 1;
    group->allreduce(&value, 1, DType::kInt64, ReduceOp::kSum)->wait();
    require(value == 3, "allreduce gave " + std::to_string(value));
    destroy_process_group();
    require(cuda_process_group_absent_reason().empty(), "the reason outlived the groups");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(InitProcessGroup, UnknownBackendListsTheAvailableOnes) {
  try {
    init_process_group({.backend = "gloo"});
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown backend 'gloo'"));
    EXPECT_THAT(e.what(), HasSubstr("ring"));
  }
}

TEST(InitProcessGroup, BackendFromTheEnvironmentIsNamedInErrors) {
  ::setenv("DDP_BACKEND", "gloo", 1);
  try {
    init_process_group();
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("DDP_BACKEND"));
  }
  ::unsetenv("DDP_BACKEND");
}

TEST(ResolveBackend, OneParserForEveryReaderRefusesUnknownNames) {
  ::unsetenv("DDP_BACKEND");
  EXPECT_EQ(resolve_backend(), "ring");
  EXPECT_EQ(resolve_backend("ring", "--backend"), "ring");
  ::setenv("DDP_BACKEND", "foo", 1);
  try {
    resolve_backend();
    ADD_FAILURE() << "DDP_BACKEND=foo was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown backend 'foo' (from DDP_BACKEND)"));
    EXPECT_THAT(e.what(), HasSubstr("this build of ddp has: ring"));
  }
  // An explicit choice wins over the environment, and is checked the same way.
  EXPECT_EQ(resolve_backend("ring", "--backend"), "ring");
  try {
    resolve_backend("Ring", "--backend");
    ADD_FAILURE() << "'Ring' was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown backend 'Ring' (from --backend)"));
  }
  ::setenv("DDP_BACKEND", "", 1);  // empty means unset
  EXPECT_EQ(resolve_backend(), "ring");
  ::unsetenv("DDP_BACKEND");
}

TEST(InitProcessGroup, JobOfOneWithoutLauncher) {
  const auto results = test::run_ranks(1, [](int) {
    auto group = init_process_group({.timeout = 10s});
    if (group->rank() != 0 || group->size() != 1) throw std::runtime_error("not a job of one");
    float x = 2.5f;
    group->allreduce(&x, 1, DType::kFloat32, ReduceOp::kAvg)->wait();
    if (x != 2.5f) throw std::runtime_error("allreduce of one changed the value");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
