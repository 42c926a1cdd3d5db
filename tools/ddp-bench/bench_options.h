// BenchOptions: what `ddp-bench` was asked to measure, parsed and checked before any rank connects.
//
//   std::optional<BenchOptions> options = parse_command_line(args, std::cout);
//   if (!options) return 0;                        // --help was printed
//   for (std::size_t bytes : options->byte_sizes()) ...
//
// Plain functions and values without shared state: any thread may call them.
// Errors: UsageError (a ConfigError) whose message names the option, the bad value and the
// accepted ones; ddp-bench prints it on one line and exits with kUsageExitCode.
#pragma once

#include <chrono>
#include <cstddef>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddp/comm/types.h"
#include "ddp/error.h"

namespace ddp::bench {

// Exit code for bad command lines (the shell convention for usage errors, as ddprun).
inline constexpr int kUsageExitCode = 2;

class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

using ddp::Collective;  // the public enum (ddp/comm/types.h)

// ddp-bench measures point to point (Collective::kSend, named "sendrecv") as each rank sending
// to the next and receiving from the previous, both posted, then waited for.
// Every collective, in the order `--op all` runs them (not sendrecv).
const std::vector<Collective>& all_collectives();
// The name --op takes and reports print: to_string(), except "sendrecv" for kSend.
std::string_view bench_name(Collective collective);

struct BenchOptions {
  std::string backend;  // "" = ddp::resolve_backend's choice (DDP_BACKEND, else the default)
  std::vector<Collective> collectives{Collective::kAllreduce};
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{64} << 20;
  std::size_t step_factor = 2;
  // Explicit sizes (--sizes); when not empty they replace min/max/step.
  std::vector<std::size_t> sizes;
  int iters = 20;
  int warmup = 5;
  int root = 0;
  bool check = false;
  // Time collective(...)->wait() (queued, then waited for) instead of a blocking call.
  bool async = false;
  // allreduce in place on the receive buffer (its input rewritten before each iteration, untimed).
  bool in_place = false;
  // The receive buffer from ProcessGroup::allocate_shared_buffer (implies in_place): the ring
  // backend's zero-copy allreduce on one host. Refused where the group has no shared buffers.
  bool shared_buffer = false;
  bool json = false;
  // Deadline of the rendezvous and of every collective; unset = DDP_TIMEOUT, else 300 s.
  std::optional<std::chrono::milliseconds> timeout;

  // The message sizes to measure, in bytes, ascending as given.
  std::vector<std::size_t> byte_sizes() const;
};

// "8", "64K", "1M", "2G", "16KiB", "512B" (binary multiples, case-insensitive). Throws UsageError
// naming `option` for anything else, and for values that do not fit in size_t.
std::size_t parse_byte_size(std::string_view text, std::string_view option = "size");

// Parses ddp-bench's arguments (without argv[0]). Returns std::nullopt after printing help to
// `help_out`. Throws UsageError.
std::optional<BenchOptions> parse_command_line(const std::vector<std::string>& args,
                                               std::ostream& help_out);

}  // namespace ddp::bench
