// ddp-bench: measures ddp's collectives, one process per rank, under any launcher (ddprun,
// torchrun's environment, mpirun, srun). See docs/benchmarks.md and bench_runner.h for what is
// measured. Exit codes: 0 success, 1 a failure while running, 2 bad options.
#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <iostream>
#include <new>
#include <string>
#include <vector>

#include "ddp-bench/bench_options.h"
#include "ddp-bench/bench_runner.h"
#include "ddp-bench/report.h"
#include "ddp/runtime/init.h"

namespace {

constexpr int kFailureExitCode = 1;

int usage_error(const std::string& message) {
  std::cerr << fmt::format("ddp-bench: error: {} (see 'ddp-bench --help')\n", message);
  return ddp::bench::kUsageExitCode;
}

// Who this process is, for an error line: its rank once init_process_group returned, else the
// launcher's rank (an error in init comes before the group knows it), else that it is not known
// yet. ("rank -1" said nothing.)
std::string who(int rank) {
  if (rank >= 0) return fmt::format("rank {}", rank);
  for (const char* name : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    if (const auto value = ddp::process_environment(name); value && !value->empty()) {
      return fmt::format("rank {} ({}, before init finished)", *value, name);
    }
  }
  return "before the rank is known";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ddp::bench;
  BenchOptions options;
  try {
    auto parsed = parse_command_line(std::vector<std::string>(argv + 1, argv + argc), std::cout);
    if (!parsed) return 0;
    options = std::move(*parsed);
  } catch (const UsageError& e) {
    return usage_error(e.what());
  }

  // The same parser as init_process_group: --backend, else DDP_BACKEND, else the default; an
  // unknown name from either is refused, never ignored.
  try {
    options.backend = ddp::resolve_backend(options.backend, "--backend");
  } catch (const ddp::ConfigError& e) {
    return usage_error(e.what());
  }

  int rank = -1;
  try {
    auto group = ddp::init_process_group({.backend = options.backend, .timeout = options.timeout});
    rank = group->rank();
    if (group->memory_space() != ddp::MemorySpace::kHost) {
      // Its buffers are host memory: a device-memory backend (DDP_BACKEND=nccl) is not measured.
      if (rank == 0) {
        usage_error(
            fmt::format("ddp-bench measures host buffers; the {} backend takes CUDA "
                        "device memory; use the ring or mpi backend",
                        group->backend()));
      }
      return kUsageExitCode;
    }
    const bool rooted =
        std::any_of(options.collectives.begin(), options.collectives.end(), [](Collective c) {
          return c == Collective::kBroadcast || c == Collective::kReduce ||
                 c == Collective::kGather || c == Collective::kScatter;
        });
    if (rooted && options.root >= group->size()) {
      if (rank == 0) {
        usage_error(fmt::format("--root {} is not a rank of this job of {} ranks", options.root,
                                group->size()));
      }
      return kUsageExitCode;
    }
    const bool p2p = std::find(options.collectives.begin(), options.collectives.end(),
                               Collective::kSend) != options.collectives.end();
    if (p2p && group->size() < 2) {
      if (rank == 0) usage_error("--op sendrecv needs at least 2 ranks (each sends to the next)");
      return kUsageExitCode;
    }
    BenchRunner runner(*group, options);
    if (rank == 0 && !options.json) {
      std::cout << table_header(options, group->size(), group->backend()) << std::flush;
    }
    for (Collective collective : options.collectives) {
      // A barrier carries no data: one row, whatever the sizes.
      const std::vector<std::size_t> sizes =
          collective == Collective::kBarrier ? std::vector<std::size_t>{0} : options.byte_sizes();
      for (std::size_t bytes : sizes) {
        const BenchRow row = runner.run(collective, bytes);
        if (rank != 0) continue;
        if (options.json) {
          std::cout << to_json(row).dump() << '\n' << std::flush;
        } else {
          std::cout << table_row(row) << std::flush;
        }
      }
    }
    // Nobody tears down its connections while a peer still needs them.
    group->barrier()->wait();
    ddp::destroy_process_group();
    return 0;
  } catch (const std::bad_alloc&) {
    std::cerr << fmt::format(
        "ddp-bench: {}: error: out of memory allocating the buffers (two of up to --max-bytes "
        "each); lower --max-bytes\n",
        who(rank));
  } catch (const std::exception& e) {
    std::cerr << fmt::format("ddp-bench: {}: error: {}\n", who(rank), e.what());
  }
  return kFailureExitCode;
}
