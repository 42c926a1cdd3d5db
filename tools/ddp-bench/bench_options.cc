#include "ddp-bench/bench_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <ostream>

namespace ddp::bench {
namespace {

constexpr std::array kCollectiveNames{
    std::pair{Collective::kAllreduce, "allreduce"},
    std::pair{Collective::kBroadcast, "broadcast"},
    std::pair{Collective::kReduce, "reduce"},
    std::pair{Collective::kAllgather, "allgather"},
    std::pair{Collective::kGather, "gather"},
    std::pair{Collective::kScatter, "scatter"},
    std::pair{Collective::kReduceScatter, "reduce_scatter"},
    std::pair{Collective::kAlltoall, "alltoall"},
    std::pair{Collective::kBarrier, "barrier"},
    std::pair{Collective::kSend, "sendrecv"},
};

constexpr std::array kDTypes{DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16,
                             DType::kInt8,    DType::kUInt8,   DType::kInt32,   DType::kInt64};
constexpr std::array kReduceOps{ReduceOp::kSum, ReduceOp::kAvg,     ReduceOp::kMin,
                                ReduceOp::kMax, ReduceOp::kProduct, ReduceOp::kBand,
                                ReduceOp::kBor, ReduceOp::kBxor};
constexpr std::array kBackends{"ring", "mpi"};

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

template <class Values, class Name>
std::string choices(const Values& values, Name name) {
  std::vector<std::string> names;
  for (const auto& v : values)
    names.emplace_back(name(v));
  return fmt::format("{}", fmt::join(names, ", "));
}

DType parse_dtype(const std::string& text) {
  for (DType d : kDTypes) {
    if (lower(text) == to_string(d)) return d;
  }
  throw UsageError(fmt::format("--dtype '{}' is not a dtype; choose one of: {}", text,
                               choices(kDTypes, [](DType d) { return to_string(d); })));
}

ReduceOp parse_reduce_op(const std::string& text) {
  for (ReduceOp op : kReduceOps) {
    if (lower(text) == to_string(op)) return op;
  }
  throw UsageError(fmt::format("--reduce-op '{}' is not a reduction; choose one of: {}", text,
                               choices(kReduceOps, [](ReduceOp op) { return to_string(op); })));
}

std::vector<Collective> parse_collectives(const std::string& text) {
  std::vector<Collective> result;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = text.find(',', begin);
    const std::string word =
        lower(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (word == "all") {
      const auto& all = all_collectives();
      result.insert(result.end(), all.begin(), all.end());
    } else {
      const auto it = std::find_if(kCollectiveNames.begin(), kCollectiveNames.end(),
                                   [&](const auto& entry) { return word == entry.second; });
      if (it == kCollectiveNames.end()) {
        throw UsageError(fmt::format(
            "--op '{}' is not a collective; choose one of: {}, all (or a comma-separated list)",
            word, choices(kCollectiveNames, [](const auto& entry) { return entry.second; })));
      }
      result.push_back(it->first);
    }
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return result;
}

std::vector<std::size_t> parse_size_list(const std::string& text) {
  std::vector<std::size_t> sizes;
  std::size_t begin = 0;
  for (;;) {
    const std::size_t end = text.find(',', begin);
    sizes.push_back(parse_byte_size(
        text.substr(begin, end == std::string::npos ? std::string::npos : end - begin), "--sizes"));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return sizes;
}

}  // namespace

std::string_view bench_name(Collective collective) {
  for (const auto& [c, name] : kCollectiveNames)
    if (c == collective) return name;
  return to_string(collective);
}

const std::vector<Collective>& all_collectives() {
  static const std::vector<Collective> all = [] {
    std::vector<Collective> v;
    for (const auto& entry : kCollectiveNames) {
      if (entry.first != Collective::kSend) v.push_back(entry.first);
    }
    return v;
  }();
  return all;
}

std::vector<std::size_t> BenchOptions::byte_sizes() const {
  if (!sizes.empty()) return sizes;
  std::vector<std::size_t> result;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes;) {
    result.push_back(bytes);
    if (bytes > std::numeric_limits<std::size_t>::max() / step_factor) break;
    bytes *= step_factor;
  }
  return result;
}

std::size_t parse_byte_size(std::string_view text, std::string_view option) {
  const auto bad = [&](std::string_view why) {
    return UsageError(fmt::format(
        "{} '{}' is not a byte size ({}); write a whole number with an optional K, M or G "
        "suffix (binary multiples), e.g. 8, 64K, 1M",
        option, text, why));
  };
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])))
    ++digits;
  if (digits == 0) throw bad("it does not start with a digit");
  std::string suffix = lower(text.substr(digits));
  if (suffix.ends_with("ib")) {
    suffix.resize(suffix.size() - 2);
  } else if (suffix.size() > 1 && suffix.ends_with("b")) {
    suffix.pop_back();
  }
  int shift = 0;
  if (suffix.empty() || suffix == "b") {
    shift = 0;
  } else if (suffix == "k") {
    shift = 10;
  } else if (suffix == "m") {
    shift = 20;
  } else if (suffix == "g") {
    shift = 30;
  } else {
    throw bad(fmt::format("unknown suffix '{}'", text.substr(digits)));
  }
  std::size_t value = 0;
  for (std::size_t i = 0; i < digits; ++i) {
    const auto digit = static_cast<std::size_t>(text[i] - '0');
    if (value > (std::numeric_limits<std::size_t>::max() - digit) / 10) throw bad("too large");
    value = value * 10 + digit;
  }
  if (value > (std::numeric_limits<std::size_t>::max() >> shift)) throw bad("too large");
  return value << shift;
}

