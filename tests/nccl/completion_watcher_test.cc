// CompletionWatcher (src/comm/nccl/completion_watcher.h): the watchdog of stream-ordered nccl
// calls, checked on the CPU with polls that another thread or a counter completes. Every entry is
// released exactly once; calls complete in order; the first failure or passed deadline is
// reported once, naming its call, and releases the rest unpolled; stop() releases what is left.
#include "comm/nccl/completion_watcher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#include "support/unity_namespace.h"

namespace ddp::comm::nccl {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using Status = CompletionWatcher::Status;
using testing::ElementsAre;

struct Recorder {
  std::mutex mutex;
  std::vector<std::string> released;
  std::vector<CompletionWatcher::Failure> failures;
  std::vector<std::string> polled;
  std::vector<std::string> released_names() {
    std::lock_guard lock(mutex);
    return released;
  }
};

// An entry named `name` that is pending until `done` is set (or fails when `fail` is set).
CompletionWatcher::Entry entry(Recorder& r, std::string name,
                               std::shared_ptr<std::atomic<int>> state,
                               std::chrono::milliseconds deadline_in = 10s) {
  return {.poll =
              [&r, name, state](std::string& why) {
                {
                  std::lock_guard lock(r.mutex);
                  if (r.polled.empty() || r.polled.back() != name) r.polled.push_back(name);
                }
                if (*state == 1) return Status::kDone;
                if (*state == 2) {
                  why = "the communicator reported an error";
                  return Status::kFailed;
                }
                return Status::kPending;
              },
          .deadline = net::Clock::now() + deadline_in,
          .description = name,
          .release =
              [&r, name] {
                std::lock_guard lock(r.mutex);
                r.released.push_back(name);
              }};
}

// A watcher that records its failures in `r`.
std::unique_ptr<CompletionWatcher> recording_watcher(Recorder& r) {
  return std::make_unique<CompletionWatcher>([&r](const CompletionWatcher::Failure& f) {
    std::lock_guard lock(r.mutex);
    r.failures.push_back(f);
  });
}

bool eventually(const std::function<bool()>& condition) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

TEST(CompletionWatcher, CallsCompleteInOrderAndEachIsReleasedOnce) {
  Recorder r;
  auto watcher_owner = recording_watcher(r);
  CompletionWatcher& watcher = *watcher_owner;
  auto first = std::make_shared<std::atomic<int>>(0);
  auto second = std::make_shared<std::atomic<int>>(1);  // already done: still waits for the first
  watcher.watch(entry(r, "allreduce #1", first));
  watcher.watch(entry(r, "allreduce #2", second));
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(r.released_names().empty());
  EXPECT_EQ(watcher.in_flight(), 2u);
  *first = 1;
  ASSERT_TRUE(eventually([&] { return r.released_names().size() == 2; }));
  EXPECT_THAT(r.released_names(), ElementsAre("allreduce #1", "allreduce #2"));
  EXPECT_EQ(watcher.in_flight(), 0u);
  EXPECT_TRUE(r.failures.empty());
  // A later call after an idle moment is watched as well.
  auto third = std::make_shared<std::atomic<int>>(0);
  watcher.watch(entry(r, "broadcast #3", third));
  *third = 1;
  ASSERT_TRUE(eventually([&] { return r.released_names().size() == 3; }));
  watcher.stop();
  EXPECT_EQ(r.released_names().size(), 3u);
}

TEST(CompletionWatcher, APassedDeadlineIsReportedOnceAndReleasesTheRestUnpolled) {
  Recorder r;
  auto watcher_owner = recording_watcher(r);
  CompletionWatcher& watcher = *watcher_owner;
  auto stuck = std::make_shared<std::atomic<int>>(0);
  auto behind = std::make_shared<std::atomic<int>>(0);
  watcher.watch(entry(r, "allreduce #4", stuck, 50ms));
  watcher.watch(entry(r, "allreduce #5", behind));
  ASSERT_TRUE(eventually([&] { return r.released_names().size() == 2; }));
  std::lock_guard lock(r.mutex);
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].description, "allreduce #4");
  EXPECT_TRUE(r.failures[0].timed_out);
  EXPECT_THAT(r.polled, ElementsAre("allreduce #4"));  // #5 ran after #4: never polled
  EXPECT_THAT(r.released, ElementsAre("allreduce #4", "allreduce #5"));
}

