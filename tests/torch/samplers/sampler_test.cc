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
#include "ddp/torch/samplers/distributed_sampler.h"
#include "support/unity_namespace.h"

namespace ddp::test {
namespace {
namespace DDP_UNITY_ID {

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

// The indices every rank of `world` reads after set_epoch(epoch, offset), in rank order.
std::vector<std::vector<std::int64_t>> resumed_ranks(std::size_t n, int world,
                                                     SamplerOptions options, std::uint64_t epoch,
                                                     std::uint64_t offset) {
  std::vector<std::vector<std::int64_t>> result;
  for (int rank = 0; rank < world; ++rank) {
    DistributedSampler sampler(n, rank, world, options);
    sampler.set_epoch(epoch, offset);
    result.push_back(sampler.indices());
    EXPECT_EQ(result.back().size(), sampler.size()) << "rank " << rank;
  }
  return result;
}

// The epoch's order positions [0, steps * batch * world) as dealt: what `steps` steps consumed.
std::vector<std::int64_t> consumed(const std::vector<std::vector<std::int64_t>>& ranks,
                                   std::size_t steps, std::size_t batch) {
  std::vector<std::int64_t> out;
  for (const auto& indices : ranks) {
    out.insert(
        out.end(), indices.begin(),
        indices.begin() + static_cast<std::ptrdiff_t>(std::min(steps * batch, indices.size())));
  }
  return out;
}

TEST(DistributedSamplerResumeTest, SameWorldSizeContinuesEachRanksOwnList) {
  const SamplerOptions options{.shuffle = true, .seed = 5};
  const auto whole = all_ranks(100, 2, options, 3);
  // 6 steps of 4 per rank at world 2 consumed 48 global samples.
  const auto rest = resumed_ranks(100, 2, options, 3, 48);
  for (int rank = 0; rank < 2; ++rank) {
    const auto& mine = whole[static_cast<std::size_t>(rank)];
    EXPECT_EQ(rest[static_cast<std::size_t>(rank)],
              std::vector<std::int64_t>(mine.begin() + 24, mine.end()))
        << "rank " << rank;
  }
}

TEST(DistributedSamplerResumeTest, OtherWorldSizesRepeatNoSampleAndSkipNone) {
  const SamplerOptions options{.shuffle = true, .seed = 9};
  const std::size_t n = 103;
  const auto before = all_ranks(n, 2, options, 1);
  const auto done = consumed(before, 5, 4);  // 40 samples
  for (int world : {1, 3, 4, 7}) {
    const auto rest = resumed_ranks(n, world, options, 1, 40);
    std::map<std::int64_t, int> count;
    for (auto i : done)
      ++count[i];
    std::size_t resumed_total = 0;
    for (const auto& indices : rest) {
      resumed_total += indices.size();
      for (auto i : indices) {
        EXPECT_EQ(std::count(done.begin(), done.end(), i), 0)
            << "world " << world << ": sample " << i << " trained again";
        ++count[i];
      }
    }
    EXPECT_EQ(count.size(), n) << "world " << world << ": a sample was skipped";
    const std::size_t w = static_cast<std::size_t>(world);
    EXPECT_EQ(resumed_total, (n - 40 + w - 1) / w * w) << "world " << world;
    // Ranks still get equal shares (padding as configured).
    for (const auto& indices : rest)
      EXPECT_EQ(indices.size(), rest[0].size()) << "world " << world;
  }
}

TEST(DistributedSamplerResumeTest, OffsetsAddUpOverSeveralResumes) {
  const SamplerOptions options{.shuffle = false};
  DistributedSampler at_two(20, 1, 2, options);
  at_two.set_epoch(0, 0);
  EXPECT_EQ(at_two.consumed_after(3), 6u);
  DistributedSampler at_three(20, 2, 3, options);
  at_three.set_epoch(0, 6);
  // Without shuffle the order is 0..19: positions 6.. are dealt round-robin to 3 ranks.
  EXPECT_THAT(at_three.indices(), ElementsAre(8, 11, 14, 17, 6));  // padded with position 6
  EXPECT_EQ(at_three.consumed_after(2), 12u);
  EXPECT_EQ(at_three.consumed_after(100), 20u);  // never beyond the dataset
  DistributedSampler done(20, 0, 2, options);
  done.set_epoch(0, 20);
  EXPECT_EQ(done.size(), 0u);
  EXPECT_TRUE(done.indices().empty());
}

TEST(DistributedSamplerResumeTest, DropLastWithFewerSamplesLeftThanRanksIsAConfigError) {
  DistributedSampler sampler(100, 0, 4, {.drop_last = true});
  try {
    sampler.set_epoch(2, 97);  // 3 left for 4 ranks
    FAIL() << "3 remaining samples split over 4 ranks with drop_last";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("leaves 3 of 100 samples"));
    EXPECT_THAT(e.what(), HasSubstr("world size 4"));
  }
  EXPECT_EQ(sampler.epoch(), 0u) << "a refused set_epoch changed the sampler";
  sampler.set_epoch(2, 96);  // 4 left: one each
  EXPECT_EQ(sampler.size(), 1u);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp::test
