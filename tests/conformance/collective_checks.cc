#include "conformance/collective_checks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/reduce_kernels.h"
#include "ddp/error.h"
#include "support/reference_values.h"

namespace ddp::conformance {
namespace {

using Bytes = std::vector<std::byte>;

constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                                DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                ReduceOp::kBor, ReduceOp::kBxor};
constexpr std::byte kFill{0x5a};  // what output buffers hold before an operation

using test::expected_reduction;
using test::input_value;
using test::is_float;
using test::make_input;
using test::store_value;

Bytes slice(const Bytes& b, std::size_t offset, std::size_t bytes) {
  return Bytes(b.begin() + static_cast<std::ptrdiff_t>(offset),
               b.begin() + static_cast<std::ptrdiff_t>(offset + bytes));
}

// `what` names the case; throws naming the first differing element.
void expect_equal(const ProcessGroup& pg, const Bytes& got, const Bytes& want, DType dtype,
                  const std::string& what) {
  if (got.size() != want.size()) {
    throw std::runtime_error(fmt::format("{}: {} bytes, expected {} (rank {} of {})", what,
                                         got.size(), want.size(), pg.rank(), pg.size()));
  }
  const std::size_t esz = dtype_size(dtype);
  for (std::size_t i = 0; i < got.size(); i += esz) {
    if (std::memcmp(got.data() + i, want.data() + i, esz) != 0) {
      std::uint64_t g = 0;
      std::uint64_t w = 0;
      std::memcpy(&g, got.data() + i, esz);
      std::memcpy(&w, want.data() + i, esz);
      throw std::runtime_error(fmt::format(
          "{}: first wrong index {} of {}: got bits {:#x}, expected {:#x} (rank {} of {})", what,
          i / esz, got.size() / esz, g, w, pg.rank(), pg.size()));
    }
  }
}

std::string label(std::string_view check, DType dtype, std::size_t count, std::string_view extra) {
  return fmt::format("{}: dtype {}, count {}{}{}", check, to_string(dtype), count,
                     extra.empty() ? "" : ", ", extra);
}
std::string label(std::string_view check, DType dtype, ReduceOp op, std::size_t count,
                  std::string_view extra) {
  return fmt::format("{}: dtype {}, op {}, count {}{}{}", check, to_string(dtype), to_string(op),
                     count, extra.empty() ? "" : ", ", extra);
}

// 0, 1, fewer than ranks, a prime, not divisible by the group size, a larger prime.
std::vector<std::size_t> counts_for(int size, bool large) {
  std::vector<std::size_t> counts{0, 1, static_cast<std::size_t>(std::max(size - 1, 0)), 13,
                                  static_cast<std::size_t>(3 * size + 1)};
  if (large) counts.push_back(1009);
  std::sort(counts.begin(), counts.end());
  counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
  return counts;
}

template <class F>
void expect_config_error(const std::string& what, F&& call) {
  try {
    call();
  } catch (const ConfigError&) {
    return;
  } catch (const std::exception& e) {
    throw std::runtime_error(
        fmt::format("argument_errors: {} threw '{}', expected a ddp::ConfigError", what, e.what()));
  }
  throw std::runtime_error(
      fmt::format("argument_errors: {} did not throw; expected a ddp::ConfigError", what));
}

void allreduce_cases(ProcessGroup& pg, const std::vector<std::size_t>& counts, int salt_base,
                     const char* check) {
  int salt = salt_base;
  for (std::size_t count : counts) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        if (!test::reduces(dtype, op)) continue;
        ++salt;
        const Bytes input = make_input(dtype, count, pg.rank(), salt);
        const Bytes want = expected_reduction(dtype, op, count, pg.size(), salt);
        if (salt % 2 == 0) {
          Bytes buf = input;
          pg.allreduce(buf.data(), count, dtype, op)->wait();
          expect_equal(pg, buf, want, dtype, label(check, dtype, op, count, "in place"));
        } else {
          Bytes out(input.size(), kFill);
          pg.allreduce(input.data(), out.data(), count, dtype, op)->wait();
          expect_equal(pg, out, want, dtype, label(check, dtype, op, count, "out of place"));
          expect_equal(pg, input, make_input(dtype, count, pg.rank(), salt), dtype,
                       label(check, dtype, op, count, "send buffer unchanged"));
        }
      }
    }
  }
}

}  // namespace

void check_allreduce(ProcessGroup& pg) {
  allreduce_cases(pg, counts_for(pg.size(), true), 0, "allreduce");
  // Larger than the ring backend's small-message switch (64 KiB) for the common types.
  int salt = 500;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      const std::size_t count = 70001;
      ++salt;
      Bytes buf = make_input(dtype, count, pg.rank(), salt);
      pg.allreduce(buf.data(), count, dtype, op)->wait();
      expect_equal(pg, buf, expected_reduction(dtype, op, count, pg.size(), salt), dtype,
                   label("allreduce", dtype, op, count, "in place, large"));
    }
  }
}