std::optional<BenchOptions> parse_command_line(const std::vector<std::string>& args,
                                               std::ostream& help_out) {
  BenchOptions options;
  std::string op_text = "allreduce";
  std::string dtype_text = std::string(to_string(options.dtype));
  std::string reduce_op_text = std::string(to_string(options.reduce_op));
  std::string min_text = "8";
  std::string max_text = "64M";
  std::string sizes_text;
  double timeout_seconds = 0;

  CLI::App app{
      "ddp-bench: measures ddp's collectives, like nccl-tests. Run one process per rank under a "
      "launcher:\n"
      "  ddprun --nproc-per-node 2 ddp-bench --op allreduce --check\n"
      "  mpirun -np 2 ddp-bench --backend mpi",
      "ddp-bench"};
  app.footer(
      "Rank 0 prints one row per size: the median over --iters iterations of the slowest rank's\n"
      "time, each iteration started right after a barrier. algbw = bytes / time (GB/s, 1e9);\n"
      "busbw = algbw * 2(N-1)/N for allreduce, * (N-1)/N for reduce_scatter, allgather, gather,\n"
      "scatter and alltoall, * 1 for broadcast, reduce and sendrecv. See docs/benchmarks.md.");
  app.add_option("--backend", options.backend,
                 "ring or mpi (default: DDP_BACKEND, else mpi under mpirun when built, else ring)")
      ->check(CLI::IsMember(std::vector<std::string>(kBackends.begin(), kBackends.end())));
  app.add_option(
      "--op", op_text,
      "allreduce (default), broadcast, reduce, allgather, gather, scatter, "
      "reduce_scatter, alltoall, barrier, all (these collectives), sendrecv (each rank sends "
      "to the next and receives from the previous), or a comma-separated list");
  app.add_option("--dtype", dtype_text,
                 "float32 (default), float64, float16, bfloat16, int8, uint8, int32, int64");
  app.add_option("--reduce-op", reduce_op_text,
                 "sum (default), avg, min, max, product, band, bor, bxor (the last three: integer "
                 "dtypes)");
  app.add_option("--min-bytes", min_text, "Smallest message, K/M/G suffixes allowed (default 8)");
  app.add_option("--max-bytes", max_text, "Largest message (default 64M)");
  app.add_option("--step-factor", options.step_factor,
                 "Each size is the previous one times this (default 2)")
      ->check(CLI::Range(std::size_t{2}, std::size_t{1} << 20));
  app.add_option("--sizes", sizes_text,
                 "Comma-separated sizes to measure instead of min/max/step, e.g. 1K,64K,1M");
  app.add_option("--iters", options.iters, "Timed iterations per size (default 20)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", options.warmup, "Untimed iterations before them (default 5)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--root", options.root, "Root rank of broadcast/reduce/gather/scatter (default 0)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_flag("--check", options.check,
               "Verify every result against a locally computed reference; count wrong elements");
  app.add_flag("--async", options.async,
               "Time collective(...)->wait(), the call queued and then waited for, instead of a "
               "blocking call (CallOptions::blocking: as MPI_Allreduce and torch.distributed's "
               "default async_op=False)");
  app.add_flag("--in-place", options.in_place,
               "allreduce in place (send = recv; the input is rewritten before each iteration, "
               "outside the timed region)");
  app.add_flag("--shared-buffer", options.shared_buffer,
               "receive buffers (and the reduce-scatter's send buffer) from "
               "ProcessGroup::allocate_shared_buffer: the ring backend's zero-copy paths on one "
               "host for allreduce (in place: implies --in-place), reduce_scatter and allgather");
  app.add_flag("--json", options.json, "Print one JSON object per row instead of the table");
  app.add_option("--timeout", timeout_seconds,
                 "Seconds the rendezvous and each collective may take (default DDP_TIMEOUT, else "
                 "300)")
      ->check(CLI::Range(0.001, 86400.0));

  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 pops from the back
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    help_out << app.help();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }

  options.collectives = parse_collectives(op_text);
  options.dtype = parse_dtype(dtype_text);
  options.reduce_op = parse_reduce_op(reduce_op_text);
  if (is_bitwise(options.reduce_op) && !is_integer(options.dtype)) {
    throw UsageError(
        fmt::format("--reduce-op {} is bitwise and needs an integer --dtype (int8, "
                    "uint8, int32, int64), not {}",
                    to_string(options.reduce_op), to_string(options.dtype)));
  }
  options.min_bytes = parse_byte_size(min_text, "--min-bytes");
  options.max_bytes = parse_byte_size(max_text, "--max-bytes");
  if (!sizes_text.empty()) options.sizes = parse_size_list(sizes_text);
  if (options.min_bytes == 0) {
    throw UsageError("--min-bytes must be at least 1 (sizes grow by --step-factor from it)");
  }
  if (options.min_bytes > options.max_bytes) {
    throw UsageError(fmt::format("--min-bytes ({}) is larger than --max-bytes ({}); swap them",
                                 min_text, max_text));
  }
  if (timeout_seconds > 0) {
    options.timeout = std::chrono::milliseconds(std::llround(timeout_seconds * 1000.0));
  }
  return options;
}

}  // namespace ddp::bench
