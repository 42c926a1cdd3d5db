// init_allreduce_worker: a torch-free ddp program for tests that start real jobs (torchrun,
// ddprun, no launcher): init_process_group() from the environment, an allreduce of rank + 1, and
// a check of its sum. Prints "rank R of W: sum S ok" and exits 0, or the error and exits 1.
// With INIT_WORKER_FAIL_ATTEMPT=N, rank 1 exits 3 after the allreduce when
// TORCHELASTIC_RESTART_COUNT is N (to make a launcher restart the job).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "ddp/runtime/init.h"

int main() {
  try {
    auto group = ddp::init_process_group();
    const int rank = group->rank();
    const int world = group->size();
    std::int64_t value = rank + 1;
    group->allreduce(&value, 1, ddp::DType::kInt64, ddp::ReduceOp::kSum)->wait();
    const std::int64_t expected = static_cast<std::int64_t>(world) * (world + 1) / 2;
    if (value != expected) {
      std::fprintf(stderr, "rank %d of %d: sum %lld, expected %lld\n", rank, world,
                   static_cast<long long>(value), static_cast<long long>(expected));
      return 1;
    }
    const char* fail_attempt = std::getenv("INIT_WORKER_FAIL_ATTEMPT");
    const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
    if (rank == 1 && fail_attempt && attempt && std::string(fail_attempt) == attempt) {
      std::printf("rank 1 fails attempt %s on purpose\n", attempt);
      std::fflush(stdout);
      std::_Exit(3);
    }
    group->barrier()->wait();
    std::printf("rank %d of %d: sum %lld ok\n", rank, world, static_cast<long long>(value));
    std::fflush(stdout);
    ddp::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init_allreduce_worker: %s\n", e.what());
    return 1;
  }
}