void check_allreduce_segments(ProcessGroup& pg) {
  // Piece lengths, empty pieces included; the last layout spans several 1 MiB chunks of the
  // shared-memory path with pieces that cross chunk boundaries.
  const std::vector<std::vector<std::size_t>> layouts{{},
                                                      {0},
                                                      {1},
                                                      {5, 0, 8},
                                                      {static_cast<std::size_t>(3 * pg.size() + 1)},
                                                      {1000, 1, 0, 7000, 3},
                                                      {100'000, 1, 200'001, 0, 70'000}};
  int salt = 3000;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kInt32, DType::kFloat64}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (std::size_t l = 0; l < layouts.size(); ++l) {
        if (l + 1 == layouts.size() && dtype != DType::kFloat32) continue;  // large: one dtype
        const auto& layout = layouts[l];
        std::size_t count = 0;
        for (auto n : layout)
          count += n;
        ++salt;
        const Bytes input = make_input(dtype, count, pg.rank(), salt);
        const Bytes want = expected_reduction(dtype, op, count, pg.size(), salt);
        const std::string what =
            label("allreduce_segments", dtype, op, count, fmt::format("pieces {}", l));
        if (pg.rank() % 2 == 1) {
          // The same collective as a plain allreduce of the total: odd ranks issue that.
          Bytes buf = input;
          pg.allreduce(buf.data(), count, dtype, op)->wait();
          expect_equal(pg, buf, want, dtype, what + " (plain allreduce on this rank)");
          continue;
        }
        const std::size_t esz = dtype_size(dtype);
        std::vector<Bytes> pieces;
        std::vector<BufferSegment> segments;
        std::size_t at = 0;
        for (auto n : layout) {
          pieces.push_back(slice(input, at * esz, n * esz));
          at += n;
        }
        for (auto& piece : pieces)
          segments.push_back({piece.empty() ? nullptr : piece.data(), piece.size() / esz});
        pg.allreduce_segments(segments, dtype, op)->wait();
        Bytes got;
        for (const auto& piece : pieces)
          got.insert(got.end(), piece.begin(), piece.end());
        expect_equal(pg, got, want, dtype, what);
      }
    }
  }
  float x[4] = {};
  expect_config_error("allreduce_segments with a null piece of 4 elements", [&] {
    pg.allreduce_segments({{x, 4}, {nullptr, 4}}, DType::kFloat32, ReduceOp::kSum);
  });
  expect_config_error("allreduce_segments with an invalid DType value", [&] {
    pg.allreduce_segments({{x, 4}}, static_cast<DType>(99), ReduceOp::kSum);
  });
}

void check_broadcast(ProcessGroup& pg) {
  int salt = 1000;
  for (std::size_t count : counts_for(pg.size(), true)) {
    for (DType dtype : kAllDTypes) {
      for (int root = 0; root < pg.size(); ++root) {
        ++salt;
        const Bytes want = make_input(dtype, count, root, salt);
        Bytes buf = pg.rank() == root ? want : Bytes(want.size(), kFill);
        pg.broadcast(buf.data(), count, dtype, root)->wait();
        expect_equal(pg, buf, want, dtype,
                     label("broadcast", dtype, count, fmt::format("root {}", root)));
      }
    }
  }
}

void check_reduce(ProcessGroup& pg) {
  int salt = 2000;
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{13},
                            static_cast<std::size_t>(3 * pg.size() + 1)}) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        if (!test::reduces(dtype, op)) continue;
        for (int root = 0; root < pg.size(); ++root) {
          ++salt;
          const bool in_place = salt % 2 == 0;
          const std::string extra =
              fmt::format("root {}, {}", root, in_place ? "in place" : "out of place");
          const Bytes input = make_input(dtype, count, pg.rank(), salt);
          Bytes buf = input;
          Bytes out(input.size(), kFill);
          if (in_place && pg.rank() == root) {
            pg.reduce(buf.data(), buf.data(), count, dtype, op, root)->wait();
            out = buf;
          } else {
            // Off the root the receive buffer is unused: null on odd salts, untouched otherwise.
            void* recv = pg.rank() != root && salt % 3 == 0 ? nullptr : out.data();
            pg.reduce(input.data(), recv, count, dtype, op, root)->wait();
          }
          if (pg.rank() == root) {
            expect_equal(pg, out, expected_reduction(dtype, op, count, pg.size(), salt), dtype,
                         label("reduce", dtype, op, count, extra));
          } else {
            expect_equal(
                pg, out, Bytes(out.size(), kFill), dtype,
                label("reduce", dtype, op, count, extra + ", recv off the root untouched"));
          }
        }
      }
    }
  }
}

void check_allgather(ProcessGroup& pg) {
  int salt = 3000;
  const auto n = static_cast<std::size_t>(pg.size());
  for (std::size_t count : counts_for(pg.size(), true)) {
    for (DType dtype : kAllDTypes) {
      ++salt;
      const std::size_t block = count * dtype_size(dtype);
      Bytes want;
      for (int r = 0; r < pg.size(); ++r) {
        const Bytes b = make_input(dtype, count, r, salt);
        want.insert(want.end(), b.begin(), b.end());
      }
      const Bytes input = make_input(dtype, count, pg.rank(), salt);
      Bytes out(n * block, kFill);
      pg.allgather(input.data(), out.data(), count, dtype)->wait();
      expect_equal(pg, out, want, dtype, label("allgather", dtype, count, "out of place"));
      // In place: the input already sits in this rank's block of the output.
      Bytes buf(n * block, kFill);
      std::copy(
          input.begin(), input.end(),
          buf.begin() + static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(pg.rank())));
      pg.allgather(buf.data() + block * static_cast<std::size_t>(pg.rank()), buf.data(), count,
                   dtype)
          ->wait();
      expect_equal(pg, buf, want, dtype, label("allgather", dtype, count, "in place"));
    }
  }
}

void check_gather(ProcessGroup& pg) {
  int salt = 4000;
  const auto n = static_cast<std::size_t>(pg.size());
  for (std::size_t count : counts_for(pg.size(), false)) {
    for (DType dtype : kAllDTypes) {
      for (int root = 0; root < pg.size(); ++root) {
        ++salt;
        const std::size_t block = count * dtype_size(dtype);
        const Bytes input = make_input(dtype, count, pg.rank(), salt);
        Bytes out(pg.rank() == root ? n * block : 0, kFill);
        pg.gather(input.data(), pg.rank() == root ? out.data() : nullptr, count, dtype, root)
            ->wait();
        if (pg.rank() != root) continue;
        Bytes want;
        for (int r = 0; r < pg.size(); ++r) {
          const Bytes b = make_input(dtype, count, r, salt);
          want.insert(want.end(), b.begin(), b.end());
        }
        expect_equal(pg, out, want, dtype,
                     label("gather", dtype, count, fmt::format("root {}", root)));
      }
    }
  }
}

