// Runs under mpirun (see CMakeLists.txt): one process per rank.
//
//   mpi_test conformance   every ddp::conformance check on make_mpi_process_group(), every call
//                          polled (abort_on_failure off)
//   mpi_test conformance_blocking  the same with the defaults (blocking allreduce and barrier)
//   mpi_test serialized    the same, on an MPI the program initialised itself with
//                          MPI_THREAD_SERIALIZED (ddp then serialises its MPI calls and must
//                          leave MPI_Finalize to the program)
//   mpi_test funneled      an MPI initialised with MPI_THREAD_FUNNELED: a ConfigError
//   mpi_test timeout       (2 ranks) rank 0 calls an allreduce that rank 1 never calls: it must
//                          fail with a CommError at its deadline, and later calls at once
//   mpi_test timeout_via_init  the same on a group from init_process_group with
//                          InitOptions::mpi_abort_on_failure off
//   mpi_test mismatch KIND (2+ ranks, abort_on_failure off) the last rank issues a different call
//                          (KIND: op, count, zero_count, dtype, root, reduce_op, skip, leave,
//                          exit): every rank must get a CommError naming both calls (or the rank
//                          that left) within seconds
//   mpi_test local         local_rank()/local_size() agree with OMPI_COMM_WORLD_LOCAL_RANK/SIZE
//   mpi_test p2p           (2+ ranks) point-to-point without deadlock: a cycle of 64 MiB sends
//                          posted before the receives, a halo exchange, interleaved tags, a then()
//                          callback run without a waiter, a count mismatch named on the receiver,
//                          a receive that nobody matches failing at its deadline
//
// Modes whose job must fail as a whole (tests/mpi/expect_job_failure.sh checks the exit status,
// the time and the output): rank 1 of 2 ...
//   mpi_test throw         throws an exception out of main while rank 0 waits in an allreduce
//   mpi_test terminate     calls std::terminate
//   mpi_test exit_status   returns 3 from main
//   mpi_test poison        sleeps, so that rank 0's allreduce misses its deadline (default
//                          abort_on_failure: rank 0 ends the job)
//   mpi_test mismatch_abort issues a broadcast where rank 0 issues an allreduce (default options)
//   mpi_test mismatch_abort_count[_large]  allreduces 4 (2048) floats where rank 0 does 8 (4096)
//   mpi_test mismatch_abort_count_transports  allreduces 8 floats where rank 0 does 1024
//   mpi_test mismatch_abort_count_blocking  as mismatch_abort_count, with CallOptions::blocking
//   mpi_test mismatch_abort_skip  calls a barrier where rank 0 calls an allreduce
//   mpi_test skip_exit     returns 0 from main where rank 0 calls an allreduce
//   mpi_test p2p_abort     sleeps where rank 0 waits in a recv from it (default options: rank 0
//                          ends the job at the recv's 1500 ms deadline)
//
// Exits 0 when every check passed on this rank; otherwise prints the failure and leaves at once
// (without MPI_Finalize, so that mpirun ends the other ranks instead of letting them wait for
// their deadlines).
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "conformance/collective_checks.h"
#include "ddp/comm/comm_error.h"
#include "ddp/comm/mpi_process_group.h"
#include "ddp/error.h"
#include "ddp/runtime/init.h"

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
void check_mpi_specific(ddp::ProcessGroup& pg, bool abort_on_failure) {
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
  // it poisons the group; with abort_on_failure it would end the job).
  if (abort_on_failure) return;
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
        expect(e.kind() == ddp::CommErrorKind::kMismatch,
               fmt::format("the count mismatch is of kind '{}'", ddp::to_string(e.kind())));
        expect(e.peer() == 0, fmt::format("CommError::peer() is {}, expected 0", e.peer()));
      }
    }
  }
  pg.barrier()->wait();
}

