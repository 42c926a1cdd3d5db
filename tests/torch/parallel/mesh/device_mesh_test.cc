// ddp::DeviceMesh across real processes: the row-major layout, one group per slice (checked by
// communicating on it), sub-meshes, and bad shapes refused on every rank without a hang.
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/mesh/device_mesh.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::join_group;
using test::run_ranks;

void check(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// The ranks of `group` as ranks of the world: an allgather of each member's world rank.
std::vector<int> world_ranks_of(ProcessGroup& group, int world_rank) {
  auto all = torch::empty({group.size()}, torch::kInt64);
  all_gather_into_tensor(all, torch::tensor({static_cast<std::int64_t>(world_rank)}), group);
  std::vector<int> out;
  for (int i = 0; i < group.size(); ++i)
    out.push_back(static_cast<int>(all[i].item<std::int64_t>()));
  return out;
}

// Throws unless `expression` throws ConfigError whose message contains `needle`.
template <class F>
void expect_config_error(F&& expression, const std::string& needle, const std::string& what) {
  try {
    expression();
  } catch (const ConfigError& error) {
    if (std::string(error.what()).find(needle) == std::string::npos) {
      throw std::runtime_error(
          fmt::format("{}: the error \"{}\" does not say \"{}\"", what, error.what(), needle));
    }
    return;
  }
  throw std::runtime_error(what + ": no ConfigError");
}

TEST(DeviceMesh, DpByTpAtWorldFourLaysOutRowMajorWithAGroupPerSlice) {
  const int port = test::free_port();
  const auto results = run_ranks(4, [&](int rank) {
    auto world = join_group(rank, 4, port);
    DeviceMesh mesh({{"dp", 2}, {"tp", 2}}, world);
    check(mesh.ndim() == 2 && mesh.size() == 4 && mesh.size("dp") == 2 && mesh.size("tp") == 2,
          "sizes");
    // Row-major, last dimension fastest: rank = 2 * dp + tp.
    const std::vector<int> want_coordinate = {rank / 2, rank % 2};
    check(mesh.coordinate() == want_coordinate,
          fmt::format("coordinate [{}]", fmt::join(mesh.coordinate(), ", ")));
    check(mesh.coordinate("dp") == rank / 2 && mesh.coordinate("tp") == rank % 2, "coordinate()");
    check(mesh.rank() == rank && mesh.rank_of({1, 0}) == 2 && mesh.rank_of({0, 1}) == 1, "rank_of");
    // Each slice group holds the ranks of its slice, numbered by the coordinate along it.
    const std::vector<int> tp_slice = {rank / 2 * 2, rank / 2 * 2 + 1};
    const std::vector<int> dp_slice = {rank % 2, rank % 2 + 2};
    check(mesh.slice_ranks("tp") == tp_slice && mesh.slice_ranks("dp") == dp_slice, "slice_ranks");
    check(world_ranks_of(*mesh.group("tp"), rank) == tp_slice, "the tp group's members");
    check(world_ranks_of(*mesh.group("dp"), rank) == dp_slice, "the dp group's members");
    check(mesh.group("tp")->rank() == mesh.coordinate("tp") &&
              mesh.group("dp")->rank() == mesh.coordinate("dp"),
          "group ranks follow the coordinates");

    // Sub-meshes share the groups and see this rank's slice.
    const DeviceMesh tp = mesh["tp"];
    check(tp.ndim() == 1 && tp.size() == 2 && tp.dim_names()[0] == "tp", "mesh[tp] shape");
    check(tp.coordinate() == std::vector<int>{rank % 2}, "mesh[tp] coordinate");
    check(tp.rank_of({0}) == tp_slice[0] && tp.rank_of({1}) == tp_slice[1], "mesh[tp] rank_of");
    check(tp.group("tp") == mesh.group("tp"), "mesh[tp] shares the group");
    const DeviceMesh both = mesh.sub_mesh({"dp", "tp"});
    check(both.rank_of({1, 1}) == 3 && both.coordinate() == mesh.coordinate(), "mesh[dp, tp]");
    expect_config_error([&] { (void)mesh.sub_mesh({"tp", "dp"}); }, "order", "sub_mesh order");
    expect_config_error([&] { (void)mesh.group("pp"); }, "no dimension \"pp\"", "unknown name");
    expect_config_error([&] { (void)mesh.rank_of({2, 0}); }, "outside", "rank_of range");
    expect_config_error([&] { (void)mesh.rank_of({1}); }, "needs 2 coordinates", "rank_of size");

    // A second mesh on the same world, three dimensions with one of size 1.
    DeviceMesh cube({{"pp", 2}, {"dp", 1}, {"tp", 2}}, world);
    check(cube.coordinate() == std::vector<int>({rank / 2, 0, rank % 2}), "3-D coordinate");
    check(cube.group("dp")->size() == 1 && world_ranks_of(*cube.group("pp"), rank) == dp_slice,
          "3-D groups");
    const auto sub = cube.sub_mesh({"pp", "tp"});
    check(sub.rank_of({1, 0}) == 2 && sub.size() == 4, "3-D sub-mesh");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DeviceMesh, BadShapesAreNamedOnEveryRankAndTheGroupStaysUsable) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto world = join_group(rank, 2, port);
    expect_config_error(
        [&] {
          DeviceMesh({{"dp", 2}, {"tp", 2}}, world);
        },
        "holds 4 ranks but the group has 2", "product");
    expect_config_error(
        [&] {
          DeviceMesh({{"dp", 2}, {"dp", 1}}, world);
        },
        "used twice", "duplicate name");
    expect_config_error([&] { DeviceMesh({{"", 2}}, world); }, "empty name", "empty name");
    expect_config_error([&] { DeviceMesh({{"dp", 0}, {"tp", 2}}, world); }, "at least 1", "size 0");
    expect_config_error(
        [&] {
          DeviceMesh({{"dp", -2}, {"tp", -1}}, world);
        },
        "at least 1", "negative size");
    expect_config_error([&] { DeviceMesh({}, world); }, "no dimensions", "empty shape");
    // The group is intact after the refusals: a mesh and a collective still work.
    DeviceMesh mesh({{"tp", 2}}, world);
    auto one = torch::ones({3});
    all_reduce(one, ReduceOp::kSum, *mesh.group("tp"));
    check(one.sum().item<double>() == 6.0, "allreduce on the tp group after the errors");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DeviceMesh, RanksThatPassDifferentShapesAllFailNamingTheDifference) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto world = join_group(rank, 2, port, 10s);
    // Both shapes hold 2 ranks, so each rank alone would accept its own.
    const std::vector<MeshDimension> shape = rank == 0
                                                 ? std::vector<MeshDimension>{{"dp", 2}, {"tp", 1}}
                                                 : std::vector<MeshDimension>{{"dp", 1}, {"tp", 2}};
    expect_config_error([&] { DeviceMesh(shape, world); }, "different shapes", "disagreement");
    // A rank with a bad shape makes the other fail too, naming the rank.
    const std::vector<MeshDimension> bad =
        rank == 0 ? std::vector<MeshDimension>{{"tp", 2}} : std::vector<MeshDimension>{{"tp", 3}};
    expect_config_error([&] { DeviceMesh(bad, world); }, rank == 0 ? "rank 1 refused" : "holds 3",
                        "one rank refuses");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