TEST(CompletionWatcher, AFailedCallIsReportedWithItsReasonAndLaterCallsAreReleasedAtOnce) {
  Recorder r;
  auto watcher_owner = recording_watcher(r);
  CompletionWatcher& watcher = *watcher_owner;
  auto failing = std::make_shared<std::atomic<int>>(2);
  watcher.watch(entry(r, "reduce_scatter #6", failing));
  ASSERT_TRUE(eventually([&] { return r.released_names().size() == 1; }));
  {
    std::lock_guard lock(r.mutex);
    ASSERT_EQ(r.failures.size(), 1u);
    EXPECT_FALSE(r.failures[0].timed_out);
    EXPECT_EQ(r.failures[0].why, "the communicator reported an error");
  }
  // The group is poisoned now: a call watched later is released at once, unpolled.
  watcher.watch(entry(r, "allreduce #7", std::make_shared<std::atomic<int>>(0)));
  EXPECT_THAT(r.released_names(), ElementsAre("reduce_scatter #6", "allreduce #7"));
  std::lock_guard lock(r.mutex);
  EXPECT_EQ(r.failures.size(), 1u);
}

TEST(CompletionWatcher, StopReleasesWhatIsLeftWithoutReportingIt) {
  Recorder r;
  int reported = 0;
  {
    CompletionWatcher watcher([&](const CompletionWatcher::Failure&) { ++reported; });
    watcher.watch(entry(r, "allreduce #8", std::make_shared<std::atomic<int>>(0)));
    watcher.watch(entry(r, "allreduce #9", std::make_shared<std::atomic<int>>(0)));
    std::this_thread::sleep_for(10ms);
    watcher.stop();
    EXPECT_THAT(r.released_names(), ElementsAre("allreduce #8", "allreduce #9"));
    watcher.watch(entry(r, "allreduce #10", std::make_shared<std::atomic<int>>(0)));
    EXPECT_EQ(r.released_names().size(), 3u);
  }  // the destructor stops again: nothing twice
  EXPECT_EQ(r.released_names().size(), 3u);
  EXPECT_EQ(reported, 0);
}

TEST(CompletionWatcher, DrainWaitsForEveryCallWatchedSoFar) {
  Recorder r;
  auto watcher = recording_watcher(r);
  auto first = std::make_shared<std::atomic<int>>(0);
  auto second = std::make_shared<std::atomic<int>>(0);
  watcher->watch(entry(r, "allreduce #11", first));
  watcher->watch(entry(r, "allreduce #12", second));
  std::thread finisher([&] {
    std::this_thread::sleep_for(30ms);
    *first = 1;
    std::this_thread::sleep_for(30ms);
    *second = 1;
  });
  watcher->drain();
  EXPECT_THAT(r.released_names(), ElementsAre("allreduce #11", "allreduce #12"));
  finisher.join();
  // A late call ends a drain too, by its deadline (the failure is reported).
  watcher->watch(entry(r, "allreduce #13", std::make_shared<std::atomic<int>>(0), 50ms));
  watcher->drain();
  std::lock_guard lock(r.mutex);
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].description, "allreduce #13");
}

// The nccl group's answer to a watched failure ends the process, naming the group and the call:
// the call's results were handed to the program as done, so going on could exit 0 with them.
TEST(CompletionWatcherDeathTest, TheBackendsAnswerToALateCallEndsTheProcessNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Recorder r;
        CompletionWatcher watcher([](const CompletionWatcher::Failure& f) {
          abort_after_watched_failure(f, "rank 1 of group 'default' (nccl backend, CUDA device 0)");
        });
        watcher.watch(entry(r, "allreduce #14", std::make_shared<std::atomic<int>>(0), 20ms));
        watcher.drain();
        std::this_thread::sleep_for(10s);  // not reached: the watcher's thread aborts
      },
      "rank 1 of group 'default' .* allreduce #14 did not complete on the device within its "
      "deadline.*aborting the process");
  EXPECT_DEATH(
      {
        Recorder r;
        CompletionWatcher watcher([](const CompletionWatcher::Failure& f) {
          abort_after_watched_failure(f, "rank 0 of group 'g'");
        });
        watcher.watch(entry(r, "broadcast #15", std::make_shared<std::atomic<int>>(2)));
        watcher.drain();
        std::this_thread::sleep_for(10s);
      },
      "broadcast #15 failed on the device: the communicator reported an error");
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm::nccl
