// One 64 MiB allreduce (many pipelined chunks per segment) in real processes, checked element by
// element, for world sizes 2 and 3 (3 does not divide the element count evenly), over TCP, over
// shared memory (default 1 MiB chunks), and hierarchically over two pretend hosts (2+2).
// Under TSan (the tsan stage of scripts/test.sh) the message is 4 MiB with chunks a sixteenth of
// the defaults: as many chunks per segment, so the same pipelined paths meet the same threads, at
// a sixteenth of the instrumented copying and reducing (the 64 MiB runs took 45-51 s each there).
#include <gtest/gtest.h>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"
#include "support/sanitizers.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

class LargeAllreduce : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

TEST_P(LargeAllreduce, SixtyFourMiBFloat32SumAndAvg) {
  const int size = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  TempDir dir;
  auto results = run_ranks(
      size,
      [&](int rank) {
        RingOptions options = apply_mode(mode, rank, size, {.timeout = 60s});
#if DDP_TEST_UNDER_TSAN
        options.chunk_bytes /= 16;
        options.shm_slot_bytes = (1u << 20) / 16;
        constexpr std::size_t kBytes = 4u << 20;
#else
        options.shm_slot_bytes = 0;  // the default chunk size, at this size
        constexpr std::size_t kBytes = 64u << 20;
#endif
        auto pg = make_group(dir.path(), rank, size, options);
        expect_transport(mode, *pg);
        constexpr std::size_t kCount = kBytes / 4 + 1;  // 64 MiB (TSan: 4) and one element
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          auto buf = make_input(DType::kFloat32, kCount, rank, 3);
          pg->allreduce(buf.data(), kCount, DType::kFloat32, op)->wait();
          expect_bytes(buf, expected_reduction(DType::kFloat32, op, kCount, size, 3),
                       DType::kFloat32, fmt::format("{} MiB {}", kBytes >> 20, to_string(op)));
        }
      },
      120s);
  EXPECT_ALL_RANKS_OK(results);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<int, Mode>>& info) {
  return mode_name(std::get<1>(info.param)) + "_world" + std::to_string(std::get<0>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Transports, LargeAllreduce,
                         ::testing::Values(std::tuple{2, Mode::kTcp}, std::tuple{3, Mode::kTcp},
                                           std::tuple{2, Mode::kShm}, std::tuple{3, Mode::kShm},
                                           std::tuple{4, Mode::kHierEqual}),
                         param_name);

}  // namespace
}  // namespace ddp::test
