#include <ddp/launch/launch_environment.h>

#include <iostream>

int main() {
  const auto env = ddp::resolve_launch_environment({.rank = 2, .world_size = 4});
  std::cout << "rank " << env.rank << " of " << env.world_size << "\n";
  return env.rank == 2 && env.world_size == 4 ? 0 : 1;
}
