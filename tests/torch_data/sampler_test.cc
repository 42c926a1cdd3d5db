// DistributedSampler's index math: partitions, padding, drop_last, epochs and bad arguments.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "ddp/error.h"
#include "ddp/torch/distributed_sampler.h"

namespace ddp::test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::vector<std::int64_t>> all_ranks(std::size_t n, int world, SamplerOptions options,
                                                 std::uint64_t epoch = 0) {
  std::vector<std::vector<std::int64_t>> result;
  for (int rank = 0; rank < world; ++rank) {
    DistributedSampler sampler(n, rank, world, options);
    sampler.set_epoch(epoch);
    result.push_back(sampler.indices());
    EXPECT_EQ(result.back().size(), sampler.size()) << "rank " << rank;
  }
  return result;
}

// How often each index appears over all ranks.
std::map<std::int64_t, int> multiplicity(const std::vector<std::vector<std::int64_t>>& ranks) {
  std::map<std::int64_t, int> count;
  for (const auto& indices : ranks) {
    for (auto i : indices)
      ++count[i];
  }
  return count;
}

TEST(DistributedSamplerTest, WithoutShuffleRankTakesEveryWorldthIndex) {
  const auto ranks = all_ranks(10, 3, {.shuffle = false});
  // total_size 12: the order 0..9 padded with 0, 1.
  EXPECT_THAT(ranks[0], ElementsAre(0, 3, 6, 9));
  EXPECT_THAT(ranks[1], ElementsAre(1, 4, 7, 0));
  EXPECT_THAT(ranks[2], ElementsAre(2, 5, 8, 1));
}

TEST(DistributedSamplerTest, DivisibleDatasetIsPartitionedExactly) {
  for (bool shuffle : {false, true}) {
    const auto ranks = all_ranks(1200, 4, {.shuffle = shuffle, .seed = 3}, 2);
    const auto count = multiplicity(ranks);
    ASSERT_EQ(count.size(), 1200u) << "shuffle " << shuffle;
    for (const auto& [index, times] : count) {
      ASSERT_EQ(times, 1) << "index " << index << " shuffle " << shuffle;
      ASSERT_GE(index, 0);
      ASSERT_LT(index, 1200);
    }
    for (const auto& r : ranks)
      EXPECT_EQ(r.size(), 300u);
  }
}

TEST(DistributedSamplerTest, PaddingCoversEveryIndexAndRepeatsOnlyTheFewestNeeded) {
  for (bool shuffle : {false, true}) {
    const auto ranks = all_ranks(1001, 8, {.shuffle = shuffle, .seed = 9}, 1);
    for (const auto& r : ranks)
      EXPECT_EQ(r.size(), 126u);  // ceil(1001 / 8)
    const auto count = multiplicity(ranks);
    ASSERT_EQ(count.size(), 1001u);
    int repeated = 0;
    for (const auto& [index, times] : count) {
      ASSERT_LE(times, 2);
      repeated += times - 1;
    }
    EXPECT_EQ(repeated, 8 * 126 - 1001);
  }
}

TEST(DistributedSamplerTest, DropLastDropsTheTailAndNeverRepeats) {
  DistributedSampler sampler(10, 0, 3, {.shuffle = false, .drop_last = true});
  EXPECT_EQ(sampler.size(), 3u);
  EXPECT_EQ(sampler.total_size(), 9u);
  const auto ranks = all_ranks(10, 3, {.shuffle = false, .drop_last = true});
  EXPECT_THAT(ranks[0], ElementsAre(0, 3, 6));
  EXPECT_THAT(ranks[1], ElementsAre(1, 4, 7));
  EXPECT_THAT(ranks[2], ElementsAre(2, 5, 8));

  const auto shuffled = all_ranks(1001, 8, {.shuffle = true, .seed = 1, .drop_last = true}, 4);
  const auto count = multiplicity(shuffled);
  EXPECT_EQ(count.size(), 1000u);  // 8 * floor(1001 / 8)
  for (const auto& [index, times] : count)
    EXPECT_EQ(times, 1) << "index " << index;
}

TEST(DistributedSamplerTest, FewerSamplesThanRanksRepeatsTheListAsOftenAsNeeded) {
  const auto ranks = all_ranks(2, 5, {.shuffle = false});
  // ceil(2 / 5) = 1 each; the order 0, 1 repeated to 0, 1, 0, 1, 0.
  EXPECT_THAT(ranks, ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(0), ElementsAre(1),
                                 ElementsAre(0)));
  const auto dropped = all_ranks(2, 5, {.shuffle = false, .drop_last = true});
  for (const auto& r : dropped)
    EXPECT_TRUE(r.empty());
}

TEST(DistributedSamplerTest, EmptyDatasetGivesNoIndices) {
  for (bool shuffle : {false, true}) {
    DistributedSampler sampler(0, 1, 2, {.shuffle = shuffle});
    EXPECT_EQ(sampler.size(), 0u);
    EXPECT_TRUE(sampler.indices().empty());
  }
}

TEST(DistributedSamplerTest, ShuffleIsAPermutationThatDependsOnSeedAndEpochOnly) {
  const SamplerOptions options{.shuffle = true, .seed = 42};
  DistributedSampler a(1000, 0, 1, options);
  DistributedSampler b(1000, 0, 1, options);
  const auto first = a.indices();
  EXPECT_EQ(first, b.indices()) << "identical seeds must give identical permutations";
  EXPECT_EQ(first, a.indices()) << "indices() must not advance any state";

  std::vector<std::int64_t> sorted = first;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(first, identity) << "shuffle left the order unchanged";

  a.set_epoch(1);
  b.set_epoch(1);
  EXPECT_NE(a.indices(), first) << "set_epoch must change the order";
  EXPECT_EQ(a.indices(), b.indices());

  DistributedSampler other_seed(1000, 0, 1, {.shuffle = true, .seed = 43});
  EXPECT_NE(other_seed.indices(), first);
  // PyTorch seeds with seed + epoch, so (seed 42, epoch 1) is the order of (seed 43, epoch 0).
  EXPECT_EQ(other_seed.indices(), a.indices());
}

TEST(DistributedSamplerTest, AllRanksSeeTheSameEpochOrder) {
  // Rank r's list must be positions r, r + world, ... of one shared permutation: interleaving the
  // ranks' lists gives a permutation, in every epoch, and a different one per epoch.
  const int world = 4;
  std::vector<std::int64_t> previous;
  for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
    const auto ranks = all_ranks(400, world, {.shuffle = true, .seed = 5}, epoch);
    std::vector<std::int64_t> interleaved;
    for (std::size_t i = 0; i < 100; ++i) {
      for (int r = 0; r < world; ++r)
        interleaved.push_back(ranks[r][i]);
    }
    std::set<std::int64_t> distinct(interleaved.begin(), interleaved.end());
    EXPECT_EQ(distinct.size(), 400u);
    EXPECT_NE(interleaved, previous);
    previous = interleaved;
  }
}

TEST(DistributedSamplerTest, BadWorldSizeOrRankIsAConfigErrorNamingTheValue) {
  try {
    DistributedSampler sampler(10, 0, 0);
    FAIL() << "world_size 0 accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("world_size is 0"));
  }
  try {
    DistributedSampler sampler(10, 3, 3);
    FAIL() << "rank 3 of 3 accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank is 3"));
  }
  try {
    DistributedSampler sampler(10, -1, 2);
    FAIL() << "rank -1 accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank is -1"));
  }
}

}  // namespace
}  // namespace ddp::test
