// Linked into the test executables whose CTest tests are whole GoogleTest suites
// (ddp_add_test(... ONE_PROCESS_PER_SUITE), cmake/gtest_suites.cmake): where
// DDP_TEST_SKIP_EXIT_CODE is set, a run in which no test failed but one or more skipped exits with
// that code, which the suite's SKIP_RETURN_CODE reports as skipped. Without it a skipped test
// would pass silently inside its suite.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

namespace {

class SkipExitCode : public testing::EmptyTestEventListener {
  void OnTestProgramEnd(const testing::UnitTest& unit) override {
    const char* code = std::getenv("DDP_TEST_SKIP_EXIT_CODE");
    if (code == nullptr || !unit.Passed() || unit.skipped_test_count() == 0) return;
    std::printf("%d test(s) skipped: exit code %s, reported as skipped\n",
                unit.skipped_test_count(), code);
    std::fflush(stdout);
    std::fflush(stderr);
    std::exit(std::atoi(code));
  }
};

// Before main: GoogleTest's listeners are appended to before RUN_ALL_TESTS, as its TEST macros
// register at static initialisation.
[[maybe_unused]] const bool installed = [] {
  testing::UnitTest::GetInstance()->listeners().Append(new SkipExitCode);
  return true;
}();

}  // namespace
