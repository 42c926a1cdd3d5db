// TorchScript modules under DistributedDataParallel and ZeroRedundancyOptimizer (issue 27): a
// model exported by Python (Debian's torch 1.13 through /usr/bin/python3, PyTorch 2.x through
// scripts/pytorch-python; torch.jit.script and torch.jit.trace), trained in C++ at world 2, against
// one process; and the errors for modules DDP cannot wrap.
//
// The exports run at test time (export_torchscript_model.py) in the parent process, which never
// touches libtorch (the ranks are forked); a missing Python or torch skips, saying which.
#include "ddp/torch/ddp/script_distributed_data_parallel.h"

#include <gtest/gtest.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/version.h>

#include <cctype>
#include <cstdio>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "ddp/error.h"
#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/formats/state_dict.h"
#include "ddp/torch/zero/zero_redundancy_optimizer.h"
#include "support/multiprocess.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/torch/ddp_test_models.h"
#include "support/torch/ddp_test_util.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::expect_close;
using test::expect_identical_across_ranks;
using test::join_group;
using test::make_batches;
using test::make_sgd;
using test::run_ranks;

// Python with torch, by the name the tests use for it.
std::string python_of(const std::string& exporter) {
  return exporter == "pytorch2" ? test::paths::pytorch_python : "/usr/bin/python3";
}

struct Exported {
  std::string path;
  std::string torch_version;  // of the exporting Python, e.g. "2.15.0+cu132"
  std::string skip;           // why there is no file, if there is none
};

// Exports export_torchscript_model.py's `model` with `exporter`'s Python into `dir`.
Exported export_model(const std::string& exporter, const std::string& how, const std::string& model,
                      const test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  const std::string python = python_of(exporter);
  auto probe = test::Subprocess::start({python, "-c", "import torch; print(torch.__version__)"});
  const auto probed = probe.wait(120s);
  if (probed.exit_code != 0) {
    return {.skip = fmt::format(
                "{} cannot import torch ({}): {}", python,
                exporter == "pytorch2" ? "run scripts/install-deps.sh" : "install python3-torch",
                probed.output)};
  }
  const std::string path = dir.file(fmt::format("{}-{}-{}.pt", model, exporter, how));
  std::vector<std::string> command{
      python, test::paths::torchscript_export_script, "--model", model, "--how", how, "--out",
      path};
  command.insert(command.end(), extra.begin(), extra.end());
  auto run = test::Subprocess::start(command, {{"OMP_NUM_THREADS", "1"}});
  const auto done = run.wait(180s);
  if (done.exit_code != 0) {
    throw std::runtime_error(fmt::format("{} failed to export: {}", python, done.output));
  }
  // The last line is the version (warnings of newer PyTorch's jit come before it on stderr).
  std::string version, line;
  std::istringstream lines(done.output);
  while (std::getline(lines, line))
    if (!line.empty() && std::isdigit(static_cast<unsigned char>(line[0]))) version = line;
  return {.path = path, .torch_version = version};
}

// Whether an archive of PyTorch `version` is newer than the libtorch this test links.
bool newer_than_linked_libtorch(const std::string& version) {
  int major = 0, minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) != 2) return false;
  return std::make_pair(major, minor) > std::make_pair(TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR);
}

// Loads the archive in a forked process. nullopt if it loads; else the error, which skips the
// test when the archive comes from a newer PyTorch (its bytecode or operators may be unknown to
// an older libtorch: a limit of TorchScript, not of ddp) and fails it otherwise.
std::optional<std::string> load_failure(const Exported& exported) {
  const auto loaded = run_ranks(1, [&](int) { torch::jit::load(exported.path); });
  if (loaded[0].ok()) return std::nullopt;
  return test::describe(loaded);
}

enum class Optimizer { kSgd, kZeroSgd };