void check_scatter(ProcessGroup& pg) {
  int salt = 5000;
  for (std::size_t count : counts_for(pg.size(), false)) {
    for (DType dtype : kAllDTypes) {
      for (int root = 0; root < pg.size(); ++root) {
        ++salt;
        Bytes send;
        if (pg.rank() == root) {
          for (int r = 0; r < pg.size(); ++r) {
            const Bytes b = make_input(dtype, count, r, salt);
            send.insert(send.end(), b.begin(), b.end());
          }
        }
        Bytes out(count * dtype_size(dtype), kFill);
        pg.scatter(pg.rank() == root ? send.data() : nullptr, out.data(), count, dtype, root)
            ->wait();
        expect_equal(pg, out, make_input(dtype, count, pg.rank(), salt), dtype,
                     label("scatter", dtype, count, fmt::format("root {}", root)));
      }
    }
  }
}

void check_reduce_scatter(ProcessGroup& pg) {
  int salt = 6000;
  const auto n = static_cast<std::size_t>(pg.size());
  for (std::size_t count : counts_for(pg.size(), true)) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        if (!test::reduces(dtype, op)) continue;
        ++salt;
        const std::size_t block = count * dtype_size(dtype);
        const Bytes input = make_input(dtype, n * count, pg.rank(), salt);
        const Bytes want = slice(expected_reduction(dtype, op, n * count, pg.size(), salt),
                                 block * static_cast<std::size_t>(pg.rank()), block);
        // Out of place only: whether send == recv is allowed here is not in the contract.
        Bytes out(block, kFill);
        pg.reduce_scatter(input.data(), out.data(), count, dtype, op)->wait();
        expect_equal(pg, out, want, dtype, label("reduce_scatter", dtype, op, count, ""));
      }
    }
  }
}

void check_alltoall(ProcessGroup& pg) {
  int salt = 7000;
  const int n = pg.size();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t count : counts_for(n, true)) {
    for (DType dtype : kAllDTypes) {
      for (bool in_place : {false, true}) {
        ++salt;
        // Block j of rank r's input is "who" = r * n + j.
        Bytes input;
        Bytes want;
        for (int j = 0; j < n; ++j) {
          const Bytes b = make_input(dtype, count, pg.rank() * n + j, salt);
          input.insert(input.end(), b.begin(), b.end());
          const Bytes w = make_input(dtype, count, j * n + pg.rank(), salt);
          want.insert(want.end(), w.begin(), w.end());
        }
        Bytes out = in_place ? input : Bytes(un * count * dtype_size(dtype), kFill);
        pg.alltoall(in_place ? out.data() : input.data(), out.data(), count, dtype)->wait();
        expect_equal(pg, out, want, dtype,
                     label("alltoall", dtype, count, in_place ? "in place" : "out of place"));
      }
    }
  }
}

// Per-rank counts of the uneven collectives: some zero, all different, all zero, all equal (the
// equal-size path), and one large block among small ones.
std::vector<std::vector<std::size_t>> uneven_patterns(int size) {
  const auto n = static_cast<std::size_t>(size);
  std::vector<std::vector<std::size_t>> patterns(5, std::vector<std::size_t>(n));
  for (std::size_t r = 0; r < n; ++r) {
    patterns[0][r] = r % 3;
    patterns[1][r] = r + 1;
    patterns[2][r] = 0;
    patterns[3][r] = 5;
    patterns[4][r] = r == n - 1 ? 1009 : 2;
  }
  return patterns;
}

std::size_t sum_of(const std::vector<std::size_t>& counts, std::size_t first = 0,
                   std::size_t last = std::size_t(-1)) {
  std::size_t total = 0;
  for (std::size_t i = first; i < std::min(last, counts.size()); ++i)
    total += counts[i];
  return total;
}

void check_allgather_v(ProcessGroup& pg) {
  int salt = 8000;
  const auto me = static_cast<std::size_t>(pg.rank());
  for (const auto& counts : uneven_patterns(pg.size())) {
    for (DType dtype : kAllDTypes) {
      ++salt;
      const Bytes input = make_input(dtype, counts[me], pg.rank(), salt);
      Bytes want;
      for (int r = 0; r < pg.size(); ++r) {
        const Bytes b = make_input(dtype, counts[static_cast<std::size_t>(r)], r, salt);
        want.insert(want.end(), b.begin(), b.end());
      }
      Bytes out(sum_of(counts) * dtype_size(dtype), kFill);
      pg.allgather_v(input.data(), counts[me], out.data(), counts, dtype)->wait();
      expect_equal(pg, out, want, dtype,
                   label("allgather_v", dtype, sum_of(counts),
                         fmt::format("counts {}", fmt::join(counts, ","))));
    }
  }
}

