// ddp-bench's reference check against an independent, naive simulation of every collective: the
// check must accept correct results for every dtype, reduction and world size, and must count
// a corrupted element, a misplaced block and an untouched (poisoned) buffer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <vector>

#include "ddp-bench/reference.h"

namespace ddp::bench {
namespace {

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                             DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
constexpr ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                   ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                   ReduceOp::kBor, ReduceOp::kBxor};

using Bytes = std::vector<std::byte>;

// Rank r's input, as the runner writes it (broadcast works in place on the same values).
Bytes input_of(const CheckSpec& spec, const Layout& layout, int r) {
  Bytes b(layout.send_count * dtype_size(spec.dtype));
  fill_input(spec, r, b.data(), layout.send_count);
  return b;
}

// Element k reduced over ranks pairwise, rounding (or wrapping) to the dtype after every step as
// a ring would; avg divides once at the end.
double reduce_element(const CheckSpec& spec, const std::vector<Bytes>& inputs, std::size_t k) {
  Bytes acc(dtype_size(spec.dtype));
  store_value(spec.dtype, acc.data(), 0, load_value(spec.dtype, inputs[0].data(), k));
  for (std::size_t r = 1; r < inputs.size(); ++r) {
    const double a = load_value(spec.dtype, acc.data(), 0);
    const double b = load_value(spec.dtype, inputs[r].data(), k);
    double v = 0;
    switch (spec.reduce_op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        v = a + b;
        break;
      case ReduceOp::kMin:
        v = std::min(a, b);
        break;
      case ReduceOp::kMax:
        v = std::max(a, b);
        break;
      case ReduceOp::kProduct:
        v = a * b;
        break;
      case ReduceOp::kBand:
        v = static_cast<double>(static_cast<long long>(a) & static_cast<long long>(b));
        break;
      case ReduceOp::kBor:
        v = static_cast<double>(static_cast<long long>(a) | static_cast<long long>(b));
        break;
      case ReduceOp::kBxor:
        v = static_cast<double>(static_cast<long long>(a) ^ static_cast<long long>(b));
        break;
    }
    store_value(spec.dtype, acc.data(), 0, v);
  }
  double result = load_value(spec.dtype, acc.data(), 0);
  if (spec.reduce_op == ReduceOp::kAvg) {
    result =
        is_integer(spec.dtype) ? std::trunc(result / spec.world_size) : result / spec.world_size;
  }
  return result;
}

// What rank `rank` receives, by the definitions in process_group.h.
Bytes simulate(const CheckSpec& spec, const Layout& layout, int rank,
               const std::vector<Bytes>& inputs) {
  const std::size_t block = layout.block_count;
  const auto r = static_cast<std::size_t>(rank);
  Bytes recv(layout.recv_count * dtype_size(spec.dtype));
  const auto from = [&](int q, std::size_t k) {
    return load_value(spec.dtype, inputs[q].data(), k);
  };
  for (std::size_t j = 0; j < layout.recv_count; ++j) {
    double v = 0;
    switch (spec.collective) {
      case Collective::kAllreduce:
      case Collective::kReduce:
        v = reduce_element(spec, inputs, j);
        break;
      case Collective::kReduceScatter:
        v = reduce_element(spec, inputs, r * block + j);
        break;
      case Collective::kBroadcast:
        v = from(spec.root, j);
        break;
      case Collective::kAllgather:
      case Collective::kGather:
        v = from(static_cast<int>(j / block), j % block);
        break;
      case Collective::kScatter:
        v = from(spec.root, r * block + j);
        break;
      case Collective::kAlltoall:
        v = from(static_cast<int>(j / block), r * block + j % block);
        break;
      case Collective::kSend:
        v = from((rank + spec.world_size - 1) % spec.world_size, j);
        break;
      case Collective::kBarrier:
        break;
    }
    store_value(spec.dtype, recv.data(), j, v);
  }
  return recv;
}

bool receives(const CheckSpec& spec, int rank) {
  if (spec.collective == Collective::kBarrier) return false;
  if (spec.collective == Collective::kReduce || spec.collective == Collective::kGather) {
    return rank == spec.root;
  }
  return true;
}

bool is_reduction(Collective c) {
  return c == Collective::kAllreduce || c == Collective::kReduce || c == Collective::kReduceScatter;
}

TEST(BenchReference, AcceptsCorrectResultsAndCountsWrongOnes) {
  int cases = 0;
  for (int world_size : {1, 2, 3, 5}) {
    std::vector<Collective> collectives = all_collectives();
    collectives.push_back(Collective::kSend);
    for (Collective collective : collectives) {
      if (collective == Collective::kBarrier) continue;
      for (DType dtype : kDTypes) {
        for (ReduceOp op : kReduceOps) {
          if (!is_reduction(collective) && op != ReduceOp::kSum) continue;
          if (is_bitwise(op) && !is_integer(dtype)) continue;  // refused by --reduce-op
          const CheckSpec spec{.collective = collective,
                               .dtype = dtype,
                               .reduce_op = op,
                               .world_size = world_size,
                               .root = world_size - 1};
          const Layout layout = layout_for(collective, 1000, dtype, world_size);
          std::vector<Bytes> inputs;
          for (int r = 0; r < world_size; ++r)
            inputs.push_back(input_of(spec, layout, r));
          for (int rank = 0; rank < world_size; ++rank) {
            SCOPED_TRACE(::testing::Message()
                         << to_string(collective) << " " << to_string(dtype) << " " << to_string(op)
                         << " world " << world_size << " rank " << rank);
            ++cases;
            Bytes recv = simulate(spec, layout, rank, inputs);
            EXPECT_EQ(count_wrong(spec, rank, recv.data(), layout), 0u);
            if (!receives(spec, rank)) continue;

            const std::size_t k = layout.recv_count / 2;
            const double good = load_value(dtype, recv.data(), k);
            store_value(dtype, recv.data(), k, good + 100);
            EXPECT_EQ(count_wrong(spec, rank, recv.data(), layout), 1u);

            poison(dtype, recv.data(), layout.recv_count);
            EXPECT_EQ(count_wrong(spec, rank, recv.data(), layout), layout.recv_count);
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 500);
}

TEST(BenchReference, NoticesBlocksInTheWrongPlace) {
  const CheckSpec spec{.collective = Collective::kAllgather, .world_size = 3};
  const Layout layout = layout_for(spec.collective, 3 * 16 * 4, spec.dtype, 3);
  std::vector<Bytes> inputs;
  for (int r = 0; r < 3; ++r)
    inputs.push_back(input_of(spec, layout, r));
  Bytes recv = simulate(spec, layout, 0, inputs);
  // Swap the blocks of ranks 0 and 1.
  const std::size_t block_bytes = layout.block_count * 4;
  std::swap_ranges(recv.begin(), recv.begin() + static_cast<std::ptrdiff_t>(block_bytes),
                   recv.begin() + static_cast<std::ptrdiff_t>(block_bytes));
  EXPECT_GE(count_wrong(spec, 0, recv.data(), layout), layout.block_count);
}

TEST(BenchLayout, BlockedCollectivesUseWholeBlocksOfAtLeastOneElement) {
  const Layout allgather = layout_for(Collective::kAllgather, 1024, DType::kFloat32, 3);
  EXPECT_EQ(allgather.block_count, 85u);
  EXPECT_EQ(allgather.total_count, 255u);
  EXPECT_EQ(allgather.send_count, 85u);
  EXPECT_EQ(allgather.recv_count, 255u);
  EXPECT_EQ(allgather.bytes, 1020u);

  const Layout scatter = layout_for(Collective::kReduceScatter, 1, DType::kFloat64, 4);
  EXPECT_EQ(scatter.block_count, 1u);
  EXPECT_EQ(scatter.send_count, 4u);
  EXPECT_EQ(scatter.recv_count, 1u);
  EXPECT_EQ(scatter.bytes, 32u);

  const Layout allreduce = layout_for(Collective::kAllreduce, 1001, DType::kFloat16, 3);
  EXPECT_EQ(allreduce.total_count, 500u);
  EXPECT_EQ(allreduce.send_count, 500u);
  EXPECT_EQ(allreduce.recv_count, 500u);
  EXPECT_EQ(allreduce.bytes, 1000u);

  const Layout barrier = layout_for(Collective::kBarrier, 1 << 20, DType::kFloat32, 2);
  EXPECT_EQ(barrier.bytes, 0u);
  EXPECT_EQ(barrier.recv_count, 0u);
}

TEST(BenchLayout, BusBandwidthFactorsAreThoseOfNcclTests) {
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kAllreduce, 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kAllreduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kAllgather, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kAlltoall, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kBroadcast, 4), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kReduce, 4), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kSend, 4), 1.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kBarrier, 4), 0.0);
  EXPECT_DOUBLE_EQ(bus_bandwidth_factor(Collective::kAllreduce, 1), 0.0);
}

