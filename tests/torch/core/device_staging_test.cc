// The staged path of CUDA buckets on a host group (src/torch/core/device_staging.h), checked on the
// CPU: ReducerOptions::staging_for_tests sends CPU buckets through host twins the same way and
// reports each step, and a recording group sees what the engine is handed. Checked: a bucket is
// copied out after its gradients were computed, the engine sees only twin addresses, the copy-in
// follows the reduction's completion, the final join comes before backward() returns, and the
// gradients equal those of the unstaged path bit for bit. Also the device errors of item 5 that a
// CPU can show, with the meta device as "another device".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>

#include "ddp/error.h"
#include "ddp/torch/checkpoint/checkpoint.h"
#include "ddp/torch/ddp/distributed_data_parallel.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "support/forwarding_group.h"
#include "support/multiprocess.h"
#include "support/temp_dir.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using test::join_group;
using test::run_ranks;
using ::testing::HasSubstr;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

struct Step {
  std::string what;       // a staging step, or "grad", "engine", "engine_done", "backward_returned"
  std::size_t index = 0;  // bucket (staging steps) or parameter ("grad")
  const void* address = nullptr;
};

// Steps from every thread, in the order they happened.
class Recorder {
 public:
  void add(std::string what, std::size_t index, const void* address) {
    std::lock_guard lock(mutex_);
    if (what == "twin") twins_[index] = address;
    steps_.push_back({std::move(what), index, address});
  }
  std::vector<Step> since(std::size_t mark) {
    std::lock_guard lock(mutex_);
    return {steps_.begin() + static_cast<std::ptrdiff_t>(mark), steps_.end()};
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return steps_.size();
  }
  std::map<std::size_t, const void*> twins() {
    std::lock_guard lock(mutex_);
    return twins_;
  }

 private:
  std::mutex mutex_;
  std::vector<Step> steps_;
  std::map<std::size_t, const void*> twins_;  // the current twin of each bucket
};

// Records the buffer of every allreduce the engine is handed, and when it completed.
class RecordingGroup : public test::ForwardingGroup {
 public:
  RecordingGroup(std::shared_ptr<ProcessGroup> inner, Recorder& recorder)
      : ForwardingGroup(std::move(inner)), recorder_(recorder) {}
  using ProcessGroup::allreduce;
  std::shared_ptr<Work> allreduce(const void* s, void* r, std::size_t n, DType d, ReduceOp op,
                                  CallOptions o) override {
    recorder_.add("engine", 0, r);
    auto work = inner().allreduce(s, r, n, d, op, o);
    // Registered before the reducer's own callbacks: runs first when the operation completes.
    work->then([this, r](Work&) { recorder_.add("engine_done", 0, r); });
    return work;
  }

 private:
  Recorder& recorder_;
};

std::size_t find_step(const std::vector<Step>& steps, const std::string& what, std::size_t index,
                      const void* address = nullptr) {
  std::size_t found = steps.size();
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& s = steps[k];
    const bool match =
        s.what == what && (address != nullptr ? s.address == address : s.index == index);
    if (!match) continue;
    require(found == steps.size(), fmt::format("step {} of {} happened twice", what, index));
    found = k;
  }
  require(found < steps.size(),
          fmt::format("step {} of bucket/parameter {} is missing", what, index));
  return found;
}

