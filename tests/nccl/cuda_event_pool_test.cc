// CudaEventPool (src/comm/nccl/cuda_event_pool.h): reuse of a nccl group's CUDA events, checked on
// the CPU with fake cudaEventCreateWithFlags/cudaEventDestroy in the library's function table.
#include "comm/nccl/cuda_event_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>
#include "support/unity_namespace.h"

namespace ddp::comm::nccl {
namespace {
namespace DDP_UNITY_ID {

std::atomic<std::uintptr_t> events_made{0};
std::atomic<bool> creates_fail{false};
std::mutex destroyed_mutex;
std::vector<cudaEvent_t> destroyed;  // under destroyed_mutex

cudaError_t fake_create(cudaEvent_t* event, unsigned int flags) {
  if (creates_fail) return cudaErrorMemoryAllocation;
  if (flags != cudaEventDisableTiming) return cudaErrorInvalidValue;
  *event = reinterpret_cast<cudaEvent_t>((++events_made) * 64);  // a distinct fake address
  return cudaSuccess;
}

cudaError_t fake_destroy(cudaEvent_t event) {
  std::lock_guard lock(destroyed_mutex);
  destroyed.push_back(event);
  return cudaSuccess;
}

bool was_destroyed(cudaEvent_t event) {
  std::lock_guard lock(destroyed_mutex);
  return std::count(destroyed.begin(), destroyed.end(), event) == 1;
}

NcclLibrary fake_library() {
  NcclLibrary lib{};
  lib.EventCreateWithFlags = &fake_create;
  lib.EventDestroy = &fake_destroy;
  creates_fail = false;
  return lib;
}

TEST(CudaEventPool, ReleasedEventsAreHandedOutAgainAndTheIdleOnesDestroyedAtTheEnd) {
  const NcclLibrary lib = fake_library();
  cudaEvent_t a = nullptr, b = nullptr, c = nullptr;
  {
    CudaEventPool pool(lib);
    ASSERT_EQ(pool.acquire(&a), cudaSuccess);
    ASSERT_EQ(pool.acquire(&b), cudaSuccess);
    EXPECT_NE(a, b);
    EXPECT_EQ(pool.created(), 2u);
    pool.release(a);
    EXPECT_EQ(pool.idle(), 1u);
    ASSERT_EQ(pool.acquire(&c), cudaSuccess);
    EXPECT_EQ(c, a) << "an idle event was not reused";
    EXPECT_EQ(pool.created(), 2u);
    pool.discard(b);  // a failed record: destroyed now, never handed out again
    EXPECT_TRUE(was_destroyed(b));
    pool.release(c);
    EXPECT_FALSE(was_destroyed(a));
  }
  EXPECT_TRUE(was_destroyed(a)) << "the pool's idle event outlived it";
}

TEST(CudaEventPool, ASharedHandleGivesItsEventBackAndKeepsThePoolAlive) {
  const NcclLibrary lib = fake_library();
  auto pool = std::make_shared<CudaEventPool>(lib);
  std::weak_ptr<CudaEventPool> watch = pool;
  cudaEvent_t event = nullptr;
  ASSERT_EQ(pool->acquire(&event), cudaSuccess);
  std::shared_ptr<void> handle = pool->hold(event);
  auto copy = handle;
  pool.reset();  // the group went away; a call still holds its event
  EXPECT_FALSE(watch.expired());
  handle.reset();
  EXPECT_FALSE(was_destroyed(event));
  EXPECT_FALSE(watch.expired());
  copy.reset();  // the last holder: the event goes back, and the pool, last, destroys it
  EXPECT_TRUE(watch.expired());
  EXPECT_TRUE(was_destroyed(event));
}

TEST(CudaEventPool, AFailedCreateIsReturnedAndNothingIsCounted) {
  const NcclLibrary lib = fake_library();
  auto pool = std::make_shared<CudaEventPool>(lib);
  creates_fail = true;
  cudaEvent_t event = nullptr;
  EXPECT_EQ(pool->acquire(&event), cudaErrorMemoryAllocation);
  EXPECT_EQ(event, nullptr);
  EXPECT_EQ(pool->created(), 0u);
  creates_fail = false;
}

// The caller's thread, the executor and the watcher take and give back events at once: none is
// handed to two holders at the same time, and the pool makes no more than were held at once.
TEST(CudaEventPool, ThreadsNeverShareAnEventAndThePoolMakesOnlyWhatWasHeldAtOnce) {
  const NcclLibrary lib = fake_library();
  auto pool = std::make_shared<CudaEventPool>(lib);
  constexpr int kThreads = 4, kRounds = 2000;
  std::mutex held_mutex;
  std::set<cudaEvent_t> held;
  std::atomic<int> shared_twice{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kRounds; ++i) {
        cudaEvent_t event = nullptr;
        if (pool->acquire(&event) != cudaSuccess) return;
        const std::shared_ptr<void> handle = pool->hold(event);
        {
          std::lock_guard lock(held_mutex);
          if (!held.insert(event).second) ++shared_twice;
        }
        std::lock_guard lock(held_mutex);
        held.erase(event);
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  EXPECT_EQ(shared_twice.load(), 0);
  EXPECT_LE(pool->created(), static_cast<std::size_t>(kThreads));
  EXPECT_EQ(pool->idle(), pool->created());
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::comm::nccl