void check_alltoall_v(ProcessGroup& pg) {
  int salt = 8500;
  const int n = pg.size();
  const auto un = static_cast<std::size_t>(n);
  // What rank r sends to rank j, for three patterns (with zeros, all different, one large).
  const std::function<std::size_t(int, int)> patterns[] = {
      [](int r, int j) { return static_cast<std::size_t>((r + 2 * j) % 4); },
      [n](int r, int j) { return static_cast<std::size_t>(r * n + j + 1); },
      [n](int r, int j) { return r == n - 1 && j == 0 ? std::size_t{1009} : std::size_t{1}; },
      [](int, int) { return std::size_t{3}; }};
  for (const auto& sends : patterns) {
    for (DType dtype : kAllDTypes) {
      ++salt;
      std::vector<std::size_t> send_counts(un);
      std::vector<std::size_t> recv_counts(un);
      Bytes input;
      Bytes want;
      for (int j = 0; j < n; ++j) {
        send_counts[static_cast<std::size_t>(j)] = sends(pg.rank(), j);
        recv_counts[static_cast<std::size_t>(j)] = sends(j, pg.rank());
        const Bytes b = make_input(dtype, sends(pg.rank(), j), pg.rank() * n + j, salt);
        input.insert(input.end(), b.begin(), b.end());
        const Bytes w = make_input(dtype, sends(j, pg.rank()), j * n + pg.rank(), salt);
        want.insert(want.end(), w.begin(), w.end());
      }
      Bytes out(sum_of(recv_counts) * dtype_size(dtype), kFill);
      pg.alltoall_v(input.data(), send_counts, out.data(), recv_counts, dtype)->wait();
      expect_equal(pg, out, want, dtype,
                   label("alltoall_v", dtype, sum_of(recv_counts),
                         fmt::format("send_counts {}", fmt::join(send_counts, ","))));
    }
  }
}

void check_reduce_scatter_v(ProcessGroup& pg) {
  int salt = 9000;
  const auto me = static_cast<std::size_t>(pg.rank());
  for (const auto& counts : uneven_patterns(pg.size())) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        if (!test::reduces(dtype, op)) continue;
        ++salt;
        const std::size_t esz = dtype_size(dtype);
        const std::size_t total = sum_of(counts);
        const Bytes input = make_input(dtype, total, pg.rank(), salt);
        const Bytes want = slice(expected_reduction(dtype, op, total, pg.size(), salt),
                                 sum_of(counts, 0, me) * esz, counts[me] * esz);
        Bytes out(counts[me] * esz, kFill);
        pg.reduce_scatter_v(input.data(), out.data(), counts, dtype, op)->wait();
        expect_equal(pg, out, want, dtype,
                     label("reduce_scatter_v", dtype, op, total,
                           fmt::format("counts {}", fmt::join(counts, ","))));
      }
    }
  }
}

// Counts that differ between ranks: a ConfigError from the call on every rank (each rank reaches
// the same verdict from the exchanged counts), and the group goes on working.
void check_uneven_mismatch(ProcessGroup& pg) {
  if (pg.size() < 2) return;
  const auto un = static_cast<std::size_t>(pg.size());
  const auto me = static_cast<std::size_t>(pg.rank());
  auto expect_mismatch = [&](const char* what, auto&& call) {
    try {
      call();
    } catch (const ConfigError& e) {
      if (std::string_view(e.what()).find(what) == std::string_view::npos) {
        throw std::runtime_error(
            fmt::format("uneven_mismatch: {}: the error does not name the "
                        "operation: {} (rank {})",
                        what, e.what(), pg.rank()));
      }
      return;
    }
    throw std::runtime_error(fmt::format(
        "uneven_mismatch: {} with counts that differ across ranks did not throw a ConfigError "
        "(rank {})",
        what, pg.rank()));
  };
  // allgather_v: rank 1 believes rank 0 sends one element more than it does.
  std::vector<std::size_t> counts(un, 2);
  if (me == 1) counts[0] = 3;
  std::vector<float> in(4, 1.0F);
  std::vector<float> out(4 * un, 0.0F);
  expect_mismatch("allgather_v", [&] {
    pg.allgather_v(in.data(), 2, out.data(), counts, DType::kFloat32)->wait();
  });
  // alltoall_v: rank 1 expects 3 elements from rank 0, which sends 2.
  std::vector<std::size_t> sends(un, 2);
  std::vector<std::size_t> recvs(un, 2);
  if (me == 1) recvs[0] = 3;
  std::vector<float> a2a_in(2 * un, 1.0F);
  std::vector<float> a2a_out(2 * un + 1, 0.0F);
  expect_mismatch("alltoall_v", [&] {
    pg.alltoall_v(a2a_in.data(), sends, a2a_out.data(), recvs, DType::kFloat32)->wait();
  });
  // reduce_scatter_v: the last rank passes other counts.
  std::vector<std::size_t> rs(un, 1);
  if (me == un - 1) rs[0] = 2;
  std::vector<float> rs_in(un + 1, 1.0F);
  std::vector<float> rs_out(2, 0.0F);
  expect_mismatch("reduce_scatter_v", [&] {
    pg.reduce_scatter_v(rs_in.data(), rs_out.data(), rs, DType::kFloat32, ReduceOp::kSum)->wait();
  });
  // Still in step: a plain collective gives the right answer.
  float x = 1.0F;
  pg.allreduce(&x, 1, DType::kFloat32, ReduceOp::kSum)->wait();
  if (x != static_cast<float>(pg.size())) {
    throw std::runtime_error(fmt::format(
        "uneven_mismatch: the allreduce after the refused calls gave {} (rank {})", x, pg.rank()));
  }
}

void check_barrier(ProcessGroup& pg) {
  for (int i = 0; i < 5; ++i)
    pg.barrier()->wait();
  // Barriers queued behind each other and behind a collective complete in order.
  std::vector<std::shared_ptr<Work>> works;
  Bytes buf = make_input(DType::kInt32, 5, pg.rank(), 8000);
  works.push_back(pg.barrier());
  works.push_back(pg.allreduce(buf.data(), 5, DType::kInt32, ReduceOp::kSum));
  works.push_back(pg.barrier());
  for (auto& w : works)
    w->wait();
  expect_equal(pg, buf, expected_reduction(DType::kInt32, ReduceOp::kSum, 5, pg.size(), 8000),
               DType::kInt32, "barrier: allreduce between barriers");
}

