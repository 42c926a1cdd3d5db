// How ddp-bench prints its results: a commented header and fixed-width rows (like nccl-tests),
// or one JSON object per line (--json) for scripts.
//
//   std::cout << table_header(options, world_size, backend);
//   std::cout << table_row(row);              // or: to_json(row).dump() << '\n'
//
// Pure functions: any thread. Nothing throws except std::bad_alloc.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ddp-bench/bench_options.h"
#include "ddp-bench/bench_runner.h"

namespace ddp::bench {

// Comment lines ('#') saying what was run and how time and bandwidth are measured, then the
// column names.
std::string table_header(const BenchOptions& options, int world_size, std::string_view backend);

// One fixed-width line, ending in '\n'. `wrong` prints as N/A without --check.
std::string table_row(const BenchRow& row);

// {"op", "bytes", "count", "dtype", "reduce_op", "root", "time_us", "time_min_us", "time_max_us",
//  "algbw_gbps", "busbw_gbps", "wrong" (null without --check), "iters", "warmup", "world_size",
//  "backend"}
nlohmann::json to_json(const BenchRow& row);

}  // namespace ddp::bench
