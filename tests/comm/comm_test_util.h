// Helpers for the collective tests: a group per rank on a FileStore, the transports the suites
// run over, and byte comparisons. Inputs and expected results: support/reference_values.h.
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
#include "ddp/comm/ring_process_group.h"
#include "support/reference_values.h"

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
inline const ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                   ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                   ReduceOp::kBor, ReduceOp::kBxor};

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