void check_blocking_calls(ProcessGroup& pg) {
  const CallOptions blocking{.blocking = true};
  auto expect_done = [&](const std::shared_ptr<Work>& work, const std::string& what) {
    if (!work || !work->is_completed() || work->error()) {
      throw std::runtime_error(
          fmt::format("{}: a blocking call returned a Work that is not "
                      "completed successfully (rank {} of {})",
                      what, pg.rank(), pg.size()));
    }
  };
  int salt = 12000;
  // Every dtype and op, at counts around OpenMPI's 4 KiB eager limit (float32: 1008 elements and
  // the in-band fingerprint fit it, 1024 do not), in several pieces (up to 9000: 9 pieces at world
  // 2) and past the small allreduce.
  for (std::size_t count :
       {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1008}, std::size_t{1024},
        std::size_t{2100}, std::size_t{5000}, std::size_t{9000}}) {
    for (DType dtype : kAllDTypes) {
      for (ReduceOp op : kAllOps) {
        if (!test::reduces(dtype, op)) continue;
        if (count > 7 && dtype != DType::kFloat32 && dtype != DType::kInt64) continue;
        ++salt;
        const Bytes input = make_input(dtype, count, pg.rank(), salt);
        Bytes out(input.size(), kFill);
        const std::string what = label("blocking_calls", dtype, op, count, "allreduce");
        expect_done(pg.allreduce(input.data(), out.data(), count, dtype, op, blocking), what);
        expect_equal(pg, out, expected_reduction(dtype, op, count, pg.size(), salt), dtype, what);
      }
    }
  }
  // The other collectives, blocking.
  {
    const std::size_t count = 13;
    const DType dtype = DType::kInt32;
    const auto n = static_cast<std::size_t>(pg.size());
    Bytes buf = make_input(dtype, count, pg.rank() == 0 ? 0 : pg.rank() + 1, ++salt);
    expect_done(pg.broadcast(buf.data(), count, dtype, 0, blocking), "blocking broadcast");
    expect_equal(pg, buf, make_input(dtype, count, 0, salt), dtype, "blocking_calls: broadcast");
    const Bytes mine = make_input(dtype, count, pg.rank(), ++salt);
    Bytes all(mine.size() * n, kFill);
    expect_done(pg.allgather(mine.data(), all.data(), count, dtype, blocking),
                "blocking allgather");
    for (int r = 0; r < pg.size(); ++r) {
      expect_equal(pg, slice(all, static_cast<std::size_t>(r) * mine.size(), mine.size()),
                   make_input(dtype, count, r, salt), dtype, "blocking_calls: allgather");
    }
    expect_done(pg.barrier(blocking), "blocking barrier");
  }
  // A blocking call behind queued ones: it runs after them, in issue order, and every rank may
  // make the same collective blocking or not.
  {
    const std::size_t count = 9;
    std::vector<Bytes> bufs;
    std::vector<std::shared_ptr<Work>> queued;
    std::vector<int> salts;
    for (int i = 0; i < 4; ++i) {
      salts.push_back(++salt);
      bufs.push_back(make_input(DType::kFloat32, count, pg.rank(), salts.back()));
    }
    for (int i = 0; i < 3; ++i) {
      queued.push_back(pg.allreduce(bufs[static_cast<std::size_t>(i)].data(), count,
                                    DType::kFloat32, ReduceOp::kSum));
    }
    const bool this_rank_blocks = pg.rank() % 2 == 0;
    auto last = pg.allreduce(bufs[3].data(), count, DType::kFloat32, ReduceOp::kSum,
                             CallOptions{.blocking = this_rank_blocks});
    if (this_rank_blocks) {
      expect_done(last, "blocking allreduce behind queued ones");
      for (const auto& w : queued) {
        if (!w->is_completed()) {
          throw std::runtime_error(fmt::format(
              "blocking_calls: a blocking call returned before the operations queued before it "
              "completed (rank {} of {})",
              pg.rank(), pg.size()));
        }
      }
    }
    last->wait();
    for (const auto& w : queued)
      w->wait();
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      expect_equal(pg, bufs[i],
                   expected_reduction(DType::kFloat32, ReduceOp::kSum, count, pg.size(), salts[i]),
                   DType::kFloat32, "blocking_calls: behind queued calls");
    }
  }
  // Sums that round: every rank must end with the same bits (the reduction order may differ
  // from one backend or size to another, never from one rank to another).
  for (std::size_t count :
       {std::size_t{5}, std::size_t{700}, std::size_t{1008}, std::size_t{3000}}) {
    std::vector<float> values(count);
    for (std::size_t i = 0; i < count; ++i)
      values[i] = static_cast<float>(std::sin(static_cast<double>(pg.rank() * 7919 + i)) * 1e3);
    pg.allreduce(values.data(), count, DType::kFloat32, ReduceOp::kSum, blocking);
    std::vector<float> everyone(count * static_cast<std::size_t>(pg.size()));
    pg.allgather(values.data(), everyone.data(), count, DType::kFloat32)->wait();
    for (int r = 0; r < pg.size(); ++r) {
      if (std::memcmp(everyone.data() + static_cast<std::size_t>(r) * count, values.data(),
                      count * sizeof(float)) != 0) {
        throw std::runtime_error(fmt::format(
            "blocking_calls: rank {} ended an allreduce of {} rounded float32 sums with other "
            "bits than rank {} (of {})",
            r, count, pg.rank(), pg.size()));
      }
    }
  }
  // The shared Work of blocking calls takes no result.
  auto work = pg.barrier(blocking);
  try {
    work->set_result(1);
  } catch (const ConfigError&) {
    return;
  }
  throw std::runtime_error("blocking_calls: set_result on a blocking call's Work did not throw");
}

