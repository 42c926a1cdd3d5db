// libtorch's DataLoader over ddp::DataLoaderSampler, and DistributedDataParallel held as a class
// member the way TORCH_MODULE holders are. Multi-rank tests fork real rank processes.
#include <algorithm>
#include <cstdint>
#include <set>
#include <sstream>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/samplers/data_loader_sampler.h"
#include "support/multiprocess.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;
using ::testing::HasSubstr;

// Sample i is the scalar i, so a batch's data are the indices the sampler dealt.
class IndexDataset : public torch::data::datasets::Dataset<IndexDataset> {
 public:
  explicit IndexDataset(std::size_t size) : size_(size) {}
  torch::data::Example<> get(std::size_t index) override {
    return {torch::tensor({static_cast<std::int64_t>(index)}),
            torch::tensor({static_cast<std::int64_t>(index % 4)})};
  }
  torch::optional<std::size_t> size() const override { return size_; }

 private:
  std::size_t size_;
};

// Every index the loader yields in one pass, in order.
template <typename Loader>
std::vector<std::int64_t> one_pass(Loader& loader, std::size_t batch_size) {
  std::vector<std::int64_t> seen;
  for (auto& batch : loader) {
    EXPECT_LE(static_cast<std::size_t>(batch.data.size(0)), batch_size);
    const torch::Tensor flat = batch.data.flatten().contiguous();
    seen.insert(seen.end(), flat.data_ptr<std::int64_t>(),
                flat.data_ptr<std::int64_t>() + flat.numel());
  }
  return seen;
}

TEST(DataLoaderSampler, TheLoaderDealsTheDistributedSamplersIndicesEpochByEpoch) {
  const std::size_t n = 103, batch = 8;
  const int world = 3;
  const SamplerOptions options{.shuffle = true, .seed = 9};
  for (int rank = 0; rank < world; ++rank) {
    DataLoaderSampler sampler(n, rank, world, options);
    auto loader =
        torch::data::make_data_loader(IndexDataset(n).map(torch::data::transforms::Stack<>()),
                                      sampler, torch::data::DataLoaderOptions(batch));
    std::vector<std::int64_t> previous;
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      sampler.set_epoch(epoch);
      DistributedSampler reference(n, rank, world, options);
      reference.set_epoch(epoch);
      const auto seen = one_pass(*loader, batch);
      EXPECT_EQ(seen, reference.indices()) << "rank " << rank << " epoch " << epoch;
      EXPECT_EQ(sampler.dealt(), reference.size());
      EXPECT_NE(seen, previous) << "set_epoch did not reach the loader's copy";
      previous = seen;
    }
    // Resuming mid-epoch: the rest of the epoch, as DistributedSampler deals it.
    sampler.set_epoch(1, 30);
    DistributedSampler reference(n, rank, world, options);
    reference.set_epoch(1, 30);
    EXPECT_EQ(one_pass(*loader, batch), reference.indices()) << "rank " << rank << " resumed";
  }
}

TEST(DataLoaderSampler, ASamplerForAnotherWorldSizeIsANamedError) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const std::size_t n = 50, batch = 4;
    // Built from the group: the ranks' shares cover the dataset.
    DataLoaderSampler sampler(n, *pg, {.shuffle = true, .seed = 3});
    auto loader =
        torch::data::make_data_loader(IndexDataset(n).map(torch::data::transforms::Stack<>()),
                                      sampler, torch::data::DataLoaderOptions(batch));
    sampler.set_epoch(2);
    const auto mine = one_pass(*loader, batch);
    std::int64_t count = static_cast<std::int64_t>(mine.size());
    pg->allreduce(&count, 1, DType::kInt64, ReduceOp::kSum)->wait();
    if (count != static_cast<std::int64_t>(n)) throw std::runtime_error("shares do not add up");

    // Built for a world of 3 while the job has 2 ranks: refused when the loader starts a pass.
    DataLoaderSampler wrong(n, rank, 3);
    auto wrong_loader =
        torch::data::make_data_loader(IndexDataset(n).map(torch::data::transforms::Stack<>()),
                                      wrong, torch::data::DataLoaderOptions(batch));
    try {
      one_pass(*wrong_loader, batch);
      throw std::runtime_error("a sampler for a world of 3 dealt batches in a world of 2");
    } catch (const ConfigError& e) {
      const std::string text = e.what();
      if (text.find("a world of 3") == std::string::npos ||
          text.find("has 2 ranks") == std::string::npos) {
        throw std::runtime_error(std::string("unclear error: ") + text);
      }
    }
    destroy_process_group();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DataLoaderSampler, AResetForAnotherDatasetSizeIsANamedError) {
  DataLoaderSampler sampler(10, 0, 1);
  try {
    sampler.reset(12);
    FAIL() << "a reset to another size was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("12 samples"));
    EXPECT_THAT(e.what(), HasSubstr("built for 10"));
  }
}

