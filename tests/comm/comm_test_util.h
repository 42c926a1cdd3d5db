// Helpers for the collective tests: a group per rank on a FileStore, deterministic per-rank
// inputs for every dtype, and locally computed expected results.
//
// Inputs are small integers (-2..2, or 0..4 for uint8), so sums and products over up to 8 ranks
// are exact in every float type and the reference is independent of reduction order; an average
// is one division of the exact sum, rounded once, as the engine does.
#pragma once

#include <stdlib.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/file_store.h"
#include "comm/reduce_kernels.h"
#include "ddp/ring_process_group.h"

namespace ddp::test {

inline std::shared_ptr<ProcessGroup> make_group(const std::filesystem::path& dir, int rank,
                                                int size, RingOptions options = {}) {
  if (options.timeout.count() == 0) options.timeout = std::chrono::seconds(30);
  if (options.advertise_host.empty()) options.advertise_host = "127.0.0.1";
  auto store = std::make_shared<FileStore>(dir);
  return make_ring_process_group(store, rank, size, std::move(options));
}

// How the engine suites run a group: TCP only; auto on one host (shared memory); auto with the
// ranks split over two pretend hosts (DDP_HOST_ID) so that allreduce runs hierarchically, with
// equal halves (slices) or one rank alone on the first host (leaders only).
enum class Mode { kTcp, kShm, kHierEqual, kHierUneven };

inline std::string mode_name(Mode m) {
  switch (m) {
    case Mode::kTcp:
      return "tcp";
    case Mode::kShm:
      return "shm";
    case Mode::kHierEqual:
      return "hier_equal";
    case Mode::kHierUneven:
      return "hier_uneven";
  }
  return "?";
}

// Call in the rank process before creating its group: sets the transport and the pretend host.
inline RingOptions apply_mode(Mode m, int rank, int size, RingOptions options = {}) {
  options.transport = m == Mode::kTcp ? Transport::kTcp : Transport::kAuto;
  // 4 KiB chunks (the smallest the domain takes), so that the larger counts of the suites stream
  // through the segment in many chunks, as multi-MiB messages do with the default.
  if (m != Mode::kTcp && options.shm_slot_bytes == 0) options.shm_slot_bytes = 4096;
  if (m == Mode::kHierEqual) {
    ::setenv("DDP_HOST_ID", fmt::format("host{}", rank < (size + 1) / 2 ? 0 : 1).c_str(), 1);
  } else if (m == Mode::kHierUneven) {
    ::setenv("DDP_HOST_ID", rank == 0 ? "hostA" : "hostB", 1);
  } else {
    ::unsetenv("DDP_HOST_ID");
  }
  return options;
}

// What ring_transport_of must say for a group made under `m`.
inline bool transport_matches(Mode m, int size, const std::string& got) {
  if (size == 1) return got.rfind("none", 0) == 0;
  switch (m) {
    case Mode::kTcp:
      return got.rfind("tcp", 0) == 0;
    case Mode::kShm:
      return got == "shm";
    case Mode::kHierEqual:
      return size == 2 ? got.rfind("tcp", 0) == 0 : got.rfind("hierarchical(2 hosts", 0) == 0;
    case Mode::kHierUneven:
      return size == 2 ? got.rfind("tcp", 0) == 0
                       : got.find("leaders") != std::string::npos ||
                             (size % 2 == 0 && got.find("slices") != std::string::npos);
  }
  return false;
}

inline void expect_transport(Mode m, const ProcessGroup& pg) {
  const std::string got = ring_transport_of(pg);
  if (!transport_matches(m, pg.size(), got)) {
    throw std::runtime_error(fmt::format("mode {} with {} ranks made a group with transport '{}'",
                                         mode_name(m), pg.size(), got));
  }
}

inline const DType kAllDTypes[] = {DType::kFloat32,  DType::kFloat64, DType::kFloat16,
                                   DType::kBFloat16, DType::kInt8,    DType::kUInt8,
                                   DType::kInt32,    DType::kInt64};
inline const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                   ReduceOp::kProduct};

// The input value of element i on `rank` (salt varies it between calls).
inline long long input_value(DType dtype, int rank, std::size_t i, int salt) {
  const long long v = static_cast<long long>((static_cast<std::size_t>(rank) * 7 + i * 3 +
                                              static_cast<std::size_t>(salt) * 11 + 1) %
                                             5) -
                      2;
  return dtype == DType::kUInt8 ? v + 2 : v;
}

