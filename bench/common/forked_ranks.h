// run_forked_ranks: the ranks of a benchmark as processes forked from this one, for programs that
// start their own world instead of running under a launcher.
//
//   return run_forked_ranks(world, [&](int rank) { return run_rank(args, rank, port); });
//
// Ranks 1..world-1 run in children, rank 0 in this process; `rank_main` returns the rank's exit
// code (an exception prints "rank R: what" and counts as 1). Returns 0 when every rank returned 0
// (children reaped with waitpid), else 1.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <vector>

template <typename RankMain>
int run_forked_ranks(int world, RankMain&& rank_main) {
  auto run = [&](int rank) {
    try {
      return rank_main(rank);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      return 1;
    }
  };
  std::vector<pid_t> children;
  for (int rank = 1; rank < world; ++rank) {
    std::fflush(nullptr);  // buffered output must not be written twice
    const pid_t pid = ::fork();
    if (pid == 0) ::_exit(run(rank));
    if (pid > 0) children.push_back(pid);
  }
  int failed = run(0) != 0 ? 1 : 0;
  if (static_cast<int>(children.size()) != world - 1) failed = 1;  // a fork failed
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
  }
  return failed;
}
