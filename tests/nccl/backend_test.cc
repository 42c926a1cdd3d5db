// DDP_BACKEND=nccl where it cannot run: on this machine (a CUDA runtime, no GPU) and with a
// libnccl that is not there, every rank of a real job fails at once with the named error; and the
// backend listing says whether this build has nccl.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "ddp/comm/nccl_process_group.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using ::testing::HasSubstr;

bool machine_has_gpu() {
  return std::filesystem::exists("/dev/nvidia0") || std::filesystem::exists("/dev/nvidiactl");
}

// Two ranks of a torchrun-style job with DDP_BACKEND=nccl (and `extra` set): each must fail with a
// ConfigError containing `expected`, well within the job's 20 s timeout.
void expect_every_rank_refuses(const char* extra_name, const char* extra_value,
                               const std::string& expected) {
  const int port = test::free_port();
  const auto results = test::run_ranks(
      2,
      [&](int rank) {
        test::set_launcher_environment(rank, 2, port, /*timeout_seconds=*/20);
        ::setenv("DDP_BACKEND", "nccl", 1);
        if (extra_name != nullptr) ::setenv(extra_name, extra_value, 1);
        const auto start = std::chrono::steady_clock::now();
        try {
          init_process_group();
        } catch (const ConfigError& e) {
          const std::string text = e.what();
          if (text.find(expected) == std::string::npos) {
            throw std::runtime_error("the ConfigError does not say '" + expected + "': " + text);
          }
          if (std::chrono::steady_clock::now() - start > 10s) {
            throw std::runtime_error("the error came only after 10 s: " + text);
          }
          return;
        }
        throw std::runtime_error("init_process_group succeeded");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclBackend, WithoutACudaDeviceEveryRankSaysSo) {
  if (!nccl_backend_available()) GTEST_SKIP() << "the nccl backend is not built";
  if (machine_has_gpu()) GTEST_SKIP() << "this machine has a GPU (/dev/nvidia*)";
  expect_every_rank_refuses(nullptr, nullptr, "the nccl backend found no CUDA device");
}

TEST(NcclBackend, WithoutLibncclEveryRankSaysSo) {
  if (!nccl_backend_available()) GTEST_SKIP() << "the nccl backend is not built";
  expect_every_rank_refuses(
      "DDP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2",
      "the nccl backend cannot load libnccl: tried /nonexistent/libnccl.so.2");
}

TEST(NcclBackend, MakeGroupChecksTheMachineBeforeMeetingAnyone) {
  if (!nccl_backend_available()) GTEST_SKIP() << "the nccl backend is not built";
  // No store server anywhere: the library error comes first, at once.
  const auto results = test::run_ranks(1, [](int) {
    try {
      prepare_nccl_device({.library = "/nonexistent/libnccl.so.2"});
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("DDP_NCCL_LIBRARY") == std::string::npos) {
        throw std::runtime_error(std::string("the error does not say what to do: ") + e.what());
      }
      return;
    }
    throw std::runtime_error("a missing libnccl was accepted");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclBackend, ALibraryWithoutNcclsFunctionsIsNamed) {
  if (!nccl_backend_available()) GTEST_SKIP() << "the nccl backend is not built";
  // libm loads, but it is no libnccl: the missing function is named, not a crash at the call.
  const auto results = test::run_ranks(1, [](int) {
    try {
      prepare_nccl_device({.library = "libm.so.6"});
    } catch (const ConfigError& e) {
      const std::string text = e.what();
      if (text.find("has no function ncclGetVersion") == std::string::npos ||
          text.find("NCCL 2.14 or later") == std::string::npos) {
        throw std::runtime_error("the error does not name the function and the fix: " + text);
      }
      return;
    }
    throw std::runtime_error("libm was taken for libnccl");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(NcclBackend, ListedExactlyWhenBuilt) {
  ::unsetenv("DDP_BACKEND");
  const auto names = available_backends();
  const bool listed = std::find(names.begin(), names.end(), "nccl") != names.end();
  EXPECT_EQ(listed, nccl_backend_available());
  // Never the default: a CPU job must not pick a GPU backend by itself.
  EXPECT_EQ(resolve_backend(), "ring");
  if (nccl_backend_available()) {
    EXPECT_EQ(resolve_backend("nccl", "--backend"), "nccl");
    EXPECT_STREQ(nccl_backend_unavailable_reason(), "");
  } else {
    try {
      resolve_backend("nccl", "--backend");
      ADD_FAILURE() << "nccl was accepted by a build without it";
    } catch (const ConfigError& e) {
      EXPECT_THAT(e.what(), HasSubstr("unknown backend 'nccl' (from --backend)"));
      EXPECT_THAT(e.what(), HasSubstr("the nccl backend is not built"));
      EXPECT_THAT(e.what(), HasSubstr(nccl_backend_unavailable_reason()));
    }
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
