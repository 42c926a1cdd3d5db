// What the example programs (train-fashion-mnist, train-gpt, train-char-gpt) and ddp-train-bench
// share in checking their command lines, so that every flag is range-checked alike and a refusal
// names the flag, the value and what would be valid, then exits 1:
//
//   CLI::App app{"..."};
//   app.add_option("--threads", threads, "torch threads per rank")->check(ddp_programs::kThreads);
//   if (const auto code = ddp_programs::parse_command_line(app, argc, argv, "train-gpt")) {
//     return *code;
//   }
//
// Header-only (the CMake target ddp_program_options), as the programs live in different folders.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "ddp/error.h"

namespace ddp_programs {

// Torch threads per rank. Above this no machine is better off, and each thread is started at once
// with a stack of its own: --threads 100000 had started 2,195 threads holding 18 GB of virtual
// memory 25 s later, still going.
inline constexpr int kMaxThreads = 256;
inline const CLI::Range kThreads(1, kMaxThreads);

// CLI::Range lets NaN through (every comparison with NaN is false): floating options must first
// be finite numbers.
inline const CLI::Validator kFinite(
    [](std::string& text) -> std::string {
      double value = 0;
      if (!CLI::detail::lexical_cast(text, value)) return fmt::format("'{}' is not a number", text);
      if (!std::isfinite(value)) return fmt::format("{} is not a finite number", text);
      return {};
    },
    "FINITE");

// CLI11 reads "-1" and numbers past 2^64 - 1 into a uint64 as 2^64 - 1 without a word: whole
// numbers are checked as text first.
inline const CLI::Validator kUint64(
    [](std::string& text) -> std::string {
      std::uint64_t value = 0;
      const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (text.empty() || error != std::errc() || end != text.data() + text.size()) {
        return fmt::format("'{}' is not a whole number from 0 to {}", text,
                           std::numeric_limits<std::uint64_t>::max());
      }
      return {};
    },
    "UINT64");

// A floating option that is an amount (a rate, a size): a finite number above 0 and at most
// `most`. CLI::PositiveNumber lets NaN, inf and 1e300 through (a bucket cap of 1e300 MiB reached
// DDP as 0 bytes: "bucket caps must be positive"), and CLI::Range prints double bounds as
// "0.000000 to 1797693134862315708145274237317043567980...". `unit` follows the numbers ("MiB").
inline CLI::Validator positive_at_most(double most, std::string unit = {}) {
  const std::string bound =
      fmt::format("above 0 and at most {}{}{}", most, unit.empty() ? "" : " ", unit);
  return CLI::Validator(
      [most, bound](std::string& text) -> std::string {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value)) {
          return fmt::format("'{}' is not a number (valid: {})", text, bound);
        }
        if (std::isnan(value)) return fmt::format("{} is not a number (valid: {})", text, bound);
        if (std::isinf(value)) return fmt::format("{} is not finite (valid: {})", text, bound);
        if (value > most) return fmt::format("{} is too large (valid: {})", text, bound);
        if (!(value > 0)) return fmt::format("{} is not above 0 (valid: {})", text, bound);
        return {};
      },
      fmt::format("NUMBER in (0, {}]", most));
}

// A floating option that is an amount without a useful upper bound (a gradient-norm clip): a
// finite number above 0.
inline const CLI::Validator kPositiveFinite(
    [](std::string& text) -> std::string {
      double value = 0;
      if (!CLI::detail::lexical_cast(text, value) || !std::isfinite(value) || !(value > 0)) {
        return fmt::format("{} is not a finite number above 0", text);
      }
      return {};
    },
    "NUMBER > 0");

// Why `path` cannot be read as the contents of a file, or "" when it can: it must exist, be a
// regular file (after symbolic links), open for reading and hold at least one byte. Reading a
// directory failed deep inside the stream ("basic_filebuf::underflow ... Is a directory") and
// /dev/null reached libtorch's loader as an empty archive, neither naming the flag.
inline std::string unreadable_file_reason(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code error;
  const auto status = fs::status(path, error);
  if (status.type() == fs::file_type::not_found) return fmt::format("'{}' does not exist", path);
  if (error) return fmt::format("'{}' cannot be examined: {}", path, error.message());
  if (status.type() == fs::file_type::directory) {
    return fmt::format("'{}' is a directory, not a regular file", path);
  }
  if (status.type() != fs::file_type::regular) {
    const char* kind = status.type() == fs::file_type::character ? "a character device"
                       : status.type() == fs::file_type::block   ? "a block device"
                       : status.type() == fs::file_type::fifo    ? "a pipe"
                       : status.type() == fs::file_type::socket  ? "a socket"
                                                                 : "of an unknown kind";
    return fmt::format("'{}' is {}, not a regular file", path, kind);
  }
  if (::access(path.c_str(), R_OK) != 0) {
    return fmt::format("'{}' cannot be read: {}", path, std::strerror(errno));
  }
  if (fs::file_size(path, error) == 0 && !error) return fmt::format("'{}' is empty", path);
  return {};
}

// A path option naming a file to read (unreadable_file_reason). Like every validator it checks
// what the user passed, not the option's default.
inline const CLI::Validator kReadableFile(
    [](std::string& path) -> std::string { return unreadable_file_reason(path); }, "FILE");

// The whole file (checked as above first), or a ConfigError naming `flag` and the path.
inline std::string read_whole_file(const std::string& flag, const std::string& path) {
  if (const auto reason = unreadable_file_reason(path); !reason.empty()) {
    throw ddp::ConfigError(fmt::format("{}: {}", flag, reason));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  // Copying the buffer fails (failbit on `text`) where the file's bytes cannot be read.
  if (!in || !(text << in.rdbuf())) {
    throw ddp::ConfigError(fmt::format("{}: reading '{}' failed", flag, path));
  }
  return std::move(text).str();
}

// Parses the command line; returns the exit code when the program should stop (0 after --help,
// 1 for a refused option) and nullopt to go on. A refused option exits 1 like every other error
// of these programs (CLI11's own codes, 105 for a value out of range, told a script nothing
// more), with the program's name before CLI11's message ("--threads: Value 100000 not in range
// 1 to 256").
inline std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                             std::string_view program) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    fmt::print(stderr, "{}: {}\n(--help lists the options and their ranges)\n", program, e.what());
    return 1;
  }
}

// The machine's physical memory in bytes (0 when the system does not say).
inline double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0.0;
  return static_cast<double>(pages) * static_cast<double>(page_size);
}

// Refuses a run that cannot fit: `bytes` is a lower bound of what one rank must hold at once (a
// size flag of 10^6 otherwise reached libtorch's allocator, which failed without naming it, or
// the kernel's OOM killer), `what` names the flags and values that make it. Only a lower bound
// is compared, against the whole machine, so that no run that could fit is refused.
inline void check_fits_in_memory(double bytes, const std::string& what) {
  const double machine = physical_memory_bytes();
  if (machine > 0 && bytes > machine) {
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    throw ddp::ConfigError(
        fmt::format("{} needs at least {:.1f} GiB per rank, more than this machine's {:.1f} GiB "
                    "of memory",
                    what, bytes / kGiB, machine / kGiB));
  }
}

}  // namespace ddp_programs