// World 2, per-rank batch 6, 5 steps of SGD with momentum (or the same under ZeRO stage 1) on
// the exported cnn with BatchNorm. After every step every rank holds bit-identical parameters and
// (after the next forward's broadcast) buffers; at the end rank 0's equal one process on the
// whole batch. BatchNorm normalises each rank's batch by its own statistics, so the one process
// runs the whole batch as the ranks' chunks, the loss averaged over them (what DDP's averaged
// gradients are), and keeps rank 0's chunk's running statistics (DDP broadcasts rank 0's buffers
// before each forward).
void check_trains_like_one_process(const std::string& path, Optimizer optimizer) {
  const int world = 2, batch = 6, steps = 5;
  const int port = test::free_port();
  const auto results = run_ranks(world, [&](int rank) {
    auto pg = join_group(rank, world, port);
    auto module = torch::jit::load(path);
    {
      // Different on every rank: construction must copy rank 0's.
      torch::NoGradGuard no_grad;
      for (const auto& p : module.parameters())
        p.add_(static_cast<float>(rank));
    }
    ScriptDistributedDataParallel model(module, pg);
    // The wrapper's parameters are the TorchScript module's own tensors.
    const auto wrapped = model->parameters();
    std::size_t i = 0;
    for (const auto& p : module.parameters()) {
      if (i >= wrapped.size() || !wrapped[i].is_same(p)) {
        throw std::runtime_error(fmt::format("parameters()[{}] is not the module's tensor", i));
      }
      ++i;
    }
    if (i != wrapped.size()) throw std::runtime_error("parameters() has extra tensors");
    if (!model->is_training()) throw std::runtime_error("not in the saved (training) mode");

    std::unique_ptr<torch::optim::Optimizer> opt;
    if (optimizer == Optimizer::kZeroSgd) {
      opt = std::make_unique<ZeroRedundancyOptimizer>(
          model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9), pg);
    } else {
      opt = std::make_unique<torch::optim::SGD>(make_sgd(model->parameters()));
    }
    const auto data = make_batches(steps, world * batch, {1, 12, 12});
    for (int step = 0; step < steps; ++step) {
      opt->zero_grad();
      auto x = data.inputs[step].narrow(0, rank * batch, batch);
      auto y = data.targets[step].narrow(0, rank * batch, batch);
      torch::nn::functional::cross_entropy(model->forward(x), y).backward();
      opt->step();
      expect_identical_across_ranks(*pg, model->parameters(),
                                    fmt::format("parameters after step {}", step));
    }
    model->sync_buffers();
    expect_identical_across_ranks(*pg, model->buffers(), "buffers after sync_buffers()");

    // eval() reaches the TorchScript module and its submodules (BatchNorm reads `training`).
    model->eval();
    if (module.is_training() || module.attr("bn").toModule().is_training()) {
      throw std::runtime_error("eval() did not reach the TorchScript module");
    }
    model->train();
    if (!module.attr("bn").toModule().is_training()) {
      throw std::runtime_error("train() did not reach the TorchScript module");
    }
    if (rank != 0) return;

    auto reference = torch::jit::load(path);
    std::vector<torch::Tensor> reference_params;
    for (const auto& p : reference.parameters())
      reference_params.push_back(p);
    auto ref_opt = make_sgd(reference_params);
    for (int step = 0; step < steps; ++step) {
      ref_opt.zero_grad();
      torch::Tensor loss;
      std::vector<torch::Tensor> rank0_buffers;
      for (int r = 0; r < world; ++r) {
        auto x = data.inputs[step].narrow(0, r * batch, batch);
        auto y = data.targets[step].narrow(0, r * batch, batch);
        auto chunk =
            torch::nn::functional::cross_entropy(reference.forward({x}).toTensor(), y) / world;
        loss = r == 0 ? chunk : loss + chunk;
        if (r == 0) {
          for (const auto& b : reference.buffers())
            rank0_buffers.push_back(b.clone());
        }
      }
      loss.backward();
      ref_opt.step();
      torch::NoGradGuard no_grad;
      std::size_t b = 0;
      for (const auto& buffer : reference.buffers())
        buffer.copy_(rank0_buffers[b++]);
    }
    const auto got = model->named_parameters();
    std::size_t k = 0;
    for (const auto& p : reference.named_parameters()) {
      expect_close(got[k].value(), p.value, "parameter " + p.name);
      ++k;
    }
    const auto got_buffers = model->buffers();
    std::size_t b = 0;
    for (const auto& buffer : reference.named_buffers()) {
      expect_close(got_buffers[b++].to(torch::kDouble), buffer.value.to(torch::kDouble),
                   "buffer " + buffer.name);
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

// (exporter, how): exporter "debian" = /usr/bin/python3's torch 1.13, "pytorch2" =
// scripts/pytorch-python's; how = "script" or "trace".
class ScriptDdpExports : public testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ScriptDdpExports, DdpAndZeroTrainLikeOneProcess) {
  const auto& [exporter, how] = GetParam();
  test::TempDir dir("ddp-script-ddp");
  const auto exported = export_model(exporter, how, "cnn_bn", dir);
  if (!exported.skip.empty()) GTEST_SKIP() << exported.skip;
  if (const auto failure = load_failure(exported)) {
    if (newer_than_linked_libtorch(exported.torch_version)) {
      GTEST_SKIP() << "a TorchScript archive exported by PyTorch " << exported.torch_version
                   << " does not load in the libtorch " << TORCH_VERSION
                   << " this test links (TorchScript is not forward compatible): " << *failure;
    }
    FAIL() << "torch::jit::load of an archive from PyTorch " << exported.torch_version
           << " failed: " << *failure;
  }
  check_trains_like_one_process(exported.path, Optimizer::kSgd);
  check_trains_like_one_process(exported.path, Optimizer::kZeroSgd);
}

INSTANTIATE_TEST_SUITE_P(ExportersAndMethods, ScriptDdpExports,
                         testing::Combine(testing::Values("debian", "pytorch2"),
                                          testing::Values("script", "trace")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::get<1>(info.param);
                         });

// An export by whichever Python has torch (the Debian one first), for the error tests.
Exported any_export(const test::TempDir& dir) {
  auto exported = export_model("debian", "script", "cnn_bn", dir);
  if (exported.skip.empty()) return exported;
  auto other = export_model("pytorch2", "script", "cnn_bn", dir);
  if (other.skip.empty() && !load_failure(other)) return other;
  other.skip = exported.skip + "; " + other.skip;
  return other;
}

// A TorchScript module exported from Python has Python's state dict: ddp::state_dict of the
// loaded module lists the eager model's torch.save(model.state_dict()) names in the same order
// with the same values, that file loads into it strictly, and save_state_dict of it reads back
// the same (state_dict.h).
TEST(ScriptDdp, AnExportedModulesStateDictIsPythons) {
  test::TempDir dir;
  const std::string python_state = dir.file("python_state.pt");
  const auto exported = export_model(TORCH_VERSION_MAJOR >= 2 ? "pytorch2" : "debian", "script",
                                     "cnn_bn", dir, {"--state-dict-out", python_state});
  if (!exported.skip.empty()) GTEST_SKIP() << exported.skip;
  auto module = torch::jit::load(exported.path);
  const auto expect_same = [](const StateDict& got, const StateDict& want,
                              const std::string& what) {
    ASSERT_EQ(got.keys(), want.keys()) << what;
    for (const auto& item : want)
      EXPECT_TRUE(torch::equal(got[item.key()], item.value())) << what << ": " << item.key();
  };
  const auto from_python = read_state_dict(python_state);
  expect_same(state_dict(module), from_python, "the loaded module against Python's file");
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : module.parameters())
      p.zero_();
  }
  const auto report = load_state_dict(module, python_state);
  EXPECT_TRUE(report.complete());
  expect_same(state_dict(module), from_python, "after loading Python's file");
  const std::string written = dir.file("written.pt");
  save_state_dict(module, written);
  expect_same(read_state_dict(written), from_python, "save_state_dict of the module");
}

