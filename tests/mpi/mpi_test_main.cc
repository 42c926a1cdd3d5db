// Runs under mpirun (see CMakeLists.txt): one process per rank.
//
//   mpi_test conformance   every ddp::conformance check on make_mpi_process_group()
//   mpi_test serialized    the same, on an MPI the program initialised itself with
//                          MPI_THREAD_SERIALIZED (ddp then serialises its MPI calls and must
//                          leave MPI_Finalize to the program)
//   mpi_test funneled      an MPI initialised with MPI_THREAD_FUNNELED: a ConfigError
//   mpi_test timeout       (2 ranks) rank 0 calls an allreduce that rank 1 never calls: it must
//                          fail with a CommError at its deadline, and later calls at once
//
// Exits 0 when every check passed on this rank; otherwise prints the failure and leaves at once
// (without MPI_Finalize, so that mpirun ends the other ranks instead of letting them wait for
// their deadlines).
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "conformance/collective_checks.h"
#include "ddp/comm_error.h"
#include "ddp/error.h"
#include "ddp/mpi_process_group.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "FAILED: %s\n", message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  std::_Exit(1);
}

void expect(bool condition, const std::string& what) {
  if (!condition) die(what);
}

long long ms_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
}

template <class F>
void expect_config_error(const std::string& what, F&& call) {
  try {
    call();
  } catch (const ddp::ConfigError& e) {
    return;
  } catch (const std::exception& e) {
    die(fmt::format("{} threw '{}', expected a ddp::ConfigError", what, e.what()));
  }
  die(fmt::format("{} did not throw; expected a ddp::ConfigError", what));
}

// What only the mpi backend promises: its own argument limits, the new_group agreement check,
// and a receive whose count differs from the send's.
void check_mpi_specific(ddp::ProcessGroup& pg) {
  float x[4] = {};
  expect_config_error("an empty MpiOptions::group_name",
                      [] { ddp::make_mpi_process_group({.group_name = ""}); });
  expect_config_error("a negative MpiOptions::timeout",
                      [] { ddp::make_mpi_process_group({.timeout = -1ms}); });
  expect_config_error("a count above INT_MAX", [&] {
    pg.allreduce(x, std::size_t{1} << 31, ddp::DType::kFloat32, ddp::ReduceOp::kSum);
  });
  if (pg.size() < 2) return;
  const int peer = pg.rank() == 0 ? 1 : 0;
  expect_config_error("a negative tag", [&] { pg.send(x, 4, ddp::DType::kFloat32, peer, -1); });
  // OpenMPI's ob1 allows every non-negative int (MPI_TAG_UB = INT_MAX); others allow less.
  void* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found);
  if (found && *static_cast<int*>(tag_ub) < INT_MAX) {
    const int too_large = *static_cast<int*>(tag_ub) + 1;
    expect_config_error("a tag above MPI_TAG_UB",
                        [&] { pg.recv(x, 4, ddp::DType::kFloat32, peer, too_large); });
  }

  // Different rank lists on different ranks: every rank learns it (the group stays usable).
  expect_config_error("new_group with different rank lists on different ranks", [&] {
    pg.new_group(pg.rank() == 0 ? std::vector<int>{0} : std::vector<int>{0, 1});
  });
  pg.barrier()->wait();

  // A receive expecting more elements than were sent fails on the receiver (in a subgroup, since
  // it poisons the group).
  auto pair = pg.new_group({0, 1});
  if (pair) {
    if (pair->rank() == 0) {
      pair->send(x, 3, ddp::DType::kFloat32, 1)->wait();
    } else {
      try {
        pair->recv(x, 4, ddp::DType::kFloat32, 0)->wait();
        die("a recv of 4 elements matched a send of 3");
      } catch (const ddp::CommError& e) {
        expect(std::string_view(e.what()).find("received 3 elements") != std::string_view::npos,
               fmt::format("the count mismatch error does not say so: {}", e.what()));
        expect(e.peer() == 0, fmt::format("CommError::peer() is {}, expected 0", e.peer()));
      }
    }
  }
  pg.barrier()->wait();
}