// One backward pass of the staged model: the order of its steps (see the file comment).
// `engine_gets_twins`: the default hook, whose one allreduce per bucket reduces the twin itself
// (a compressing hook hands the engine tensors it derived from the twin instead).
void check_order(const std::vector<Step>& steps,
                 const std::vector<std::vector<std::size_t>>& buckets,
                 const std::map<std::size_t, const void*>& twins, bool engine_gets_twins) {
  std::set<const void*> twin_addresses;
  for (const auto& [b, address] : twins)
    twin_addresses.insert(address);
  for (const auto& s : steps) {
    if (s.what == "engine" && engine_gets_twins) {
      require(twin_addresses.count(s.address) == 1,
              "the engine was handed memory that is not a bucket's twin");
    }
  }
  const auto join = find_step(steps, "join", 0);
  const auto returned = find_step(steps, "backward_returned", 0);
  require(join < returned, "backward returned before the final join");
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    const auto out = find_step(steps, "copy_out", b);
    for (const auto p : buckets[b]) {
      require(find_step(steps, "grad", p) < out,
              fmt::format("bucket {} was copied out before parameter {}'s gradient", b, p));
    }
    const auto copied = find_step(steps, "copied_out", b);
    const auto in = find_step(steps, "copy_in", b);
    require(out < copied && copied < in,
            fmt::format("bucket {}: copy-out, its completion and copy-in are out of order", b));
    require(in < join, fmt::format("bucket {}: copied in after the final join", b));
    if (!engine_gets_twins) continue;
    const auto engine = find_step(steps, "engine", 0, twins.at(b));
    const auto done = find_step(steps, "engine_done", 0, twins.at(b));
    require(copied < engine,
            fmt::format("bucket {}: the engine got the twin before the copy-out completed", b));
    require(engine < done && done < in,
            fmt::format("bucket {}: copied in before the reduction completed", b));
  }
}

// Two copies of one model on every rank of a world of 2, one plain and one staged (over a
// recording group), trained on the same data: gradients equal bit for bit after every backward,
// and the staged pass keeps the order.
void check_staged_equals_plain(const std::function<void(DistributedDataParallelBase&)>& setup) {
  const bool engine_gets_twins = !setup;
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    Recorder recorder;
    auto recording = std::make_shared<RecordingGroup>(pg, recorder);
    // Caps of a byte: a bucket per parameter, so that copies overlap other buckets' reductions.
    const DdpOptions plain_options{.bucket_cap_mb = 1e-6, .first_bucket_cap_mb = 1e-6};
    DdpOptions staged_options = plain_options;
    staged_options.staging_for_tests = {
        .enabled = true, .observer = [&](std::string_view what, std::size_t b, const void* twin) {
          recorder.add(std::string(what), b, twin);
        }};
    torch::manual_seed(5);
    test::Mlp plain_net;
    torch::manual_seed(5);
    test::Mlp staged_net;
    DistributedDataParallel plain(plain_net.ptr(), pg, plain_options);
    DistributedDataParallel staged(staged_net.ptr(), recording, staged_options);
    if (setup) {
      setup(*plain);
      setup(*staged);
    }
    const auto staged_params = staged->parameters();
    for (std::size_t i = 0; i < staged_params.size(); ++i) {
      auto param = staged_params[i];
      param.register_hook([&recorder, i](torch::Tensor) { recorder.add("grad", i, nullptr); });
    }
    auto plain_opt = test::make_sgd(plain->parameters());
    auto staged_opt = test::make_sgd(staged->parameters());
    const int steps = 4;
    const auto data = test::make_batches(steps, 16, {20});
    for (int step = 0; step < steps; ++step) {
      const auto x = data.inputs[step].narrow(0, rank * 8, 8);
      const auto y = data.targets[step].narrow(0, rank * 8, 8);
      plain_opt.zero_grad();
      staged_opt.zero_grad();
      torch::nn::functional::cross_entropy(plain->forward(x), y).backward();
      const auto loss = torch::nn::functional::cross_entropy(staged->forward(x), y);
      const auto mark = recorder.size();
      loss.backward();
      recorder.add("backward_returned", 0, nullptr);
      const auto buckets = staged->reducer().bucket_assignment();
      require(buckets.size() >= 3, fmt::format("only {} buckets", buckets.size()));
      check_order(recorder.since(mark), buckets, recorder.twins(), engine_gets_twins);
      const auto want = plain->parameters();
      for (std::size_t i = 0; i < want.size(); ++i) {
        require(torch::equal(staged_params[i].grad(), want[i].grad()),
                fmt::format("step {}: the staged gradient of parameter {} differs from the "
                            "unstaged one",
                            step, i));
      }
      plain_opt.step();
      staged_opt.step();
    }
    test::expect_identical_across_ranks(*pg, staged->parameters(), "staged parameters");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DeviceStaging, StagedBucketsKeepTheStreamOrderAndEqualTheUnstagedPathBitForBit) {
  check_staged_equals_plain(nullptr);
}

