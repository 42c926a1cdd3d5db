// The backend-independent conformance checks (collective_checks.h) on the ring backend, for world
// sizes 1-4 over shared memory (auto: every rank on this host) and over TCP only, each rank a real
// process meeting through a TcpStore.
#include <gtest/gtest.h>

#include "conformance/collective_checks.h"
#include "ddp/comm/ring_process_group.h"
#include "ddp/store/tcp_store.h"
#include "support/multiprocess.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

class RingConformance : public ::testing::TestWithParam<std::tuple<int, Transport>> {};

TEST_P(RingConformance, AllChecks) {
  // Not a structured binding: clang before 16 (the sanitizer stages) cannot capture one.
  const int size = std::get<0>(GetParam());
  const Transport transport = std::get<1>(GetParam());
  const int port = free_port();
  const auto results = run_ranks(
      size,
      [&](int rank) {
        auto store = std::make_shared<TcpStore>(
            "127.0.0.1", static_cast<std::uint16_t>(port),
            TcpStoreOptions{.is_server = rank == 0, .timeout = 60s, .connect_timeout = 60s});
        auto group =
            make_ring_process_group(store, rank, size, {.timeout = 60s, .transport = transport});
        for (const auto* checks : {&conformance::all_checks(), &conformance::failure_checks()}) {
          for (const auto& check : *checks) {
            try {
              check.run(*group);
            } catch (const std::exception& e) {
              throw std::runtime_error("check " + check.name + ": " + e.what());
            }
          }
        }
        group->barrier()->wait();
      },
      300s);
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, RingConformance,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(Transport::kAuto, Transport::kTcp)),
                         [](const ::testing::TestParamInfo<std::tuple<int, Transport>>& info) {
                           return std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == Transport::kTcp ? "_tcp" : "_auto");
                         });

}  // namespace
}  // namespace ddp::test