void check_send_recv(ProcessGroup& pg) {
  const int n = pg.size();
  const int r = pg.rank();
  if (n == 1) return;
  int salt = 9000;
  // Rank 0 sends every dtype to every other rank; tags distinguish the dtypes.
  for (DType dtype : kAllDTypes) {
    ++salt;
    const int tag = 10 + static_cast<int>(dtype);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1009}}) {
      if (r == 0) {
        std::vector<std::shared_ptr<Work>> works;
        std::vector<Bytes> messages;
        for (int peer = 1; peer < n; ++peer)
          messages.push_back(make_input(dtype, count, peer, salt));
        for (int peer = 1; peer < n; ++peer) {
          const Bytes& m = messages[static_cast<std::size_t>(peer - 1)];
          works.push_back(pg.send(m.data(), count, dtype, peer, tag));
        }
        for (auto& w : works)
          w->wait();
      } else {
        Bytes out(count * dtype_size(dtype), kFill);
        pg.recv(out.data(), count, dtype, 0, tag)->wait();
        expect_equal(pg, out, make_input(dtype, count, r, salt), dtype,
                     label("send_recv", dtype, count, fmt::format("from rank 0, tag {}", tag)));
      }
    }
  }
  // Ring exchange: even ranks send first, odd ranks receive first, so that no rank waits on a
  // rank that waits on it whatever the transport buffers.
  {
    ++salt;
    const int next = (r + 1) % n;
    const int prev = (r + n - 1) % n;
    const std::size_t count = 4099;
    const Bytes mine = make_input(DType::kFloat32, count, r, salt);
    Bytes got(mine.size(), kFill);
    if (r % 2 == 0) {
      pg.send(mine.data(), count, DType::kFloat32, next, 3)->wait();
      pg.recv(got.data(), count, DType::kFloat32, prev, 3)->wait();
    } else {
      pg.recv(got.data(), count, DType::kFloat32, prev, 3)->wait();
      pg.send(mine.data(), count, DType::kFloat32, next, 3)->wait();
    }
    expect_equal(pg, got, make_input(DType::kFloat32, count, prev, salt), DType::kFloat32,
                 label("send_recv", DType::kFloat32, count, "ring exchange"));
  }
  // Several messages in flight from the last rank to rank 0: they match in issue order.
  {
    ++salt;
    const int last = n - 1;
    constexpr int kMessages = 8;
    if (r == last || r == 0) {
      std::vector<Bytes> bufs;
      std::vector<std::shared_ptr<Work>> works;
      for (int k = 0; k < kMessages; ++k) {
        const std::size_t count = 3 + static_cast<std::size_t>(k);
        bufs.push_back(r == last ? make_input(DType::kInt64, count, k, salt)
                                 : Bytes(count * 8, kFill));
      }
      for (int k = 0; k < kMessages; ++k) {
        const std::size_t count = 3 + static_cast<std::size_t>(k);
        auto& b = bufs[static_cast<std::size_t>(k)];
        works.push_back(r == last ? pg.send(b.data(), count, DType::kInt64, 0, 5)
                                  : pg.recv(b.data(), count, DType::kInt64, last, 5));
      }
      for (auto& w : works)
        w->wait();
      if (r == 0) {
        for (int k = 0; k < kMessages; ++k) {
          const std::size_t count = 3 + static_cast<std::size_t>(k);
          expect_equal(pg, bufs[static_cast<std::size_t>(k)],
                       make_input(DType::kInt64, count, k, salt), DType::kInt64,
                       label("send_recv", DType::kInt64, count,
                             fmt::format("message {} of {} in flight", k, kMessages)));
        }
      }
    }
  }
  pg.barrier()->wait();
}

void check_many_in_flight(ProcessGroup& pg) {
  constexpr int kCalls = 64;
  constexpr std::size_t kCount = 257;
  std::vector<Bytes> bufs;
  std::vector<std::shared_ptr<Work>> works;
  // Shared: a callback may still run after wait() returned (and after a failed check threw).
  auto callbacks = std::make_shared<std::atomic<int>>(0);
  for (int k = 0; k < kCalls; ++k) {
    const DType dtype = kAllDTypes[static_cast<std::size_t>(k) % std::size(kAllDTypes)];
    bufs.push_back(make_input(dtype, kCount, pg.rank(), 10000 + k));
  }
  for (int k = 0; k < kCalls; ++k) {
    const DType dtype = kAllDTypes[static_cast<std::size_t>(k) % std::size(kAllDTypes)];
    auto& b = bufs[static_cast<std::size_t>(k)];
    // Mostly allreduces, every fourth a broadcast from a rotating root: the order must hold.
    works.push_back(k % 4 == 3 ? pg.broadcast(b.data(), kCount, dtype, k % pg.size())
                               : pg.allreduce(b.data(), kCount, dtype, ReduceOp::kSum));
    works.back()->then([callbacks](Work& w) {
      if (w.is_completed() && !w.error()) callbacks->fetch_add(1);
    });
  }
  for (auto& w : works)
    w->wait();
  for (int k = 0; k < kCalls; ++k) {
    const DType dtype = kAllDTypes[static_cast<std::size_t>(k) % std::size(kAllDTypes)];
    const Bytes want =
        k % 4 == 3 ? make_input(dtype, kCount, k % pg.size(), 10000 + k)
                   : expected_reduction(dtype, ReduceOp::kSum, kCount, pg.size(), 10000 + k);
    expect_equal(pg, bufs[static_cast<std::size_t>(k)], want, dtype,
                 label("many_in_flight", dtype, kCount, fmt::format("call {} of {}", k, kCalls)));
  }
  // Callbacks run before wait() returns is not promised; completion of all of them is, shortly.
  for (int polls = 0; callbacks->load() < kCalls && polls < 5000; ++polls) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (callbacks->load() != kCalls) {
    throw std::runtime_error(fmt::format("many_in_flight: {} of {} then() callbacks ran (rank {})",
                                         callbacks->load(), kCalls, pg.rank()));
  }
  bool ran_at_once = false;
  works.front()->then([&](Work&) { ran_at_once = true; });
  if (!ran_at_once) {
    throw std::runtime_error("many_in_flight: then() on a completed Work did not run at once");
  }
}