TEST(DeviceStaging, Fp16HookOnStagedBucketsEqualsTheUnstagedPathBitForBit) {
  // The hook's finish step runs before the copy-in (finalize_backward), not a Work callback.
  check_staged_equals_plain(
      [](DistributedDataParallelBase& model) { model.register_comm_hook(fp16_compress_hook()); });
}

TEST(DeviceStaging, PowerSgdOnStagedBucketsEqualsTheUnstagedPathBitForBit) {
  check_staged_equals_plain([](DistributedDataParallelBase& model) {
    model.register_comm_hook(powersgd_hook(std::make_shared<PowerSGDState>(
        PowerSGDOptions{.matrix_approximation_rank = 2, .start_powersgd_iter = 2})));
  });
}

// Two parameters, on the devices given. (Module::to(kMeta) is refused by libtorch 1.13, so the
// tensors are made where they belong.)
struct TwoParametersImpl : torch::nn::Module {
  TwoParametersImpl(torch::Device first, torch::Device second) {
    a = register_parameter("a", torch::ones({4}, torch::TensorOptions(first)));
    b = register_parameter("b", torch::ones({3, 2}, torch::TensorOptions(second)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * a; }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoParameters);

TEST(DeviceStaging, AModuleOnTwoDevicesIsRefusedNamingBothParameters) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    TwoParameters net(torch::Device(torch::kCPU), torch::Device(torch::kMeta));
    try {
      DistributedDataParallel model(net.ptr(), pg);
      throw std::runtime_error("a module on two devices was wrapped");
    } catch (const ConfigError& e) {
      const std::string text = e.what();
      for (const auto* part : {"rank 0:", "parameter 'a' is on cpu but parameter 'b' is on meta",
                               "module->to(device)"}) {
        require(text.find(part) != std::string::npos,
                "missing '" + std::string(part) + "' in: " + text);
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DeviceStaging, RanksWithParametersOnDifferentDeviceTypesAreNamed) {
  const int port = test::free_port();
  const auto results = run_ranks(2, [&](int rank) {
    auto pg = join_group(rank, 2, port);
    const torch::Device device(rank == 1 ? torch::kMeta : torch::kCPU);
    TwoParameters net(device, device);
    try {
      DistributedDataParallel model(net.ptr(), pg);
      throw std::runtime_error("ranks on different devices were wrapped");
    } catch (const Error& e) {
      const std::string text = e.what();
      for (const auto* part : {"rank 0 has parameter 'a' [4] Float on cpu but rank 1 has "
                               "parameter 'a' [4] Float on meta",
                               "module->to(device) on every rank"}) {
        require(text.find(part) != std::string::npos,
                "missing '" + std::string(part) + "' in: " + text);
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(DeviceStaging, CheckpointMapLocationLoadsOnTheCpuAndRefusesADeviceBeyondTheCount) {
  test::TempDir dir("ddp-map-location");
  const auto path = dir.path() / "model.pt";
  torch::manual_seed(3);
  test::Mlp saved;
  auto saved_opt = test::make_sgd(saved->parameters());
  save_checkpoint(path, *saved, saved_opt, {.epoch = 2, .tag = "mlp"});

  torch::manual_seed(4);
  test::Mlp loaded;
  auto loaded_opt = test::make_sgd(loaded->parameters());
  const auto info = load_checkpoint(path, *loaded, loaded_opt, "mlp", torch::Device(torch::kCPU));
  EXPECT_EQ(info.epoch, 2);
  for (std::size_t i = 0; i < saved->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(saved->parameters()[i], loaded->parameters()[i])) << i;

  const auto count = static_cast<int>(torch::cuda::device_count());
  const torch::Device beyond(torch::kCUDA, static_cast<c10::DeviceIndex>(count + 1));
  try {
    load_checkpoint(path, *loaded, loaded_opt, "mlp", beyond);
    FAIL() << "map_location " << beyond << " was accepted";
  } catch (const ConfigError& e) {
    EXPECT_THAT(e.what(), HasSubstr("map_location is " + beyond.str()));
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("this process sees {} CUDA device", count)));
  }
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