TEST(ScriptDdp, ParametersThatDifferAcrossRanksAreNamed) {
  test::TempDir dir("ddp-script-ddp");
  const auto exported = any_export(dir);
  if (!exported.skip.empty()) GTEST_SKIP() << exported.skip;
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 10s);
        auto module = torch::jit::load(exported.path);
        if (rank == 1) {
          module.attr("fc2").toModule().setattr("weight", torch::zeros({5, 16}).requires_grad_());
        }
        try {
          ScriptDistributedDataParallel model(module, pg);
        } catch (const ddp::Error& e) {
          const std::string message = e.what();
          if (message.find("rank 0 has parameter 'fc2.weight' [4, 16] Float on cpu but rank 1 "
                           "has parameter 'fc2.weight' [5, 16] Float on cpu") ==
              std::string::npos) {
            throw std::runtime_error("message does not name the parameter and ranks: " + message);
          }
          return;
        }
        throw std::runtime_error("construction should have failed");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// The divergence guard reads the TorchScript module's live tensors: a parameter changed on one
// rank after wrapping is named at the next training forward.
TEST(ScriptDdp, DivergenceGuardNamesAParameterChangedOnOneRank) {
  test::TempDir dir("ddp-script-ddp");
  const auto exported = any_export(dir);
  if (!exported.skip.empty()) GTEST_SKIP() << exported.skip;
  const int port = test::free_port();
  const auto results = run_ranks(
      2,
      [&](int rank) {
        auto pg = join_group(rank, 2, port, 10s);
        ScriptDistributedDataParallel model(torch::jit::load(exported.path), pg,
                                            {.divergence_check_every = 1});
        if (rank == 1) {
          torch::NoGradGuard no_grad;
          model->module().attr("conv2").toModule().attr("bias").toTensor().add_(1.0);
        }
        try {
          model->forward(torch::randn({2, 1, 12, 12}));
        } catch (const ddp::Error& e) {
          const std::string message = e.what();
          if (message.find("parameter 'conv2.bias'") == std::string::npos ||
              message.find("differs on rank(s) 1") == std::string::npos) {
            throw std::runtime_error("message does not name the parameter and rank: " + message);
          }
          return;
        }
        throw std::runtime_error("the forward should have failed");
      },
      60s);
  EXPECT_ALL_RANKS_OK(results);
}