void check_subgroups(ProcessGroup& pg) {
  const int n = pg.size();
  const int r = pg.rank();
  auto members = [](std::vector<int> ranks) { return ranks; };
  // Everybody, renumbered identically.
  {
    std::vector<int> all(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i)
      all[static_cast<std::size_t>(i)] = i;
    auto sub = pg.new_group(all);
    if (!sub || sub->rank() != r || sub->size() != n) {
      throw std::runtime_error(fmt::format(
          "subgroups: new_group(all ranks) gave {} (rank {})",
          sub ? fmt::format("rank {} of {}", sub->rank(), sub->size()) : std::string("nullptr"),
          r));
    }
    allreduce_cases(*sub, {1, 13}, 11000, "subgroup(all) allreduce");
  }
  if (n < 2) return;
  // Without rank 0: ranks 1..n-1 become 0..n-2. The parent group keeps working meanwhile.
  std::vector<int> tail;
  for (int i = 1; i < n; ++i)
    tail.push_back(i);
  auto sub = pg.new_group(members(tail));
  Bytes parent_buf = make_input(DType::kFloat32, 31, r, 12000);
  auto parent_work = pg.allreduce(parent_buf.data(), 31, DType::kFloat32, ReduceOp::kMax);
  if (r == 0) {
    if (sub)
      throw std::runtime_error("subgroups: rank 0 is not in new_group(1..n-1) but got a group");
  } else {
    if (!sub || sub->rank() != r - 1 || sub->size() != n - 1) {
      throw std::runtime_error(
          fmt::format("subgroups: rank {} expected rank {} of {} in "
                      "new_group(1..n-1)",
                      r, r - 1, n - 1));
    }
    allreduce_cases(*sub, {0, 1, 13, static_cast<std::size_t>(n)}, 13000,
                    "subgroup(1..n-1) allreduce");
    const int root = sub->size() - 1;
    for (DType dtype : kAllDTypes) {
      const Bytes want = make_input(dtype, 17, root, 14000);
      Bytes buf = sub->rank() == root ? want : Bytes(want.size(), kFill);
      sub->broadcast(buf.data(), 17, dtype, root)->wait();
      expect_equal(*sub, buf, want, dtype,
                   label("subgroup(1..n-1) broadcast", dtype, 17, fmt::format("root {}", root)));
    }
    check_allgather(*sub);
  }
  parent_work->wait();
  expect_equal(pg, parent_buf, expected_reduction(DType::kFloat32, ReduceOp::kMax, 31, n, 12000),
               DType::kFloat32, "subgroups: parent allreduce issued alongside the subgroup's");
  // The first and the last rank.
  auto ends = pg.new_group({0, n - 1});
  if ((r == 0 || r == n - 1) != static_cast<bool>(ends)) {
    throw std::runtime_error(
        fmt::format("subgroups: rank {}: new_group(0, {}) membership wrong", r, n - 1));
  }
  if (ends) {
    allreduce_cases(*ends, {1, 7}, 15000, "subgroup(0, n-1) allreduce");
    if (ends->rank() != (r == 0 ? 0 : 1))
      throw std::runtime_error("subgroups: new_group(0, n-1) renumbering wrong");
  }
  pg.barrier()->wait();
}

void check_argument_errors(ProcessGroup& pg) {
  const int n = pg.size();
  float x[4] = {};
  expect_config_error("allreduce with a null buffer and count 4",
                      [&] { pg.allreduce(nullptr, 4, DType::kFloat32, ReduceOp::kSum); });
  expect_config_error("allreduce with a null recv buffer",
                      [&] { pg.allreduce(x, nullptr, 4, DType::kFloat32, ReduceOp::kSum); });
  expect_config_error("broadcast with root -1", [&] { pg.broadcast(x, 4, DType::kFloat32, -1); });
  expect_config_error("broadcast with root == size",
                      [&] { pg.broadcast(x, 4, DType::kFloat32, n); });
  expect_config_error("broadcast with a null buffer",
                      [&] { pg.broadcast(nullptr, 4, DType::kFloat32, 0); });
  expect_config_error("reduce with root == size",
                      [&] { pg.reduce(x, x, 4, DType::kFloat32, ReduceOp::kSum, n); });
  expect_config_error("gather with root -1", [&] { pg.gather(x, x, 1, DType::kFloat32, -1); });
  expect_config_error("scatter with root == size",
                      [&] { pg.scatter(x, x, 1, DType::kFloat32, n); });
  expect_config_error("allgather with a null send buffer",
                      [&] { pg.allgather(nullptr, x, 1, DType::kFloat32); });
  expect_config_error("alltoall with a null recv buffer",
                      [&] { pg.alltoall(x, nullptr, 1, DType::kFloat32); });
  expect_config_error("reduce_scatter with a null send buffer",
                      [&] { pg.reduce_scatter(nullptr, x, 1, DType::kFloat32, ReduceOp::kSum); });
  expect_config_error("send to this rank itself",
                      [&] { pg.send(x, 4, DType::kFloat32, pg.rank()); });
  expect_config_error("send to rank == size", [&] { pg.send(x, 4, DType::kFloat32, n); });
  expect_config_error("recv from rank -1", [&] { pg.recv(x, 4, DType::kFloat32, -1); });
  expect_config_error("an invalid DType value",
                      [&] { pg.allreduce(x, 4, static_cast<DType>(99), ReduceOp::kSum); });
  expect_config_error("an invalid ReduceOp value",
                      [&] { pg.allreduce(x, 4, DType::kFloat32, static_cast<ReduceOp>(99)); });
  // A bitwise reduction of floating-point values: refused, naming the op and the dtype.
  for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
    try {
      pg.allreduce(x, 4, DType::kFloat32, op);
      throw std::runtime_error(
          fmt::format("argument_errors: allreduce of float32 with {} did "
                      "not throw; expected a ddp::ConfigError",
                      to_string(op)));
    } catch (const ConfigError& e) {
      const std::string text = e.what();
      if (text.find(to_string(op)) == std::string::npos ||
          text.find("float32") == std::string::npos) {
        throw std::runtime_error(
            fmt::format("argument_errors: the error for a {} of float32 names neither: {}",
                        to_string(op), text));
      }
    }
  }
  expect_config_error("reduce_scatter of bfloat16 with bxor",
                      [&] { pg.reduce_scatter(x, x, 1, DType::kBFloat16, ReduceOp::kBxor); });
  expect_config_error("a negative CallOptions::timeout", [&] {
    pg.allreduce(x, 4, DType::kFloat32, ReduceOp::kSum, {.timeout = std::chrono::milliseconds(-1)});
  });
  expect_config_error("new_group with no ranks", [&] { pg.new_group({}); });
  expect_config_error("new_group with a rank == size", [&] { pg.new_group({n}); });
  expect_config_error("new_group with a duplicate rank", [&] { pg.new_group({0, 0}); });
  if (n >= 2) expect_config_error("new_group with unsorted ranks", [&] { pg.new_group({1, 0}); });
}

