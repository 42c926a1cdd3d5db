// State dicts and optimizer state across Python and C++ (state_dict.h, optimizer_state_dict.h):
// files PyTorch wrote load into libtorch modules and optimizers and continue on Python's
// trajectory; files ddp writes load in PyTorch and continue on C++'s; files that are not state
// dicts, or do not fit, fail with named errors and change nothing.
//
// The Python side is state_dict_reference.py, run with the Python of this build's libtorch
// (test::paths::state_dict_python: Debian's /usr/bin/python3 with torch 1.13, or PyTorch 2.x's
// scripts/pytorch-python) and, in one test, with the other one
// (test::paths::state_dict_other_python). Tests that need a Python skip, saying which, where it
// cannot import torch.
#include <filesystem>
#include <fstream>

#include <caffe2/serialize/inline_container.h>
#include <gtest/gtest.h>
#include <torch/script.h>

#include "ddp/torch/formats/optimizer_state_dict.h"
#include "ddp/torch/formats/state_dict.h"
#include "support/subprocess.h"
#include "support/temp_dir.h"
#include "support/test_paths.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using namespace std::string_literals;
namespace fs = std::filesystem;

constexpr int kSteps = 3;  // N and K of state_dict_reference.py
constexpr double kTolerance = 1e-5;
const std::vector<std::string> kOptimizers{"sgd", "adam", "adamw"};

torch::nn::Sequential make_model() {  // state_dict_reference.py's make_model
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3)),
                               torch::nn::ReLU(), torch::nn::BatchNorm2d(2), torch::nn::Flatten(),
                               torch::nn::Linear(8, 3));
}

// state_dict_reference.py's make_optimizer; other: settings a load must replace.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& name,
                                                        std::vector<torch::Tensor> params,
                                                        bool other = false) {
  if (name == "sgd") {
    if (other)
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(1.0).momentum(0.1));
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3).nesterov(true));
  }
  if (name == "adam") {
    if (other)
      return std::make_unique<torch::optim::Adam>(params,
                                                  torch::optim::AdamOptions(1.0).amsgrad(true));
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01)
                                                            .betas({0.8, 0.95})
                                                            .eps(1e-7)
                                                            .weight_decay(1e-3)
                                                            .amsgrad(true));
  }
  if (other) return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1.0));
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(0.01).betas({0.9, 0.98}).weight_decay(0.05));
}

void train(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer, const StateDict& data,
           int steps) {
  model->train();
  for (int i = 0; i < steps; ++i) {
    optimizer.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(data["x"]), data["y"]).backward();
    optimizer.step();
  }
}

double largest_difference(const StateDict& a, const StateDict& b) {
  double largest = 0;
  for (const auto& item : a) {
    const auto* other = b.find(item.key());
    if (other == nullptr) return INFINITY;
    largest = std::max(
        largest,
        (item.value().to(torch::kDouble) - other->to(torch::kDouble)).abs().max().item<double>());
  }
  return largest;
}

StateDict clone_all(const StateDict& tensors) {
  StateDict copies;
  for (const auto& item : tensors)
    copies.insert(item.key(), item.value().clone());
  return copies;
}

bool equal_all(const StateDict& a, const StateDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& item : a) {
    const auto* other = b.find(item.key());
    if (other == nullptr || !torch::equal(item.value(), *other)) return false;
  }
  return true;
}

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}
void write_bytes(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<long>(bytes.size()));
}

// The Python, or the reason it cannot run the reference (empty when it can).
std::string python_missing(const std::string& python) {
  auto probe = test::Subprocess::start({python, "-c", "import torch"});
  const auto probed = probe.wait(60s);
  return probed.exit_code == 0 ? "" : python + " cannot import torch: " + probed.output;
}

// The reference's one run: checks what save_for_python wrote, then writes what
// load_from_python reads. Returns its failure ("" when it passed).
std::string run_reference(const std::string& python, const fs::path& dir) {
  auto run = test::Subprocess::start(
      {python, test::paths::state_dict_reference_script, "exchange", dir.string()},
      {{"OMP_NUM_THREADS", "1"}});
  const auto done = run.wait(120s);
  return done.exit_code == 0 ? "" : python + " exchange:\n" + done.output;
}

