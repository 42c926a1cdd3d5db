// One 64 MiB allreduce (many pipelined chunks per segment) in real processes, checked element by
// element, for world sizes 2 and 3 (3 does not divide the element count evenly).
#include <gtest/gtest.h>

#include "comm/comm_test_util.h"
#include "support/multiprocess.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

class LargeAllreduce : public ::testing::TestWithParam<int> {};

TEST_P(LargeAllreduce, SixtyFourMiBFloat32SumAndAvg) {
  const int size = GetParam();
  TempDir dir;
  auto results = run_ranks(
      size,
      [&](int rank) {
        auto pg = make_group(dir.path(), rank, size, {.timeout = 60s});
        constexpr std::size_t kCount = (64u << 20) / 4 + 1;  // 64 MiB and one element
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          auto buf = make_input(DType::kFloat32, kCount, rank, 3);
          pg->allreduce(buf.data(), kCount, DType::kFloat32, op)->wait();
          expect_bytes(buf, expected_reduction(DType::kFloat32, op, kCount, size, 3),
                       DType::kFloat32, fmt::format("64 MiB {}", to_string(op)));
        }
      },
      120s);
  EXPECT_ALL_RANKS_OK(results);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, LargeAllreduce, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace ddp::test
