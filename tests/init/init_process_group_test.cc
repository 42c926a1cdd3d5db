#include "ddp/init.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "ddp/error.h"
#include "support/multiprocess.h"

namespace ddp {
namespace {

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

}  // namespace
}  // namespace ddp