void run_conformance() {
  // Short: after a failure on one rank the others stop at their next deadline.
  auto pg = ddp::make_mpi_process_group({.timeout = 30s});
  expect(pg->backend() == "mpi", "backend() is not \"mpi\"");
  for (const auto& check : ddp::conformance::all_checks()) {
    const auto start = Clock::now();
    try {
      check.run(*pg);
    } catch (const std::exception& e) {
      die(fmt::format("check {} failed: {}", check.name, e.what()));  // e names the rank
    }
    if (pg->rank() == 0) std::printf("ok %-16s %lld ms\n", check.name.c_str(), ms_since(start));
  }
  check_mpi_specific(*pg);
  if (pg->rank() == 0) std::printf("ok mpi_specific\n");
  pg->barrier()->wait();
}

void run_user_initialised(int level) {
  int provided = 0;
  expect(MPI_Init_thread(nullptr, nullptr, level, &provided) == MPI_SUCCESS, "MPI_Init_thread");
  if (level == MPI_THREAD_FUNNELED) {
    try {
      ddp::make_mpi_process_group({.timeout = 30s});
      die("make_mpi_process_group accepted an MPI initialised with MPI_THREAD_FUNNELED");
    } catch (const ddp::ConfigError& e) {
      expect(std::string_view(e.what()).find("MPI_THREAD_MULTIPLE") != std::string_view::npos,
             fmt::format("the ConfigError does not say what to do: {}", e.what()));
      std::printf("funneled: %s\n", e.what());
    }
  } else {
    expect(provided == MPI_THREAD_SERIALIZED,
           fmt::format("asked for MPI_THREAD_SERIALIZED, got level {}", provided));
    run_conformance();
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  expect(!finalized, "ddp finalised an MPI that the program had initialised");
  MPI_Finalize();
}

void run_timeout() {
  auto pg = ddp::make_mpi_process_group({.timeout = 20s});
  expect(pg->size() == 2, fmt::format("the timeout test needs 2 ranks, got {}", pg->size()));
  if (pg->rank() == 0) {
    constexpr auto kDeadline = 1500ms;
    float buf[8] = {};
    const auto start = Clock::now();
    auto work =
        pg->allreduce(buf, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum, {.timeout = kDeadline});
    try {
      work->wait();
      die("allreduce without its peer completed");
    } catch (const ddp::CommError& e) {
      const long long took = ms_since(start);
      std::printf("rank 0 got after %lld ms: %s\n", took, e.what());
      expect(took >= 1400 && took < 6000,
             fmt::format("CommError after {} ms, expected about 1500 ms", took));
      expect(e.group() == "default", "CommError::group() is '" + e.group() + "'");
      expect(e.sequence() == 0, fmt::format("CommError::sequence() is {}", e.sequence()));
      expect(e.op().find("allreduce") != std::string::npos, "CommError::op() is " + e.op());
      const std::string_view what = e.what();
      for (std::string_view word : {"default", "allreduce(float32 x 8, sum) #0", "1500 ms"}) {
        expect(what.find(word) != std::string_view::npos,
               fmt::format("the message does not name '{}': {}", word, what));
      }
    }
    // Poisoned: a later call fails at once, with the first error.
    const auto later = Clock::now();
    auto next = pg->broadcast(buf, 8, ddp::DType::kFloat32, 0);
    try {
      next->wait();
      die("a call on the poisoned group completed");
    } catch (const ddp::CommError& e) {
      expect(ms_since(later) < 500,
             fmt::format("the later call took {} ms to fail", ms_since(later)));
      expect(std::string_view(e.what()).find("allreduce(float32 x 8, sum) #0") !=
                 std::string_view::npos,
             fmt::format("the later call's error is not the first one: {}", e.what()));
    }
    std::printf("rank 0: timeout and poisoning ok\n");
  }
  // Rank 1 never touched `pg`; both ranks meet in a fresh group before leaving (the abandoned
  // request of rank 0 stays on the old group's communicator until MPI_Finalize).
  auto sync = ddp::make_mpi_process_group({.timeout = 20s, .group_name = "sync"});
  sync->barrier()->wait();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  try {
    if (mode == "conformance") {
      run_conformance();
    } else if (mode == "serialized") {
      run_user_initialised(MPI_THREAD_SERIALIZED);
    } else if (mode == "funneled") {
      run_user_initialised(MPI_THREAD_FUNNELED);
    } else if (mode == "timeout") {
      run_timeout();
    } else {
      std::fprintf(stderr, "usage: %s conformance|serialized|funneled|timeout (under mpirun)\n",
                   argv[0]);
      return 2;
    }
  } catch (const std::exception& e) {
    die(e.what());
  }
  std::fflush(stdout);
  return 0;
}