// A TorchScript module built in C++ (no Python needed): a parameter `w`, and `source` as methods.
torch::jit::Module module_with(bool requires_grad, const std::string& source) {
  torch::jit::Module module("Tiny");
  module.register_parameter("w", torch::ones({3}).requires_grad_(requires_grad),
                            /*is_buffer=*/false);
  if (!source.empty()) module.define(source);
  return module;
}

// Runs `wrap` on one rank and returns the ConfigError's message (or says there was none).
std::string config_error_of(const std::function<void(std::shared_ptr<ProcessGroup>)>& wrap) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port, 10s);
    try {
      wrap(pg);
    } catch (const ddp::ConfigError& e) {
      throw std::runtime_error(std::string("ConfigError: ") + e.what());
    }
  });
  return test::describe(results);
}

// no_sync() and a comm hook act on the TorchScript module's gradients: two micro-steps, the first
// local (rank r's gradient of sum(x * w) is r + 1), the second averaged with the accumulated
// first: (2 + 4) / 2 = 3 on both ranks, exactly, also through fp16 compression.
TEST(ScriptDdp, NoSyncAccumulatesAndCommHooksReduce) {
  for (const bool fp16 : {false, true}) {
    const int port = test::free_port();
    const auto results = run_ranks(2, [&](int rank) {
      auto pg = join_group(rank, 2, port, 10s);
      ScriptDistributedDataParallel model(
          module_with(true, "def forward(self, x):\n  return x * self.w\n"), pg);
      if (fp16) model->register_comm_hook(fp16_compress_hook(), "fp16_compress_hook");
      const auto x = torch::full({3}, static_cast<float>(rank + 1));
      {
        auto guard = model->no_sync();
        model->forward(x).sum().backward();
      }
      const auto w = model->parameters()[0];
      if (!torch::equal(w.grad(), x)) throw std::runtime_error("no_sync() synchronised");
      model->forward(x).sum().backward();
      if (!torch::equal(w.grad(), torch::full({3}, 3.0f))) {
        throw std::runtime_error(fmt::format("gradient {} after the synchronised step, not 3",
                                             w.grad()[0].item<float>()));
      }
    });
    SCOPED_TRACE(fp16 ? "fp16_compress_hook" : "no hook");
    EXPECT_ALL_RANKS_OK(results);
  }
}

