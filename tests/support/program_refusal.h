// expect_refused: a program run with bad flags must stop at once with exit 1 and a message that
// names what was wrong (the flag, the value, what would be valid), not libtorch's error alone
// (its backtrace) nor a result line. For the tests of the training programs' and benchmarks'
// command lines.
//
//   expect_refused("train-gpt", {"--threads", "100000"}, {"--threads", "1 to 256"}, "final loss");
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "support/subprocess.h"

namespace ddp::test {

// `program` (built by this project) with `args`, as one process: its exit status and output.
inline ExitStatus run_program(const std::string& program, const std::vector<std::string>& args,
                              std::chrono::milliseconds timeout) {
  std::vector<std::string> argv{built_program(program)};
  argv.insert(argv.end(), args.begin(), args.end());
  return Subprocess::start(argv).wait(timeout);
}

// Exit 1 within a minute, every one of `named` in the output, no libtorch backtrace and no
// `result_line` (the start of the line a finished run prints).
inline void expect_refused(const std::string& program, const std::vector<std::string>& args,
                           const std::vector<std::string>& named, const std::string& result_line) {
  SCOPED_TRACE(fmt::format("{} {}", program, fmt::join(args, " ")));
  const auto result = run_program(program, args, std::chrono::seconds(60));
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  for (const auto& text : named)
    EXPECT_THAT(result.output, ::testing::HasSubstr(text));
  EXPECT_THAT(result.output, ::testing::Not(::testing::HasSubstr("Exception raised from")));
  EXPECT_THAT(result.output, ::testing::Not(::testing::HasSubstr(result_line)));
}

}  // namespace ddp::test