// Python -> C++: the model loads under Python's names and computes Python's forward; each
// optimizer continues Python's run on its trajectory.
void load_from_python(const fs::path& dir) {
  auto model = make_model();
  const auto report = load_state_dict(*model, dir / "py_model.pt");
  EXPECT_TRUE(report.complete());
  EXPECT_EQ(report.loaded.size(), 9u);  // conv 2, batchnorm 5 (num_batches_tracked too), linear 2
  const auto forward = read_state_dict(dir / "py_forward.pt");
  model->eval();
  EXPECT_LE((model->forward(forward["input"]) - forward["output"]).abs().max().item<double>(),
            kTolerance);

  const auto data = read_state_dict(dir / "data.pt");
  for (const auto& name : kOptimizers) {
    SCOPED_TRACE(name);
    torch::manual_seed(7);
    auto net = make_model();
    auto optimizer = make_optimizer(name, net->parameters(), /*other=*/true);
    load_state_dict(*net, dir / ("py_" + name + "_model.pt"));
    load_optimizer_state_dict(*optimizer, dir / ("py_" + name + "_optim.pt"));
    train(net, *optimizer, data, kSteps);
    const auto want = read_state_dict(dir / ("py_" + name + "_after.pt"));
    EXPECT_LE(largest_difference(state_dict(*net), want), kTolerance);
  }
}

// C++ -> Python: the training data both sides use, and what the reference loads and continues.
void save_for_python(const fs::path& dir) {
  torch::manual_seed(0);
  StateDict data;
  data.insert("x", torch::randn({8, 1, 4, 4}));
  data.insert("y", torch::randint(0, 3, {8}, torch::kLong));
  save_state_dict(data, dir / "data.pt");
  torch::manual_seed(3);
  auto model = make_model();
  model->forward(data["x"]);  // BatchNorm statistics off their initial values
  save_state_dict(*model, dir / "cpp_model.pt");
  model->eval();
  StateDict forward;
  forward.insert("input", data["x"]);
  forward.insert("output", model->forward(data["x"]).detach());
  save_state_dict(forward, dir / "cpp_forward.pt");
  for (const auto& name : kOptimizers) {
    torch::manual_seed(4);
    auto net = make_model();
    auto optimizer = make_optimizer(name, net->parameters());
    train(net, *optimizer, data, kSteps);
    save_state_dict(*net, dir / ("cpp_" + name + "_model.pt"));
    save_optimizer_state_dict(*optimizer, dir / ("cpp_" + name + "_optim.pt"));
    train(net, *optimizer, data, kSteps);
    save_state_dict(*net, dir / ("cpp_" + name + "_after.pt"));
  }
}

// --- with the Python of this build ---