// abort_on_failure off: every call polled, and the mpi-specific checks poison a subgroup on
// purpose; on (the default): allreduce and barrier run blocking with their checked fingerprints.
void run_conformance(bool abort_on_failure = false) {
  // Short: after a failure on one rank the others stop at their next deadline.
  auto pg = ddp::make_mpi_process_group({.timeout = 30s, .abort_on_failure = abort_on_failure});
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
  check_mpi_specific(*pg, abort_on_failure);
  if (pg->rank() == 0) std::printf("ok mpi_specific\n");
  // Failures that poison a subgroup on purpose (with abort_on_failure they would end the job).
  if (!abort_on_failure) {
    for (const auto& check : ddp::conformance::failure_checks()) {
      try {
        check.run(*pg);
      } catch (const std::exception& e) {
        die(fmt::format("check {} failed: {}", check.name, e.what()));
      }
      if (pg->rank() == 0) std::printf("ok %s\n", check.name.c_str());
    }
  }
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

// through_init: the group comes from init_process_group (InitOptions::mpi_abort_on_failure).
void run_timeout(bool through_init) {
  auto pg = through_init ? ddp::init_process_group(
                               {.backend = "mpi", .timeout = 20s, .mpi_abort_on_failure = false})
                         : ddp::make_mpi_process_group({.timeout = 20s, .abort_on_failure = false});
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
      expect(e.kind() == ddp::CommErrorKind::kTimeout,
             fmt::format("the passed deadline is of kind '{}'", ddp::to_string(e.kind())));
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

void expect_contains(std::string_view text, std::string_view word, std::string_view what) {
  expect(text.find(word) != std::string_view::npos,
         fmt::format("{} does not name '{}': {}", what, word, text));
}

// The last rank issues a different call (or none) where the others issue
// allreduce(float32 x 8, sum) #1; every rank must fail within seconds, naming both calls.
// Returns the exit status (the "exit" kind leaves main early on the last rank).
int run_mismatch(const std::string& kind) {
  auto pg = ddp::make_mpi_process_group({.timeout = 60s, .abort_on_failure = false});
  expect(pg->size() >= 2, "the mismatch test needs at least 2 ranks");
  const int odd = pg->size() - 1;
  const bool is_odd = pg->rank() == odd;
  std::vector<float> x(8, 1.0f);
  std::vector<int> ints(8, 1);
  pg->barrier()->wait();  // #0: every rank is here
  std::shared_ptr<ddp::Work> work;
  std::string theirs;  // what the odd rank called, as the messages name it
  const auto start = Clock::now();
  if (kind == "root") {
    // Every rank broadcasts, from root 0 except the odd rank (root 1).
    work = pg->broadcast(x.data(), 8, ddp::DType::kFloat32, is_odd ? 1 : 0);
    theirs = "broadcast(float32 x 8, root 1) #1";
  } else if (!is_odd) {
    work = pg->allreduce(x.data(), 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum);
  } else if (kind == "op") {
    work = pg->broadcast(x.data(), 8, ddp::DType::kFloat32, 0);
    theirs = "broadcast(float32 x 8, root 0) #1";
  } else if (kind == "count") {
    work = pg->allreduce(x.data(), 4, ddp::DType::kFloat32, ddp::ReduceOp::kSum);
    theirs = "allreduce(float32 x 4, sum) #1";
  } else if (kind == "zero_count") {
    work = pg->allreduce(x.data(), 0, ddp::DType::kFloat32, ddp::ReduceOp::kSum);
    theirs = "allreduce(float32 x 0, sum) #1";
  } else if (kind == "dtype") {
    work = pg->allreduce(ints.data(), 8, ddp::DType::kInt32, ddp::ReduceOp::kSum);
    theirs = "allreduce(int32 x 8, sum) #1";
  } else if (kind == "reduce_op") {
    work = pg->allreduce(x.data(), 8, ddp::DType::kFloat32, ddp::ReduceOp::kMax);
    theirs = "allreduce(float32 x 8, max) #1";
  } else if (kind == "skip") {
    work = pg->barrier();  // skipped the allreduce, went on to the next call
    theirs = "barrier() #1";
  } else if (kind == "leave") {
    pg.reset();  // leaves the group without the allreduce
    theirs = fmt::format("rank {} left group 'default' (the group was destroyed)", odd);
  } else if (kind == "exit") {
    return 0;  // leaves the process: the exit hook tells the peers
  } else {
    die("unknown mismatch kind '" + kind + "'");
  }
  const std::string ours =
      kind == "root" ? "broadcast(float32 x 8, root 0) #1" : "allreduce(float32 x 8, sum) #1";
  if (work) {
    try {
      work->wait();
      die(fmt::format("rank {}: the mismatched call completed", pg->rank()));
    } catch (const ddp::CommError& e) {
      const long long took = ms_since(start);
      std::printf("rank %d after %lld ms: %s\n", pg->rank(), took, e.what());
      expect(took < 5000, fmt::format("the mismatch took {} ms to be named", took));
      if (kind == "leave" || kind == "exit") {
        expect_contains(e.what(), theirs, "the error");
        expect(e.kind() == ddp::CommErrorKind::kPeerGone,
               fmt::format("a peer that left is of kind '{}'", ddp::to_string(e.kind())));
      } else {
        expect_contains(e.what(), "collective mismatch", "the error");
        expect(e.kind() == ddp::CommErrorKind::kMismatch,
               fmt::format("the mismatch is of kind '{}'", ddp::to_string(e.kind())));
        expect_contains(e.what(), is_odd ? theirs : ours, "the error");
        expect_contains(e.what(), is_odd ? ours : theirs, "the error");
      }
    }
  }
  if (kind == "exit") return 0;
  // Everyone meets in a fresh group before leaving.
  auto sync = ddp::make_mpi_process_group({.timeout = 20s, .group_name = "sync"});
  sync->barrier()->wait();
  return 0;
}

// The value rank `src` sends as element `i` of the message with `tag`.
float p2p_value(int src, int tag, std::size_t i) {
  return static_cast<float>(src * 1000 + tag * 100) + static_cast<float>(i % 97);
}

std::vector<float> p2p_message(int src, int tag, std::size_t count) {
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i)
    v[i] = p2p_value(src, tag, i);
  return v;
}

void expect_message(const std::vector<float>& got, int src, int tag, const std::string& what) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != p2p_value(src, tag, i)) {
      die(fmt::format("{}: element {} is {}, expected {} (from rank {}, tag {})", what, i, got[i],
                      p2p_value(src, tag, i), src, tag));
    }
  }
}

