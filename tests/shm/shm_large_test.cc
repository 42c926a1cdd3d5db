// ShmDomain with 64 MiB allreduces (world 2 and 4): larger than the segment, default options.
#include <gtest/gtest.h>

#include <vector>

#include "shm/shm_test_util.h"
#include "support/multiprocess.h"

namespace ddp::test::shm {
namespace {

class ShmLarge : public ::testing::TestWithParam<int> {};

TEST_P(ShmLarge, Allreduce64MiBFloat32) {
  const int size = GetParam();
  StoreDir dir;
  const auto prefix = unique_prefix("large");
  auto results = run_ranks(
      size,
      [&](int rank) {
        auto domain = make_domain(dir.path(), rank, size, ShmOptions{.name_prefix = prefix});
        FileStore store(dir.path());
        const std::size_t count = (64u << 20) / sizeof(float);
        std::vector<float> send(count), recv(count);
        for (std::size_t i = 0; i < count; ++i)
          send[i] = static_cast<float>((rank * 7 + i * 3) % 11);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          domain->allreduce(send.data(), recv.data(), count, DType::kFloat32, op,
                            header(Collective::kAllreduce, DType::kFloat32, count,
                                   static_cast<std::uint64_t>(op)),
                            after(60s));
          for (std::size_t i = 0; i < count; ++i) {
            float want = 0;
            for (int r = 0; r < size; ++r)
              want += static_cast<float>((r * 7 + i * 3) % 11);
            if (op == ReduceOp::kAvg) want /= static_cast<float>(size);
            if (recv[i] != want)
              throw std::runtime_error(
                  fmt::format("{} element {}: got {}, want {}", to_string(op), i, recv[i], want));
          }
          expect_same_on_all_ranks(store, fmt::format("large/{}", to_string(op)), rank, size,
                                   digest(recv.data(), recv.size() * sizeof(float)));
        }
      },
      std::chrono::seconds(150));
  EXPECT_ALL_RANKS_OK(results);
  EXPECT_TRUE(shm_entries(prefix).empty());
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmLarge, ::testing::Values(2, 4),
                         [](const auto& info) { return fmt::format("world{}", info.param); });

}  // namespace
}  // namespace ddp::test::shm