// The forward runs TorchScript's unoptimised plan, so autograd has one node per operation and
// DDP's buckets can start during backward; the optimised plan (set_jit_graph_optimization(true))
// puts the forward in one DifferentiableGraph node, which this test must see, or it proves
// nothing. The thread's own setting is restored after each forward.
TEST(ScriptDdp, ForwardRecordsOneAutogradNodePerOperationUnlessAskedOtherwise) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port, 10s);
    for (const bool optimised : {false, true}) {
      ScriptDistributedDataParallel model(
          module_with(true,
                      "def forward(self, x):\n"
                      "  return torch.tanh(torch.tanh(x * self.w) * self.w) * self.w\n"),
          pg);
      model->set_jit_graph_optimization(optimised);
      std::string last_node;
      // The profiling executor optimises after its profiling runs: a few forwards.
      for (int step = 0; step < 5; ++step) {
        const auto x = torch::full({3}, 0.5f).requires_grad_();
        auto y = model->forward(x);
        last_node = y.grad_fn()->name();
        y.sum().backward();
        if (!torch::jit::getGraphExecutorOptimize()) {
          throw std::runtime_error("forward left the thread's graph optimisation off");
        }
      }
      const bool fused = last_node.find("DifferentiableGraph") != std::string::npos;
      if (fused != optimised) {
        throw std::runtime_error(fmt::format("optimisation {}: the output's autograd node is {}",
                                             optimised ? "on" : "off", last_node));
      }
    }
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(ScriptDdp, AModuleWithoutForwardIsAConfigError) {
  const auto failure = config_error_of([](auto pg) {
    ScriptDistributedDataParallel model(
        module_with(true, "def predict(self, x):\n  return x * self.w\n"), pg);
  });
  EXPECT_NE(failure.find("ConfigError: ScriptDistributedDataParallel: the TorchScript module"),
            std::string::npos)
      << failure;
  EXPECT_NE(failure.find("has no forward method"), std::string::npos) << failure;
}

TEST(ScriptDdp, AModuleWithoutTrainableParametersIsAConfigError) {
  const auto failure = config_error_of([](auto pg) {
    ScriptDistributedDataParallel model(
        module_with(false, "def forward(self, x):\n  return x * self.w\n"), pg);
  });
  EXPECT_NE(failure.find("has 1 parameters and none requires grad"), std::string::npos) << failure;
}

TEST(ScriptDdp, AForwardThatReturnsNoTensorIsNamedByTheTensorForm) {
  const int port = test::free_port();
  const auto results = run_ranks(1, [&](int rank) {
    auto pg = join_group(rank, 1, port, 10s);
    ScriptDistributedDataParallel model(
        module_with(true, "def forward(self, x):\n  return (x * self.w, x)\n"), pg);
    // No backward follows these forwards.
    torch::NoGradGuard no_grad;
    // The IValue form returns the tuple; the tensors in it are what DDP watches.
    const auto output = model->forward(std::vector<torch::jit::IValue>{torch::ones({3})});
    if (!output.isTuple()) throw std::runtime_error("the IValue form lost the tuple");
    try {
      model->forward(torch::ones({3}));
    } catch (const ddp::Error& e) {
      if (std::string(e.what()).find("returned Tuple, not a tensor") == std::string::npos) {
        throw std::runtime_error(std::string("unexpected message: ") + e.what());
      }
      return;
    }
    throw std::runtime_error("forward(tensor) should have refused a tuple");
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