TEST(BenchValues, SixteenBitFloatsRoundToNearestEven) {
  std::uint16_t h = 0;
  const auto round_trip = [&](DType d, double v) {
    store_value(d, &h, 0, v);
    return load_value(d, &h, 0);
  };
  EXPECT_EQ(round_trip(DType::kFloat16, 1.0), 1.0);
  EXPECT_EQ(round_trip(DType::kFloat16, -2.5), -2.5);
  EXPECT_EQ(round_trip(DType::kFloat16, 65504.0), 65504.0);
  EXPECT_TRUE(std::isinf(round_trip(DType::kFloat16, 65520.0)));
  EXPECT_EQ(round_trip(DType::kFloat16, 1.0 / 3.0), 0.333251953125);
  EXPECT_EQ(round_trip(DType::kFloat16, std::ldexp(1.0, -24)), std::ldexp(1.0, -24));
  EXPECT_EQ(round_trip(DType::kFloat16, 2049.0), 2048.0);  // tie goes to even
  EXPECT_EQ(round_trip(DType::kFloat16, 2051.0), 2052.0);
  EXPECT_TRUE(std::isnan(round_trip(DType::kFloat16, std::nan(""))));
  EXPECT_EQ(round_trip(DType::kBFloat16, 1.0 / 3.0), 0.333984375);
  EXPECT_EQ(round_trip(DType::kBFloat16, 257.0), 256.0);  // tie goes to even
  EXPECT_EQ(round_trip(DType::kBFloat16, 259.0), 260.0);
  EXPECT_TRUE(std::isnan(round_trip(DType::kBFloat16, std::nan(""))));
}

TEST(BenchValues, IntegersWrapLikeTheDType) {
  std::int64_t buf = 0;
  store_value(DType::kInt8, &buf, 0, 128);
  EXPECT_EQ(load_value(DType::kInt8, &buf, 0), -128);
  store_value(DType::kUInt8, &buf, 0, -1);
  EXPECT_EQ(load_value(DType::kUInt8, &buf, 0), 255);
  store_value(DType::kInt64, &buf, 0, -12345);
  EXPECT_EQ(load_value(DType::kInt64, &buf, 0), -12345);
}

}  // namespace
}  // namespace ddp::bench
