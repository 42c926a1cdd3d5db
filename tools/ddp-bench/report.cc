#include "ddp-bench/report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <vector>

namespace ddp::bench {

std::string table_header(const BenchOptions& options, int world_size, std::string_view backend) {
  std::vector<std::string> ops;
  for (Collective c : options.collectives)
    ops.emplace_back(bench_name(c));
  const char* transport = std::getenv("DDP_TRANSPORT");
  std::string out = fmt::format(
      "# ddp-bench: backend {}, world size {}, op {}, dtype {}, reduce-op {}, root {}\n"
      "# iters {}, warmup {}, check {}, calls {}{}\n",
      backend, world_size, fmt::join(ops, ","), to_string(options.dtype),
      to_string(options.reduce_op), options.root, options.iters, options.warmup,
      options.check ? "on" : "off",
      options.async ? "async (collective(...)->wait())" : "blocking (CallOptions::blocking)",
      transport != nullptr ? fmt::format(", DDP_TRANSPORT={}", transport) : std::string());
  if (options.check) {
    out +=
        "# --check: every iteration also fills, poisons and verifies the buffers around the\n"
        "#   timed call, which changes the timings (caches, memory bandwidth): measure without "
        "it\n";
  }
  out +=
      "# time_us: median over iterations; each iteration starts after a barrier and counts the\n"
      "#   slowest rank's time from issuing the call to its return (--async: to Work::wait()\n"
      "#   returning)\n"
      "# algbw = bytes / time (GB/s = 1e9 B/s); busbw = algbw * 2(N-1)/N (allreduce),\n"
      "#   (N-1)/N (reduce_scatter, allgather, gather, scatter, alltoall), 1 (broadcast, reduce,\n"
      "#   sendrecv)\n"
      "# wrong: elements that differ from the reference, summed over ranks and iterations\n"
      "#\n";
  out += fmt::format("# {:>14} {:>12} {:>11} {:>9} {:>12} {:>11} {:>11} {:>7}\n", "op", "bytes",
                     "count", "dtype", "time_us", "algbw_GB/s", "busbw_GB/s", "wrong");
  return out;
}

std::string table_row(const BenchRow& row) {
  return fmt::format("  {:>14} {:>12} {:>11} {:>9} {:>12.2f} {:>11.3f} {:>11.3f} {:>7}\n",
                     bench_name(row.collective), row.layout.bytes, row.layout.total_count,
                     to_string(row.dtype), row.time_us, row.algbw_gbps, row.busbw_gbps,
                     row.wrong ? fmt::format("{}", *row.wrong) : std::string("N/A"));
}

nlohmann::json to_json(const BenchRow& row) {
  nlohmann::json j;
  j["op"] = std::string(bench_name(row.collective));
  j["bytes"] = row.layout.bytes;
  j["count"] = row.layout.total_count;
  j["dtype"] = std::string(to_string(row.dtype));
  j["reduce_op"] = std::string(to_string(row.reduce_op));
  j["root"] = row.root;
  j["time_us"] = row.time_us;
  j["time_min_us"] = row.time_min_us;
  j["time_max_us"] = row.time_max_us;
  j["algbw_gbps"] = row.algbw_gbps;
  j["busbw_gbps"] = row.busbw_gbps;
  j["wrong"] = row.wrong ? nlohmann::json(*row.wrong) : nlohmann::json(nullptr);
  j["iters"] = row.iters;
  j["warmup"] = row.warmup;
  j["call"] = row.blocking ? "blocking" : "async";
  j["checked"] = row.wrong.has_value();  // --check: the timings include its effects
  j["world_size"] = row.world_size;
  j["backend"] = row.backend;
  return j;
}

}  // namespace ddp::bench
