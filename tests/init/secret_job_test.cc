// A job launched with a secret (DDP_SECRET / DDP_SECRET_FILE): its ranks run, processes without
// the secret or with another one are turned away by the store, and the store listens only on
// MASTER_ADDR's interface unless DDP_STORE_LISTEN_ADDR asks otherwise. Real processes on
// 127.0.0.1.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/store/tcp_store.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;

constexpr const char* kSecret = "the job's secret";

void set_launch_variables(int rank, int world, int port) {
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("DDP_TIMEOUT", "30", 1);
}

void wait_for_file(const std::filesystem::path& path, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!std::filesystem::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("timed out waiting for " + path.string());
    }
    std::this_thread::sleep_for(5ms);
  }
}

void allreduce_ranks(ProcessGroup& group) {
  std::int64_t value = group.rank() + 1;
  group.allreduce(&value, 1, DType::kInt64, ReduceOp::kSum)->wait();
  const std::int64_t expected = group.size() * (group.size() + 1) / 2;
  if (value != expected) throw std::runtime_error(fmt::format("allreduce gave {}", value));
}

// The local address of the socket listening on `port` in /proc/net/tcp{,6} ("0100007F" is
// 127.0.0.1, "00000000" every IPv4 address), or "" when none listens.
std::string listening_address(int port) {
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && std::stoi(local.substr(colon + 1), nullptr, 16) == port) {
        return local.substr(0, colon);
      }
    }
  }
  return "";
}

// Tries to join the store at 127.0.0.1:port with `secret`; returns the StoreError's text, or
// throws when it was let in.
std::string refused_by_store(int port, const std::string& secret) {
  try {
    TcpStore store("127.0.0.1", static_cast<std::uint16_t>(port),
                   {.timeout = 5s, .connect_timeout = 10s, .auth_secret = secret});
    store.get_string("ddp/rendezvous/0/complete", 1s);
  } catch (const StoreError& e) {
    return e.what();
  }
  throw std::runtime_error(fmt::format("a client with secret '{}' was let into the store", secret));
}

TEST(SecretJob, RanksWithTheSecretRunAndStrangersAreTurnedAway) {
  TempDir dir;
  const int port = free_port();
  const auto results = run_ranks(4, [&](int rank) {
    if (rank == 3) {  // the stranger
      // Wait until the store is up (rank 0 has started it once its log file exists).
      wait_for_file(dir / "store_up", 30s);
      const std::string none = refused_by_store(port, "");
      const std::string wrong = refused_by_store(port, "a guess");
      std::ofstream(dir / "stranger_done") << none << "\n" << wrong << "\n";
      if (none.find("requires a shared secret") == std::string::npos ||
          wrong.find("rejected") == std::string::npos) {
        throw std::runtime_error("unexpected refusals: " + none + " / " + wrong);
      }
      return;
    }
    set_launch_variables(rank, 3, port);
    ::setenv("DDP_SECRET", kSecret, 1);
    auto group = init_process_group();
    if (rank == 0) {
      std::ofstream(dir / "store_up") << "1";
      if (listening_address(port) != "0100007F") {
        throw std::runtime_error("the store does not listen on 127.0.0.1 only: " +
                                 listening_address(port));
      }
    }
    allreduce_ranks(*group);
    if (rank == 0) wait_for_file(dir / "stranger_done", 60s);
    group->barrier()->wait();
    allreduce_ranks(*group);
    group->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SecretJob, SecretFromAFileWorksAndStoreListenAddressCanBeWidened) {
  TempDir dir;
  const std::string secret_file = dir.file("secret");
  std::ofstream(secret_file) << kSecret << "\n";
  ::chmod(secret_file.c_str(), 0600);
  const int port = free_port();
  const auto results = run_ranks(2, [&](int rank) {
    set_launch_variables(rank, 2, port);
    // Rank 0 reads the file, rank 1 the variable: the same secret either way.
    if (rank == 0) {
      ::setenv("DDP_SECRET_FILE", secret_file.c_str(), 1);
    } else {
      ::setenv("DDP_SECRET", kSecret, 1);
    }
    ::setenv("DDP_STORE_LISTEN_ADDR", "0.0.0.0", 1);
    auto group = init_process_group();
    if (rank == 0 && listening_address(port) != "00000000") {
      throw std::runtime_error("DDP_STORE_LISTEN_ADDR=0.0.0.0 was not used: " +
                               listening_address(port));
    }
    allreduce_ranks(*group);
    group->barrier()->wait();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SecretJob, RankWithAnotherSecretIsToldWhatToFix) {
  const int port = free_port();
  const auto results = run_ranks(2, [&](int rank) {
    set_launch_variables(rank, 2, port);
    ::setenv("DDP_TIMEOUT", rank == 0 ? "3" : "30", 1);
    ::setenv("DDP_SECRET", rank == 0 ? kSecret : "another secret", 1);
    try {
      init_process_group();
    } catch (const StoreError& e) {
      if (rank == 1 && std::string(e.what()).find("DDP_SECRET") != std::string::npos) return;
      throw;
    } catch (const TimeoutError& e) {
      if (rank == 0) return;  // rank 1 never arrived
      throw;
    }
    throw std::runtime_error("init_process_group succeeded");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(SecretJob, ConflictingSecretVariablesAreAConfigError) {
  TempDir dir;
  const std::string secret_file = dir.file("secret");
  std::ofstream(secret_file) << "one\n";
  ::chmod(secret_file.c_str(), 0600);
  const auto results = run_ranks(1, [&](int) {
    ::setenv("DDP_SECRET", "two", 1);
    ::setenv("DDP_SECRET_FILE", secret_file.c_str(), 1);
    try {
      init_process_group();
    } catch (const ConfigError& e) {
      if (std::string(e.what()).find("DDP_SECRET and DDP_SECRET_FILE") != std::string::npos) {
        return;
      }
      throw;
    }
    throw std::runtime_error("init_process_group accepted two different secrets");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
