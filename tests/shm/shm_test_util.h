// Helpers of the ShmDomain tests: a fresh store directory per test, headers, reference values and
// /dev/shm listings. Test fixture only; used from one thread of each rank process.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/file_store.h"
#include "comm/reduce_kernels.h"
#include "comm/ring/shm/shm_domain.h"
#include "comm/wire.h"
#include "support/reference_values.h"
#include "support/temp_dir.h"

namespace ddp::test::shm {

using namespace std::chrono_literals;
using comm::OpHeader;
using comm::shm::ShmDomain;
using comm::shm::ShmOptions;

inline constexpr DType kAllDTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                       DType::kBFloat16, DType::kInt8,    DType::kUInt8,
                                       DType::kInt32,    DType::kInt64};
inline constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                       ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                       ReduceOp::kBor, ReduceOp::kBxor};

// A fresh directory for a FileStore, removed by the parent at the end of the test.
using StoreDir = ::ddp::test::TempDir;

// A segment name prefix that only this test process uses, so /dev/shm checks see only ours.
inline std::string unique_prefix(const std::string& what) {
  return fmt::format("ddp-shmtest-{}-{}", what, ::getpid());
}

// Entries of /dev/shm whose names start with `prefix`.
inline std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back(name);
  }
  return found;
}

inline net::Deadline after(std::chrono::milliseconds timeout) {
  return net::deadline_after(timeout);
}

inline std::unique_ptr<ShmDomain> make_domain(const std::filesystem::path& dir, int rank, int size,
                                              ShmOptions options = {},
                                              std::chrono::milliseconds timeout = 20s) {
  FileStore store(dir, timeout);
  return ShmDomain::create(store, "shm", rank, size, std::move(options), after(timeout));
}

inline OpHeader header(Collective kind, DType dtype, std::size_t count, std::uint64_t sequence,
                       ReduceOp op = ReduceOp::kSum, int root = -1) {
  OpHeader h;
  h.kind = kind;
  h.dtype = static_cast<std::uint8_t>(dtype);
  const bool reduces = kind == Collective::kAllreduce || kind == Collective::kReduce ||
                       kind == Collective::kReduceScatter;
  h.reduce_op = reduces ? static_cast<std::uint8_t>(op) : comm::kNoReduceOp;
  h.count = count;
  h.root = root;
  h.sequence = sequence;
  return h;
}

// Input value of element i on rank r: small integers, so that sums are exact in every dtype and
// products stay within int8 after wrapping.
inline double input_value(ReduceOp op, DType dtype, int rank, std::size_t i) {
  if (op == ReduceOp::kProduct) {
    static constexpr double kFactors[] = {1, -1, 2};
    const double f = kFactors[(rank + i) % 3];
    return dtype == DType::kUInt8 && f < 0 ? 3 : f;
  }
  const double v = static_cast<double>((rank * 7 + i * 3) % 11);
  return dtype == DType::kUInt8 ? v : v - 5;
}

// Element i of a buffer of `dtype`, through the shared reference helpers.
inline void store_value(void* buf, std::size_t i, DType dtype, double v) {
  test::store_value(dtype, static_cast<std::byte*>(buf) + i * dtype_size(dtype), v);
}

inline double load_value(const void* buf, std::size_t i, DType dtype) {
  return test::load_value(dtype, static_cast<const std::byte*>(buf) + i * dtype_size(dtype));
}

// The reduction of element i over `size` ranks, computed independently of the kernels: in
// int64/double, then wrapped or rounded the way the dtype stores it.
inline double expected_value(ReduceOp op, DType dtype, int size, std::size_t i) {
  double acc = input_value(op, dtype, 0, i);
  for (int r = 1; r < size; ++r) {
    acc = test::combine(op, acc, input_value(op, dtype, r, i));
  }
  if (op == ReduceOp::kAvg) {
    if (is_float(dtype)) {
      acc /= size;
    } else {
      acc = static_cast<double>(static_cast<std::int64_t>(acc) / size);
    }
  }
  // Through the dtype: wraps integers, rounds floats.
  std::byte tmp[8];
  store_value(tmp, 0, dtype, acc);
  return load_value(tmp, 0, dtype);
}

inline void expect_close(double got, double want, DType dtype, const std::string& where) {
  const double tolerance = dtype == DType::kFloat16 || dtype == DType::kBFloat16 ? 1e-2
                           : dtype == DType::kFloat32                            ? 1e-6
                                                                                 : 1e-12;
  if (std::fabs(got - want) > tolerance * std::max(1.0, std::fabs(want))) {
    throw std::runtime_error(fmt::format("{}: got {}, want {}", where, got, want));
  }
}

// FNV-1a of a buffer, to compare results across ranks through the store.
inline std::string digest(const void* data, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ULL;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i)
    h = (h ^ p[i]) * 1099511628211ULL;
  return fmt::format("{:016x}", h);
}

// Throws unless every rank published the same digest under `key`.
inline void expect_same_on_all_ranks(Store& store, const std::string& key, int rank, int size,
                                     const std::string& mine) {
  store.set(fmt::format("{}/{}", key, rank), mine);
  for (int r = 0; r < size; ++r) {
    const std::string theirs = store.get_string(fmt::format("{}/{}", key, r));
    if (theirs != mine) {
      throw std::runtime_error(
          fmt::format("{}: rank {} has digest {}, rank {} has {}", key, rank, mine, r, theirs));
    }
  }
}

}  // namespace ddp::test::shm