// One test, so one run of the reference (CTest runs each test in a process of its own, and
// importing PyTorch 2.x takes seconds).
TEST(StateDictWithPython, BothDirectionsNamesAndFilesThatAreNotStateDicts) {
  const std::string python = test::paths::state_dict_python;
  if (const auto missing = python_missing(python); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-state-dict-test");
  save_for_python(dir.path());
  ASSERT_EQ(run_reference(python, dir.path()), "");  // it checked what C++ saved
  load_from_python(dir.path());

  // Python's names, in Python's order.
  EXPECT_EQ(state_dict(*make_model()).keys(), read_state_dict(dir.path() / "py_model.pt").keys());

  auto model = make_model();
  const auto before = clone_all(state_dict(*model));
  try {
    load_state_dict(*model, dir.path() / "full_model.pt");
    ADD_FAILURE() << "a pickled model loaded";
  } catch (const UnsafePickleError& e) {
    EXPECT_NE(std::string(e.what()).find("torch.nn.modules.container.Sequential"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("whole pickled model"), std::string::npos) << e.what();
  }
  try {
    load_state_dict(*model, dir.path() / "os_system.pt");
    ADD_FAILURE() << "a pickle with os.system loaded";
  } catch (const UnsafePickleError& e) {
    EXPECT_TRUE(e.global_name() == "posix.system" || e.global_name() == "os.system")
        << e.global_name();
  }
  EXPECT_THROW(
      {
        try {
          load_state_dict(*model, dir.path() / "scripted.pt");
        } catch (const StateDictFormatError& e) {
          EXPECT_NE(std::string(e.what()).find("TorchScript archive"), std::string::npos);
          throw;
        }
      },
      StateDictFormatError);
  EXPECT_THROW(
      {
        try {
          load_state_dict(*model, dir.path() / "legacy.pt");
        } catch (const StateDictFormatError& e) {
          EXPECT_NE(std::string(e.what()).find("legacy (non-zip) format"), std::string::npos);
          throw;
        }
      },
      StateDictFormatError);
  // An optimizer state for another optimizer, another parameter count.
  auto adam = make_optimizer("adam", model->parameters());
  EXPECT_THROW(load_optimizer_state_dict(*adam, dir.path() / "py_sgd_optim.pt"),
               OptimizerMismatchError);
  auto sgd_of_fewer = make_optimizer("sgd", {model->parameters()[0]});
  try {
    load_optimizer_state_dict(*sgd_of_fewer, dir.path() / "py_sgd_optim.pt");
    ADD_FAILURE() << "an optimizer state of 6 parameters loaded into one of 1";
  } catch (const OptimizerMismatchError& e) {
    EXPECT_EQ(e.stored(), "1 parameter group(s) of 6 parameter(s)");
    EXPECT_EQ(e.current(), "1 parameter group(s) of 1 parameter(s)");
  }
  EXPECT_TRUE(equal_all(before, state_dict(*model)));
}

// --- with the other Python (PyTorch 2.x beside Debian's 1.13 and the reverse) ---

TEST(StateDictWithOtherPython, BothDirections) {
  const std::string python = test::paths::state_dict_other_python;
  if (const auto missing = python_missing(python); !missing.empty()) GTEST_SKIP() << missing;
  test::TempDir dir("ddp-state-dict-other");
  save_for_python(dir.path());
  ASSERT_EQ(run_reference(python, dir.path()), "");
  load_from_python(dir.path());
}

// --- C++ only ---

TEST(StateDict, MismatchedNamesShapesAndDtypesAreListedAndNothingLoads) {
  test::TempDir dir("ddp-state-dict-mismatch");
  torch::nn::Sequential saved(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
  save_state_dict(*saved, dir.path() / "saved.pt");

  torch::nn::Sequential other(torch::nn::Linear(4, 5), torch::nn::Linear(5, 2),
                              torch::nn::Linear(2, 2));
  other[1]->as<torch::nn::Linear>()->bias.set_data(
      other[1]->as<torch::nn::Linear>()->bias.to(torch::kDouble));
  const auto before = clone_all(state_dict(*other));
  try {
    load_state_dict(*other, dir.path() / "saved.pt");
    ADD_FAILURE() << "loaded";
  } catch (const StateDictMismatchError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("missing key(s): \"2.weight\", \"2.bias\""), std::string::npos)
        << message;
    EXPECT_NE(message.find("0.weight: [3, 4] Float in"), std::string::npos) << message;
    EXPECT_NE(message.find("[5, 4] Float in the module"), std::string::npos) << message;
    EXPECT_NE(message.find("1.bias: [2] Float in"), std::string::npos) << message;
    EXPECT_NE(message.find("[2] Double in the module"), std::string::npos) << message;
    EXPECT_EQ(e.report().mismatched.size(), 4u);  // 0.weight, 0.bias, 1.weight, 1.bias
  }
  EXPECT_TRUE(equal_all(before, state_dict(*other)));

  // strict=false loads what fits and reports the rest.
  torch::nn::Sequential wider(torch::nn::Linear(4, 3), torch::nn::Linear(3, 7));
  const auto report = load_state_dict(*wider, dir.path() / "saved.pt", {.strict = false});
  EXPECT_EQ(report.loaded, (std::vector<std::string>{"0.weight", "0.bias"}));
  EXPECT_EQ(report.mismatched.size(), 2u);
  EXPECT_TRUE(torch::equal(wider[0]->as<torch::nn::Linear>()->weight,
                           saved[0]->as<torch::nn::Linear>()->weight));

  // Unexpected names.
  torch::nn::Sequential fewer(torch::nn::Linear(4, 3));
  try {
    load_state_dict(*fewer, dir.path() / "saved.pt");
    ADD_FAILURE() << "loaded";
  } catch (const StateDictMismatchError& e) {
    EXPECT_EQ(e.report().unexpected, (std::vector<std::string>{"1.weight", "1.bias"}));
  }
}

TEST(StateDict, TruncatedCorruptedAndForeignFilesFailNamed) {
  test::TempDir dir("ddp-state-dict-bad");
  torch::nn::Sequential model(torch::nn::Linear(64, 64));
  save_state_dict(*model, dir.path() / "good.pt");
  const auto good = read_bytes(dir.path() / "good.pt");

  auto truncated = good;
  truncated.resize(good.size() / 2);
  write_bytes(dir.path() / "truncated.pt", truncated);
  auto corrupted = good;  // the end of the central directory: where every zip read starts
  for (std::size_t i = corrupted.size() - 22; i < corrupted.size(); ++i)
    corrupted[i] ^= 0x5a;
  write_bytes(dir.path() / "corrupted.pt", corrupted);
  write_bytes(dir.path() / "text.pt", {'h', 'e', 'l', 'l', 'o'});

  const auto before = clone_all(state_dict(*model));
  for (const char* name : {"truncated.pt", "corrupted.pt", "text.pt"}) {
    try {
      load_state_dict(*model, dir.path() / name);
      ADD_FAILURE() << name << " loaded";
    } catch (const StateDictFormatError& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(load_state_dict(*model, dir.path() / "absent.pt"), ConfigError);
  EXPECT_TRUE(equal_all(before, state_dict(*model)));
}

// A pickle naming a global outside the allowlist is refused before anything is built from it,
// whichever opcode names it (GLOBAL, STACK_GLOBAL), and objects (NEWOBJ) are refused too.
TEST(StateDict, PicklesWithOtherGlobalsAreRefused) {
  test::TempDir dir("ddp-state-dict-unsafe");
  auto write_pickle = [&](const std::string& name, const std::string& pickle) {
    const auto path = dir.path() / name;
    caffe2::serialize::PyTorchStreamWriter zip(path.string());
    zip.writeRecord("data.pkl", pickle.data(), pickle.size());
    zip.writeEndOfFile();
    return path;
  };
  // os.system("true") at protocol 2 and 4.
  const auto global = write_pickle("global.pt",
                                   "\x80\x02"
                                   "cposix\nsystem\n"
                                   "X\x04\x00\x00\x00true"
                                   "\x85R."s);
  const auto stack_global = write_pickle("stack_global.pt",
                                         "\x80\x04"
                                         "\x8c\x02os"
                                         "\x8c\x06system"
                                         "\x93"
                                         "\x8c\x04true"
                                         "\x85R."s);
  const auto newobj = write_pickle("newobj.pt",
                                   "\x80\x02"
                                   "ccollections\nOrderedDict\n"
                                   ")\x81."s);
  for (const auto& [path, global_name] :
       {std::pair{global, "posix.system"}, std::pair{stack_global, "os.system"},
        std::pair{newobj, ""}}) {
    try {
      read_state_dict(path);
      ADD_FAILURE() << path << " loaded";
    } catch (const UnsafePickleError& e) {
      EXPECT_EQ(e.global_name(), global_name) << e.what();
    }
  }
}

TEST(StateDict, RoundTripKeepsValuesDtypesViewsAndTorchScriptModules) {
  test::TempDir dir("ddp-state-dict-roundtrip");
  StateDict tensors;
  auto base = torch::arange(24, torch::kFloat64).reshape({4, 6});
  tensors.insert("double", base);
  tensors.insert("view", base.t().slice(0, 1, 3));  // shares base's storage, not contiguous
  tensors.insert("half", torch::randn({3}).to(torch::kHalf));
  tensors.insert("int64", torch::tensor(int64_t{1} << 40));
  tensors.insert("bool", torch::tensor({true, false}));
  tensors.insert("empty", torch::empty({0, 3}));
  save_state_dict(tensors, dir.path() / "all.pt");
  const auto loaded = read_state_dict(dir.path() / "all.pt");
  ASSERT_EQ(loaded.keys(), tensors.keys());
  for (const auto& item : tensors) {
    EXPECT_TRUE(torch::equal(loaded[item.key()], item.value())) << item.key();
    EXPECT_EQ(loaded[item.key()].scalar_type(), item.value().scalar_type()) << item.key();
  }
  // The view still shares the storage after loading, as in Python.
  EXPECT_EQ(loaded["view"].storage().data_ptr().get(), loaded["double"].storage().data_ptr().get());

  // A TorchScript module: its named parameters and buffers, both ways.
  torch::jit::Module scripted("m");
  scripted.register_parameter("weight", torch::randn({2, 2}), false);
  scripted.register_buffer("running", torch::zeros({2}));
  torch::jit::Module child("c");
  child.register_parameter("bias", torch::randn({2}), false);
  scripted.register_module("child", child);
  save_state_dict(scripted, dir.path() / "scripted.pt");
  EXPECT_EQ(read_state_dict(dir.path() / "scripted.pt").keys(),
            (std::vector<std::string>{"weight", "running", "child.bias"}));
  const auto saved = clone_all(state_dict(scripted));
  torch::NoGradGuard no_grad;
  for (auto& item : state_dict(scripted))
    item.value().zero_();
  load_state_dict(scripted, dir.path() / "scripted.pt");
  EXPECT_TRUE(equal_all(saved, state_dict(scripted)));
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