TEST(DataLoaderSampler, SaveAndLoadRestoreThePositionAndRefuseAnotherSamplersState) {
  DataLoaderSampler sampler(40, 1, 2, {.shuffle = true, .seed = 5});
  sampler.set_epoch(3, 6);
  sampler.reset();
  const auto first = sampler.next(4);
  ASSERT_TRUE(first.has_value());
  torch::serialize::OutputArchive out;
  sampler.save(out);
  std::stringstream bytes;
  out.save_to(bytes);

  // The same sampler shape resumes at the same epoch, offset and position.
  DataLoaderSampler resumed(40, 1, 2, {.shuffle = true, .seed = 5});
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  resumed.load(in);
  EXPECT_EQ(resumed.sampler().epoch(), 3u);
  EXPECT_EQ(resumed.sampler().start_offset(), 6u);
  EXPECT_EQ(resumed.dealt(), 4u);
  EXPECT_EQ(resumed.next(4), sampler.next(4));

  // Another dataset size or world size is refused by name.
  DataLoaderSampler other(41, 1, 2);
  bytes.seekg(0);
  torch::serialize::InputArchive again;
  again.load_from(bytes);
  try {
    other.load(again);
    FAIL() << "a sampler of another dataset size loaded the state";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("dealt 40 samples over 2 ranks"));
    EXPECT_THAT(e.what(), HasSubstr("deals 41 over 2"));
  }
  EXPECT_THROW(sampler.next(0), ConfigError);
}

// ---- the model holder as a class member ---------------------------------------------------------

// What a ported Trainer looks like: the wrapped model is a member, empty until wrapped.
struct Trainer {
  ddp::DistributedDataParallel<test::Mlp> model{nullptr};
  std::unique_ptr<torch::optim::SGD> optimizer;

  Trainer(test::Mlp mlp, std::shared_ptr<ProcessGroup> group) {
    model = ddp::DistributedDataParallel(mlp, std::move(group));
    optimizer = std::make_unique<torch::optim::SGD>(model->parameters(), 0.1);
  }
  void step(const torch::Tensor& x, const torch::Tensor& y) {
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    optimizer->step();
  }
};

static_assert(std::is_same_v<ddp::DistributedDataParallel<test::Mlp>::ContainedType,
                             ddp::DistributedDataParallel<test::MlpImpl>::ContainedType>,
              "the holder and the module name the same wrapper");

TEST(DdpModelHolder, AsAClassMemberItTrainsLikeTheWrapperItHolds) {
  const int port = test::free_port();
  const int world = 2, batch = 4;
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    ddp::DistributedDataParallel<test::Mlp> empty{nullptr};
    if (!empty.is_empty()) throw std::runtime_error("a nullptr holder is not empty");
    torch::manual_seed(rank);  // different starts: the wrapper copies rank 0's
    Trainer trainer(test::Mlp(), pg);
    const auto data = test::make_batches(3, world * batch, {20});
    for (int step = 0; step < 3; ++step) {
      trainer.step(data.inputs[step].narrow(0, rank * batch, batch),
                   data.targets[step].narrow(0, rank * batch, batch));
    }
    test::expect_identical_across_ranks(*pg, trainer.model->parameters(), "member model");
    // The module is reachable through the holder, and the two spellings convert.
    ddp::DistributedDataParallel<test::MlpImpl> same = trainer.model;
    if (same.ptr() != trainer.model.ptr()) throw std::runtime_error("conversion copied");
    if (trainer.model->module()->fc1->weight.size(1) != 20) throw std::runtime_error("module()");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