void check_mismatch_kinds(ProcessGroup& pg) {
  if (pg.size() < 2) return;
  const auto pair = pg.new_group({0, 1});
  std::int64_t kind = -1;  // this rank's CommErrorKind in the subgroup; -1: not a member
  if (pair) {
    std::vector<float> x(4, 1.0f);
    auto call = [&] {
      return pair->rank() == 0
                 ? pair->allreduce(x.data(), x.size(), DType::kFloat32, ReduceOp::kSum)
                 : pair->broadcast(x.data(), x.size(), DType::kFloat32, 0);
    };
    try {
      call()->wait();
      throw std::runtime_error(
          fmt::format("mismatch_kinds: rank {}'s mismatched call completed", pg.rank()));
    } catch (const CommError& e) {
      if (e.kind() != CommErrorKind::kMismatch && e.kind() != CommErrorKind::kAborted) {
        throw std::runtime_error(fmt::format(
            "mismatch_kinds: rank {} got a CommError of kind '{}', expected 'mismatch' or "
            "'aborted': {}",
            pg.rank(), to_string(e.kind()), e.what()));
      }
      kind = static_cast<std::int64_t>(e.kind());
      // Poisoned: the next call fails at once with the same error, so the same kind.
      try {
        pair->barrier()->wait();
        throw std::runtime_error("mismatch_kinds: a call on the poisoned subgroup completed");
      } catch (const CommError& again) {
        if (again.kind() != e.kind()) {
          throw std::runtime_error(
              fmt::format("mismatch_kinds: the poisoned subgroup's next call failed with kind "
                          "'{}', not the first error's '{}'",
                          to_string(again.kind()), to_string(e.kind())));
        }
      }
    }
  }
  // The parent group is unharmed: it tells every rank the members' kinds.
  std::vector<std::int64_t> kinds(static_cast<std::size_t>(pg.size()));
  pg.allgather(&kind, kinds.data(), 1, DType::kInt64)->wait();
  if (kinds[0] != static_cast<std::int64_t>(CommErrorKind::kMismatch) &&
      kinds[1] != static_cast<std::int64_t>(CommErrorKind::kMismatch)) {
    throw std::runtime_error(fmt::format(
        "mismatch_kinds: neither rank 0 nor rank 1 reported a mismatch (kinds {} and {})",
        to_string(static_cast<CommErrorKind>(kinds[0])),
        to_string(static_cast<CommErrorKind>(kinds[1]))));
  }
}

const std::vector<NamedCheck>& failure_checks() {
  static const std::vector<NamedCheck> checks{{"mismatch_kinds", check_mismatch_kinds}};
  return checks;
}

const std::vector<NamedCheck>& all_checks() {
  static const std::vector<NamedCheck> checks{
      {"argument_errors", check_argument_errors},
      {"allreduce", check_allreduce},
      {"allreduce_segments", check_allreduce_segments},
      {"broadcast", check_broadcast},
      {"reduce", check_reduce},
      {"allgather", check_allgather},
      {"gather", check_gather},
      {"scatter", check_scatter},
      {"reduce_scatter", check_reduce_scatter},
      {"alltoall", check_alltoall},
      {"allgather_v", check_allgather_v},
      {"alltoall_v", check_alltoall_v},
      {"reduce_scatter_v", check_reduce_scatter_v},
      {"uneven_mismatch", check_uneven_mismatch},
      {"barrier", check_barrier},
      {"blocking_calls", check_blocking_calls},
      {"send_recv", check_send_recv},
      {"many_in_flight", check_many_in_flight},
      {"subgroups", check_subgroups},
  };
  return checks;
}

void run_all_checks(ProcessGroup& pg) {
  for (const auto& check : all_checks()) {
    try {
      check.run(pg);
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("check {} failed on rank {} of {}: {}", check.name,
                                           pg.rank(), pg.size(), e.what()));
    }
  }
}

}  // namespace ddp::conformance
