// Throughput of the reduction kernels: bytes of output per second, out of place (dst = a op b)
// and in place (dst op= b), for every dtype with sum, and every op for float32/bfloat16.
// A vectorised float32 sum runs at memory speed (several GB/s per core); a scalar loop is
// several times slower.
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "comm/reduce_kernels.h"

namespace {

using ddp::DType;
using ddp::ReduceOp;

// 256 KiB per operand: the scratch chunk size the ring reduces at a time (fits in L2).
constexpr std::size_t kBytes = 256 * 1024;

void fill(std::vector<std::byte>& buf, DType dtype) {
  // Ones of the right type, so float ops stay finite.
  const std::size_t esz = ddp::dtype_size(dtype);
  for (std::size_t i = 0; i < buf.size() / esz; ++i) {
    std::byte* p = buf.data() + i * esz;
    switch (dtype) {
      case DType::kFloat32: {
        const float v = 1.0f;
        std::memcpy(p, &v, 4);
        break;
      }
      case DType::kFloat64: {
        const double v = 1.0;
        std::memcpy(p, &v, 8);
        break;
      }
      case DType::kFloat16: {
        const std::uint16_t v = 0x3c00;
        std::memcpy(p, &v, 2);
        break;
      }
      case DType::kBFloat16: {
        const std::uint16_t v = 0x3f80;
        std::memcpy(p, &v, 2);
        break;
      }
      default:
        std::memset(p, 1, esz);
        break;
    }
  }
}

void BM_Reduce(benchmark::State& state, DType dtype, ReduceOp op, bool in_place) {
  const std::size_t esz = ddp::dtype_size(dtype);
  const std::size_t count = kBytes / esz;
  std::vector<std::byte> a(kBytes), b(kBytes), out(kBytes);
  fill(a, dtype);
  fill(b, dtype);
  for (auto _ : state) {
    if (in_place) {
      ddp::comm::reduce(a.data(), a.data(), b.data(), count, dtype, op);
      benchmark::DoNotOptimize(a.data());
    } else {
      ddp::comm::reduce(out.data(), a.data(), b.data(), count, dtype, op);
      benchmark::DoNotOptimize(out.data());
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kBytes));
}

void register_all() {
  const DType dtypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                          DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
  for (DType dtype : dtypes) {
    for (bool in_place : {false, true}) {
      benchmark::RegisterBenchmark((std::string("sum/") + std::string(ddp::to_string(dtype)) +
                                    (in_place ? "/in_place" : "/out_of_place"))
                                       .c_str(),
                                   BM_Reduce, dtype, ReduceOp::kSum, in_place);
    }
  }
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt32}) {
    for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct}) {
      benchmark::RegisterBenchmark((std::string(ddp::to_string(op)) + "/" +
                                    std::string(ddp::to_string(dtype)) + "/out_of_place")
                                       .c_str(),
                                   BM_Reduce, dtype, op, false);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
