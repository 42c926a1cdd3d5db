// ddp-demo: the smallest complete ddp program. Run it under a launcher:
//
//   ddprun --standalone --nproc-per-node 4 ddp-demo
//
// Every rank joins the rendezvous, announces itself in the store, sums the ranks with the store's
// atomic counter and checks the total, then all ranks leave together.
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/launch/rendezvous.h"

namespace {

std::string host_name() {
  char name[256] = {};
  return ::gethostname(name, sizeof name - 1) == 0 ? name : "?";
}

}  // namespace

int main() {
  try {
    ddp::World world = ddp::rendezvous();
    auto& store = *world.store;
    const int rank = world.rank();
    const int size = world.size();

    store.set(fmt::format("demo/host/{}", rank), host_name());
    const auto total = store.add("demo/rank_sum", rank);
    store.add("demo/arrived", 1);

    // Wait for everybody's contribution, then check the sum 0 + 1 + ... + (size - 1).
    std::vector<std::string> hosts;
    for (int r = 0; r < size; ++r)
      hosts.push_back(fmt::format("demo/host/{}", r));
    store.wait(hosts);
    const auto final_sum = store.add("demo/rank_sum", 0);
    const auto expected = static_cast<std::int64_t>(size) * (size - 1) / 2;
    fmt::print(
        "rank {}/{} (local {}/{}) on {}: joined via {}, running sum {} -> {} (expected {})\n", rank,
        size, world.local_rank(), world.local_size(), host_name(), world.environment.launcher,
        total, final_sum, expected);
    std::fflush(stdout);
    if (final_sum != expected) return 1;

    // Leave together: rank 0 hosts the store and must outlive the others' last request.
    if (store.add("demo/leaving", 1) == size) store.set("demo/all_left", "1");
    store.wait(std::vector<std::string>{"demo/all_left"});
    if (rank == 0) fmt::print("demo: {} ranks met and agreed; ok\n", size);
    return 0;
  } catch (const ddp::Error& e) {
    std::cerr << "ddp-demo: " << e.what() << "\n";
    return 1;
  }
}