void run_p2p() {
  auto pg = ddp::make_mpi_process_group({.timeout = 30s, .abort_on_failure = false});
  const int rank = pg->rank();
  const int size = pg->size();
  expect(size >= 2, "the p2p test needs 2 ranks or more");
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  constexpr auto f32 = ddp::DType::kFloat32;

  // 1. Every rank sends 64 MiB to the next before it receives from the previous: far above any
  // eager limit, so this completes only if sends and receives progress independently.
  {
    constexpr std::size_t kCount = (64u << 20) / sizeof(float);
    const std::vector<float> out = p2p_message(rank, 1, kCount);
    std::vector<float> in(kCount, -1.0f);
    const auto start = Clock::now();
    auto send = pg->send(out.data(), kCount, f32, next, 1, {.timeout = 20s});
    auto recv = pg->recv(in.data(), kCount, f32, prev, 1, {.timeout = 20s});
    send->wait();
    recv->wait();
    expect_message(in, prev, 1, "64 MiB cycle");
    std::printf("rank %d: 64 MiB cycle on %d ranks in %lld ms\n", rank, size, ms_since(start));
  }
  pg->barrier()->wait();

  // 2. A halo exchange: both boundaries to both neighbours at once (tag = direction), sends first.
  {
    constexpr std::size_t kHalo = 4096;
    const std::vector<float> to_left = p2p_message(rank, 2, kHalo);
    const std::vector<float> to_right = p2p_message(rank, 3, kHalo);
    std::vector<float> from_left(kHalo, -1.0f);
    std::vector<float> from_right(kHalo, -1.0f);
    std::vector<std::shared_ptr<ddp::Work>> works;
    works.push_back(pg->send(to_left.data(), kHalo, f32, prev, 2));
    works.push_back(pg->send(to_right.data(), kHalo, f32, next, 3));
    works.push_back(pg->recv(from_left.data(), kHalo, f32, prev, 3));   // prev sent it rightwards
    works.push_back(pg->recv(from_right.data(), kHalo, f32, next, 2));  // next sent it leftwards
    for (auto& w : works)
      w->wait();
    expect_message(from_left, prev, 3, "halo from the left");
    expect_message(from_right, next, 2, "halo from the right");
  }

  // 3. Interleaved tags: sent in the order 13, 11, 12, 10, 11 and received in the order 10, 11,
  // 11, 12, 13; the two messages of tag 11 arrive in the order they were sent.
  {
    constexpr std::size_t kCount = 1000;
    std::vector<std::vector<float>> outs;
    for (int tag : {13, 11, 12, 10})
      outs.push_back(p2p_message(rank, tag, kCount));
    outs.push_back(p2p_message(rank, 11, kCount));
    for (float& v : outs.back())
      v = -v;  // the second message of tag 11
    std::vector<std::shared_ptr<ddp::Work>> sends;
    const int send_tags[] = {13, 11, 12, 10, 11};
    for (int i = 0; i < 5; ++i)
      sends.push_back(pg->send(outs[i].data(), kCount, f32, next, send_tags[i]));
    std::vector<std::vector<float>> ins(5, std::vector<float>(kCount, 0.0f));
    const int recv_tags[] = {10, 11, 11, 12, 13};
    std::vector<std::shared_ptr<ddp::Work>> recvs;
    for (int i = 0; i < 5; ++i)
      recvs.push_back(pg->recv(ins[i].data(), kCount, f32, prev, recv_tags[i]));
    for (int i = 4; i >= 0; --i)
      recvs[i]->wait();
    for (auto& w : sends)
      w->wait();
    expect_message(ins[0], prev, 10, "tag 10");
    expect_message(ins[1], prev, 11, "first tag 11");
    for (float& v : ins[2])
      v = -v;
    expect_message(ins[2], prev, 11, "second tag 11 (negated)");
    expect_message(ins[3], prev, 12, "tag 12");
    expect_message(ins[4], prev, 13, "tag 13");
  }

  // 4. then() runs without anyone waiting (the group's watchdog polls).
  {
    std::vector<float> out = p2p_message(rank, 4, 256);
    std::vector<float> in(256, -1.0f);
    std::atomic<bool> received{false};
    auto recv = pg->recv(in.data(), 256, f32, prev, 4);
    recv->then([&](ddp::Work& w) { received = w.error() == nullptr; });
    auto send = pg->send(out.data(), 256, f32, next, 4);
    const auto until = Clock::now() + 10s;
    while (!received && Clock::now() < until)
      std::this_thread::sleep_for(1ms);
    expect(received.load(), "a recv's then() callback did not run within 10 s without a waiter");
    expect_message(in, prev, 4, "then() recv");
    send->wait();
  }
  pg->barrier()->wait();

  // 4b. Rank 0 receives one message from every other rank from any source: each once, with the
  // sender's rank.
  {
    constexpr std::size_t kCount = 300;
    if (rank == 0) {
      std::vector<std::vector<float>> ins(static_cast<std::size_t>(size - 1),
                                          std::vector<float>(kCount, -1.0f));
      std::vector<int> sources(static_cast<std::size_t>(size - 1), -1);
      std::vector<std::shared_ptr<ddp::Work>> recvs;
      for (int k = 0; k < size - 1; ++k) {
        recvs.push_back(pg->recv_any_source(ins[static_cast<std::size_t>(k)].data(), kCount, f32,
                                            &sources[static_cast<std::size_t>(k)], 14));
      }
      std::vector<bool> seen(static_cast<std::size_t>(size), false);
      for (int k = 0; k < size - 1; ++k) {
        recvs[static_cast<std::size_t>(k)]->wait();
        const int from = sources[static_cast<std::size_t>(k)];
        expect(from >= 1 && from < size && !seen[static_cast<std::size_t>(from)],
               fmt::format("receive from any source {} reports source {}", k, from));
        seen[static_cast<std::size_t>(from)] = true;
        expect_message(ins[static_cast<std::size_t>(k)], from, 14, "receive from any source");
      }
    } else {
      const std::vector<float> out = p2p_message(rank, 14, kCount);
      pg->send(out.data(), kCount, f32, 0, 14)->wait();
    }
  }
  pg->barrier()->wait();

  // 5. A count mismatch is named on the receiver: a receive shorter than the message
  // (MPI_ERR_TRUNCATE). The group stays usable.
  if (rank == 0) {
    const std::vector<float> out = p2p_message(rank, 5, 6);
    pg->send(out.data(), 6, f32, 1, 5)->wait();
  } else if (rank == 1) {
    std::vector<float> in(4, -1.0f);
    try {
      pg->recv(in.data(), 4, f32, 0, 5)->wait();
      die("a recv of 4 elements matched a send of 6");
    } catch (const ddp::CommError& e) {
      const std::string_view what = e.what();
      std::printf("rank 1 got: %s\n", e.what());
      expect(e.kind() == ddp::CommErrorKind::kMismatch,
             fmt::format("the count mismatch is of kind '{}'", ddp::to_string(e.kind())));
      for (std::string_view word : {"recv(float32 x 4) from rank 0, tag 5", "more than the 4"}) {
        expect(what.find(word) != std::string_view::npos,
               fmt::format("the count mismatch error does not name '{}': {}", word, what));
      }
      expect(e.peer() == 0, fmt::format("CommError::peer() is {}, expected 0", e.peer()));
    }
  }
  pg->barrier()->wait();

  // 6. A receive nobody matches fails at its deadline, naming the peer and the tag; the group
  // stays usable.
  if (rank == 1) {
    float buf[8];
    const auto start = Clock::now();
    try {
      pg->recv(buf, 8, f32, 0, 77, {.timeout = 500ms})->wait();
      die("a recv that no rank matched completed");
    } catch (const ddp::CommError& e) {
      const long long took = ms_since(start);
      expect(took >= 450 && took < 5000,
             fmt::format("the unmatched recv failed after {} ms, expected about 500 ms", took));
      expect(e.kind() == ddp::CommErrorKind::kTimeout,
             fmt::format("the unmatched recv is of kind '{}'", ddp::to_string(e.kind())));
      const std::string_view what = e.what();
      for (std::string_view word : {"from rank 0, tag 77", "500 ms"}) {
        expect(what.find(word) != std::string_view::npos,
               fmt::format("the deadline error does not name '{}': {}", word, what));
      }
    }
  }
  pg->barrier()->wait();
  // Still usable after the failures above.
  {
    std::vector<float> out = p2p_message(rank, 6, 100);
    std::vector<float> in(100, -1.0f);
    auto send = pg->send(out.data(), 100, f32, next, 6);
    pg->recv(in.data(), 100, f32, prev, 6)->wait();
    send->wait();
    expect_message(in, prev, 6, "after the failures");
  }
  pg->barrier()->wait();
}

