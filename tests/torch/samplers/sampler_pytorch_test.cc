// DistributedSampler against PyTorch's torch.utils.data.distributed.DistributedSampler, run by
// /usr/bin/python3 (Debian's python3-torch). Both orders come from torch.randperm with a CPU
// generator seeded with seed + epoch, so they must agree index for index, shuffled or not.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/torch/samplers/distributed_sampler.h"
#include "support/subprocess.h"
#include "support/test_paths.h"

namespace ddp::test {
namespace {

using namespace std::chrono_literals;

struct Case {
  std::size_t n;
  int world;
  bool shuffle;
  std::uint64_t seed;
  std::uint64_t epoch;
  bool drop_last;
  std::string key() const {
    return fmt::format("{},{},{},{},{},{}", n, world, int{shuffle}, seed, epoch, int{drop_last});
  }
};

TEST(SamplerPyTorchTest, MatchesPyTorchIndexForIndex) {
  const std::string python = "/usr/bin/python3";
  auto probe = Subprocess::start({python, "-c", "import torch.utils.data.distributed"});
  const auto probed = probe.wait(60s);
  if (probed.exit_code != 0) {
    GTEST_SKIP() << python << " cannot import torch (install python3-torch): " << probed.output;
  }

  std::vector<Case> cases;
  for (bool shuffle : {false, true}) {
    for (bool drop_last : {false, true}) {
      cases.push_back({10, 3, shuffle, 0, 0, drop_last});
      cases.push_back({10, 3, shuffle, 7, 5, drop_last});
      cases.push_back({2, 5, shuffle, 1, 0, drop_last});  // N < world: padding > N
      cases.push_back({1, 4, shuffle, 3, 2, drop_last});
      cases.push_back({100, 4, shuffle, 42, 3, drop_last});  // divisible
      cases.push_back({1001, 8, shuffle, 42, 9, drop_last});
      cases.push_back({60000, 2, shuffle, 42, 1, drop_last});
      cases.push_back({7, 1, shuffle, 5, 0, drop_last});
    }
  }
  std::vector<std::string> argv{python, paths::sampler_reference_script};
  for (const auto& c : cases)
    argv.push_back(c.key());
  auto reference = Subprocess::start(argv, {{"OMP_NUM_THREADS", "1"}});
  const auto result = reference.wait(90s);
  ASSERT_EQ(result.exit_code, 0) << result.output;

  std::map<std::string, std::vector<std::int64_t>> expected;  // "case rank" -> indices
  std::istringstream lines(result.output);
  for (std::string line; std::getline(lines, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::istringstream values(line.substr(colon + 1));
    std::vector<std::int64_t> indices;
    for (std::int64_t v; values >> v;)
      indices.push_back(v);
    expected[line.substr(0, colon)] = indices;
  }

  for (const auto& c : cases) {
    for (int rank = 0; rank < c.world; ++rank) {
      const auto key = fmt::format("{} {}", c.key(), rank);
      ASSERT_TRUE(expected.contains(key)) << "python printed no line for " << key << "\n"
                                          << result.output.substr(0, 2000);
      DistributedSampler sampler(c.n, rank, c.world,
                                 {.shuffle = c.shuffle, .seed = c.seed, .drop_last = c.drop_last});
      sampler.set_epoch(c.epoch);
      EXPECT_EQ(sampler.indices(), expected[key])
          << "case (N,world,shuffle,seed,epoch,drop_last)=" << key;
    }
  }
}

}  // namespace
}  // namespace ddp::test