inline void store_value(DType dtype, std::byte* p, double value) {
  switch (dtype) {
    case DType::kFloat32: {
      const auto v = static_cast<float>(value);
      std::memcpy(p, &v, 4);
      return;
    }
    case DType::kFloat64:
      std::memcpy(p, &value, 8);
      return;
    case DType::kFloat16: {
      const auto v = comm::float_to_half(static_cast<float>(value));
      std::memcpy(p, &v, 2);
      return;
    }
    case DType::kBFloat16: {
      const auto v = comm::float_to_bfloat16(static_cast<float>(value));
      std::memcpy(p, &v, 2);
      return;
    }
    case DType::kInt8: {
      const auto v = static_cast<std::int8_t>(static_cast<long long>(value));
      std::memcpy(p, &v, 1);
      return;
    }
    case DType::kUInt8: {
      const auto v = static_cast<std::uint8_t>(static_cast<long long>(value));
      std::memcpy(p, &v, 1);
      return;
    }
    case DType::kInt32: {
      const auto v = static_cast<std::int32_t>(static_cast<long long>(value));
      std::memcpy(p, &v, 4);
      return;
    }
    case DType::kInt64: {
      const auto v = static_cast<std::int64_t>(value);
      std::memcpy(p, &v, 8);
      return;
    }
  }
}

inline std::vector<std::byte> make_input(DType dtype, std::size_t count, int rank, int salt) {
  const std::size_t esz = dtype_size(dtype);
  std::vector<std::byte> buf(count * esz);
  for (std::size_t i = 0; i < count; ++i) {
    store_value(dtype, buf.data() + i * esz,
                static_cast<double>(input_value(dtype, rank, i, salt)));
  }
  return buf;
}

inline bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat64 || d == DType::kFloat16 ||
         d == DType::kBFloat16;
}

// Element-wise reduction over ranks 0..size-1 of make_input(...).
inline std::vector<std::byte> expected_reduction(DType dtype, ReduceOp op, std::size_t count,
                                                 int size, int salt) {
  const std::size_t esz = dtype_size(dtype);
  std::vector<std::byte> out(count * esz);
  for (std::size_t i = 0; i < count; ++i) {
    // Floats reduce in double (exact here, and keeps the sign of -2 * 0 = -0), integers in int64.
    double facc = static_cast<double>(input_value(dtype, 0, i, salt));
    long long acc = input_value(dtype, 0, i, salt);
    for (int r = 1; r < size; ++r) {
      const long long v = input_value(dtype, r, i, salt);
      const double fv = static_cast<double>(v);
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          acc += v;
          facc += fv;
          break;
        case ReduceOp::kMin:
          acc = std::min(acc, v);
          facc = std::min(facc, fv);
          break;
        case ReduceOp::kMax:
          acc = std::max(acc, v);
          facc = std::max(facc, fv);
          break;
        case ReduceOp::kProduct:
          acc *= v;
          facc *= fv;
          break;
      }
    }
    std::byte* p = out.data() + i * esz;
    if (is_float(dtype)) {
      if (op != ReduceOp::kAvg) {
        store_value(dtype, p, facc);
      } else if (dtype == DType::kFloat64) {
        store_value(dtype, p, facc / size);
      } else {
        // One float32 division, then one rounding to the storage type (as the engine does).
        store_value(dtype, p,
                    static_cast<double>(static_cast<float>(facc) / static_cast<float>(size)));
      }
    } else {
      store_value(dtype, p, static_cast<double>(op == ReduceOp::kAvg ? acc / size : acc));
    }
  }
  return out;
}

// Throws naming the first differing element.
inline void expect_bytes(const std::vector<std::byte>& got, const std::vector<std::byte>& want,
                         DType dtype, const std::string& what) {
  if (got.size() != want.size()) {
    throw std::runtime_error(fmt::format("{}: size {} != {}", what, got.size(), want.size()));
  }
  const std::size_t esz = dtype_size(dtype);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      std::uint64_t g = 0, w = 0;
      std::memcpy(&g, got.data() + (i / esz) * esz, esz);
      std::memcpy(&w, want.data() + (i / esz) * esz, esz);
      throw std::runtime_error(fmt::format("{}: element {} of {} is {:#x}, expected {:#x}", what,
                                           i / esz, got.size() / esz, g, w));
    }
  }
}

}  // namespace ddp::test
