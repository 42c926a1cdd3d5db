// run_ranks, the harness every multi-process test stands on: a rank that crashes is reported
// with its signal and its frames, so a crash on a machine one cannot log in to (the GPU machine
// of scripts/gpu-check.sh) still says where it happened.
#include "support/multiprocess.h"
#include "support/sanitizers.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <stdexcept>

namespace ddp::test {
namespace {

using ::testing::HasSubstr;

#if DDP_TEST_UNDER_ASAN || DDP_TEST_UNDER_TSAN
#define SKIP_UNDER_SANITIZERS() GTEST_SKIP() << "the sanitizers report crashes themselves"
#else
#define SKIP_UNDER_SANITIZERS() (void)0
#endif

// Not inlined, so that its name is a frame of the backtrace.
[[gnu::noinline]] void crash_with(int signal_number) {
  std::raise(signal_number);
}

TEST(RunRanks, ACrashedRankIsKilledByItsSignalAndSaysWhere) {
  SKIP_UNDER_SANITIZERS();
  const auto results = run_ranks(2, [](int rank) {
    if (rank == 1) crash_with(SIGSEGV);
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_EQ(results[1].signal, SIGSEGV) << describe(results);
  EXPECT_THAT(results[1].error, HasSubstr("rank process crashed: signal 11 (SEGV); backtrace:"));
  // backtrace_symbols_fd names this program's frames by its path.
  EXPECT_THAT(results[1].error, HasSubstr("test_support_test(")) << results[1].error;
  EXPECT_THAT(describe(results), HasSubstr("killed by signal 11"));
}

[[gnu::noinline]] void call_through(void (*target)()) {
  void (*volatile kept)() = target;  // not folded into a trap by the optimiser
  kept();
}

// A jump to a bad address leaves the unwinder nothing past the signal frame: the faulting
// instruction and the return addresses on the stack still name the caller.
TEST(RunRanks, ACallThroughANullPointerNamesTheCallerFromTheStack) {
  SKIP_UNDER_SANITIZERS();
  const auto results = run_ranks(1, [](int) { call_through(nullptr); });
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].signal, SIGSEGV) << describe(results);
  const std::string& report = results[0].error;
  EXPECT_THAT(report, HasSubstr("faulting instruction (nil), fault address (nil)"));
  const auto stack = report.find("stack words that point into loaded objects:");
  ASSERT_NE(stack, std::string::npos) << report;
  EXPECT_NE(report.find("test_support_test(", stack), std::string::npos) << report;
}

// A destructor that crashes while an exception unwinds (the GPU machine's temporary folders did):
// the report still names the exception and its message.
struct CrashesWhenDestroyed {
  ~CrashesWhenDestroyed() { crash_with(SIGSEGV); }
};

TEST(RunRanks, ACrashWhileAnExceptionUnwindsStillNamesTheException) {
  SKIP_UNDER_SANITIZERS();
  const auto results = run_ranks(1, [](int) {
    CrashesWhenDestroyed on_the_way_out;
    throw std::invalid_argument("the reason the test failed");
  });
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].signal, SIGSEGV) << describe(results);
  EXPECT_THAT(results[0].error, HasSubstr("while an exception propagated: std::invalid_argument: "
                                          "the reason the test failed"));
}

TEST(RunRanks, AnAbortedRankIsReportedTheSameWay) {
  SKIP_UNDER_SANITIZERS();
  const auto results = run_ranks(1, [](int) { std::abort(); });
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].signal, SIGABRT) << describe(results);
  EXPECT_THAT(results[0].error, HasSubstr("rank process crashed: signal 6 (ABRT); backtrace:"));
}

TEST(RunRanks, AnExceptionIsReportedWithItsMessageAndNoBacktrace) {
  const auto results = run_ranks(1, [](int) { throw std::runtime_error("the reason"); });
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].exit_code, 1);
  EXPECT_EQ(results[0].error, "the reason");
}

TEST(RunRanks, AnExpectationThatFailsInARankIsThatRanksFailure) {
  // GoogleTest records a failure in the process where it happens: without run_ranks' report the
  // parent would see rank 1 return and call it a pass.
  const auto results = run_ranks(2, [](int rank) {
    EXPECT_EQ(rank, 0) << "only rank 0 passes";
    EXPECT_TRUE(true);
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].ok()) << describe(results);
  EXPECT_EQ(results[1].exit_code, 1);
  EXPECT_THAT(results[1].error, HasSubstr("expectations failed in this rank:\n"));
  EXPECT_THAT(results[1].error, HasSubstr("multiprocess_test.cc:"));
  EXPECT_THAT(results[1].error, HasSubstr("only rank 0 passes"));
  // An ASSERT_* returns from the function: the same.
  const auto asserted = run_ranks(1, [](int) { ASSERT_TRUE(false) << "asserted"; });
  EXPECT_THAT(asserted[0].error, HasSubstr("asserted"));
}

}  // namespace
}  // namespace ddp::test