void run_local() {
  auto pg = ddp::make_mpi_process_group({.timeout = 30s});
  const char* local_rank = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  expect(local_rank && local_size, "mpirun did not set OMPI_COMM_WORLD_LOCAL_RANK/SIZE");
  expect(pg->local_rank() == std::atoi(local_rank),
         fmt::format("local_rank() is {}, mpirun says {}", pg->local_rank(), local_rank));
  expect(pg->local_size() == std::atoi(local_size),
         fmt::format("local_size() is {}, mpirun says {}", pg->local_size(), local_size));
  // A subgroup of the odd ranks: all on this host, numbered among themselves.
  std::vector<int> odd;
  for (int r = 1; r < pg->size(); r += 2)
    odd.push_back(r);
  if (!odd.empty()) {
    auto sub = pg->new_group(odd);
    if (sub) {
      expect(sub->local_rank() == sub->rank() && sub->local_size() == sub->size(),
             fmt::format("subgroup local_rank/local_size {}/{}, expected {}/{}", sub->local_rank(),
                         sub->local_size(), sub->rank(), sub->size()));
    }
  }
  pg->barrier()->wait();
  if (pg->rank() == 0) std::printf("local_rank/local_size ok\n");
}

// Modes that end the job on purpose: rank 1 fails while rank 0 waits in an allreduce that has a
// long deadline, so only failing fast can end the job within the test's time limit.
int run_failing(const std::string& mode) {
  auto pg = ddp::make_mpi_process_group({.timeout = 60s});
  expect(pg->size() == 2, "the failure tests need 2 ranks");
  float x[8] = {};
  std::vector<float> big(4096, 1.0f);
  // Blocking (checked) allreduces on both ranks, the fingerprint in-band (small) or in its own
  // call (large): the ranks pass different counts, or rank 1 skips to a barrier.
  if (mode == "mismatch_abort_count") {
    pg->allreduce(x, pg->rank() == 0 ? 8 : 4, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
    die("the mismatched call completed");
  }
  if (mode == "mismatch_abort_count_large") {
    pg->allreduce(big.data(), pg->rank() == 0 ? 4096 : 2048, ddp::DType::kFloat32,
                  ddp::ReduceOp::kSum)
        ->wait();
    die("the mismatched call completed");
  }
  // Calls that take different transports: 1024 floats past the eager limit (MPI_Allreduce)
  // against 8 (point to point); and a count mismatch made with CallOptions::blocking.
  if (mode == "mismatch_abort_count_transports") {
    pg->allreduce(big.data(), pg->rank() == 0 ? 1024 : 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum)
        ->wait();
    die("the mismatched call completed");
  }
  if (mode == "mismatch_abort_count_blocking") {
    pg->allreduce(x, pg->rank() == 0 ? 8 : 4, ddp::DType::kFloat32, ddp::ReduceOp::kSum,
                  ddp::CallOptions{.blocking = true});
    die("the mismatched call completed");
  }
  if (mode == "mismatch_abort_skip") {
    auto work = pg->rank() == 0 ? pg->allreduce(x, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum)
                                : pg->barrier();
    work->wait();
    die("the mismatched call completed");
  }
  if (mode == "skip_exit") {
    // Rank 1 skips the allreduce and exits normally: rank 0 must not wait for its deadline.
    if (pg->rank() == 1) return 0;
    pg->allreduce(x, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
    die("the allreduce without its peer completed");
  }
  if (mode == "mismatch_abort") {
    auto work = pg->rank() == 0 ? pg->allreduce(x, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum)
                                : pg->broadcast(x, 8, ddp::DType::kFloat32, 0);
    work->wait();
    die("the mismatched call completed");
  }
  if (mode == "p2p_abort") {
    float buf[8] = {};
    if (pg->rank() == 0) {
      pg->recv(buf, 8, ddp::DType::kFloat32, 1, 5, {.timeout = 1500ms})->wait();
      die("the recv without its peer completed");
    }
    std::this_thread::sleep_for(60s);  // only rank 0's abort ends this
    die("rank 1 was not ended by rank 0's failure");
  }
  if (mode == "poison") {
    if (pg->rank() == 0) {
      pg->allreduce(x, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum, {.timeout = 1500ms})->wait();
      die("the allreduce without its peer completed");
    }
    std::this_thread::sleep_for(60s);  // not in MPI: only rank 0's abort ends this
    die("rank 1 was not ended by rank 0's failure");
  }
  if (pg->rank() == 0) {
    pg->allreduce(x, 8, ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
    die("the allreduce without its peer completed");
  }
  std::this_thread::sleep_for(200ms);  // rank 0 is waiting by now
  if (mode == "throw") throw std::runtime_error("rank 1 gives up on purpose");
  if (mode == "terminate") std::terminate();
  if (mode == "exit_status") return 3;
  die("unknown mode " + mode);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  // Outside the try below: these must reach the mpi runtime's handlers as a program's would.
  if (mode == "throw" || mode == "terminate" || mode == "exit_status" || mode == "poison" ||
      mode.rfind("mismatch_abort", 0) == 0 || mode == "skip_exit" || mode == "p2p_abort") {
    return run_failing(mode);
  }
  try {
    if (mode == "conformance") {
      run_conformance();
    } else if (mode == "conformance_blocking") {
      run_conformance(/*abort_on_failure=*/true);
    } else if (mode == "serialized") {
      run_user_initialised(MPI_THREAD_SERIALIZED);
    } else if (mode == "funneled") {
      run_user_initialised(MPI_THREAD_FUNNELED);
    } else if (mode == "timeout") {
      run_timeout(/*through_init=*/false);
    } else if (mode == "timeout_via_init") {
      run_timeout(/*through_init=*/true);
    } else if (mode == "mismatch" && argc > 2) {
      const int status = run_mismatch(argv[2]);
      std::fflush(stdout);
      return status;
    } else if (mode == "local") {
      run_local();
    } else if (mode == "p2p") {
      run_p2p();
    } else {
      std::fprintf(stderr,
                   "usage: %s conformance|serialized|funneled|timeout|timeout_via_init|mismatch "
                   "KIND|local|p2p|throw|"
                   "terminate|exit_status|poison|mismatch_abort|p2p_abort (under mpirun)\n",
                   argv[0]);
      return 2;
    }
  } catch (const std::exception& e) {
    die(e.what());
  }
  std::fflush(stdout);
  return 0;
}
