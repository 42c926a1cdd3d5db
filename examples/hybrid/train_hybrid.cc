// train-hybrid: DDP with distributed RPC, as PyTorch's tutorial "Combining Distributed
// DataParallel with Distributed RPC Framework" (docs/rpc.md). Under ddprun at world W = T + 1:
//
//   rank 0       the parameter server: an EmbeddingBag(100, 16, mode sum) as a RemoteModule
//   ranks 1..T   trainers: Linear(16, 8) in DistributedDataParallel over the trainers' group,
//                applied to the remote bag's output; cross-entropy; one distributed autograd
//                context per step; DistributedOptimizer (SGD, lr 0.05) over the embedding's
//                parameters and the Linear's; a barrier among the trainers after every step
//
//   ddprun --standalone --nproc-per-node 3 train-hybrid --steps 12 [--seed S]
//          [--init-state-dict FILE] [--data FILE] [--export-state-dict FILE]
//          [--step-seconds FILE]
//
// --init-state-dict: a torch.save of {"embedding.weight": [100, 16], "fc.weight": [8, 16],
// "fc.bias": [8]}; --data: a torch.save of int64 tensors indices.<t>.<s>, offsets.<t>.<s>,
// target.<t>.<s> (trainer t = rank - 1, step s; EmbeddingBag's offsets form); without them the
// parameters come from --seed and each batch is 8 to 16 bags of 1 to 10 indices, targets 0..7.
// --export-state-dict writes the init file's keys after the last step, once every trainer's
// Linear was checked equal. Rank 0's last line:
//   final loss=<mean over trainers of step 0's loss>-><the same for the last step> param_sum=<sum>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "ddp/comm/ring_process_group.h"
#include "ddp/launch/launch_environment.h"
#include "ddp/launch/rendezvous.h"
#include "ddp/store/prefix_store.h"
#include "ddp/torch.h"

namespace {

constexpr int kRows = 100, kDim = 16, kClasses = 8;

struct Options {
  int steps = 12;
  std::uint64_t seed = 0;
  std::string init, data, export_path, step_seconds;
};

struct Batch {
  torch::Tensor indices, offsets, target;
};

Batch generated(std::uint64_t seed, int trainer, int step) {
  std::mt19937_64 random(seed * 1000003 + static_cast<std::uint64_t>(trainer) * 1009 +
                         static_cast<std::uint64_t>(step));
  const int bags = 8 + static_cast<int>(random() % 9);
  std::vector<std::int64_t> indices, offsets, target;
  for (int b = 0; b < bags; ++b) {
    offsets.push_back(static_cast<std::int64_t>(indices.size()));
    const int length = 1 + static_cast<int>(random() % 10);
    for (int i = 0; i < length; ++i)
      indices.push_back(static_cast<std::int64_t>(random() % kRows));
    target.push_back(static_cast<std::int64_t>(random() % kClasses));
  }
  auto tensor = [](const std::vector<std::int64_t>& v) { return torch::tensor(v, torch::kInt64); };
  return {tensor(indices), tensor(offsets), tensor(target)};
}

torch::Tensor entry(const ddp::StateDict& dict, const std::string& key, const std::string& file) {
  const torch::Tensor* found = dict.find(key);
  if (found == nullptr) {
    throw ddp::ConfigError(fmt::format("train-hybrid: {} has no '{}'", file, key));
  }
  return *found;
}

// A batch from --data, checked: int64, offsets that start at 0 and never decrease, indices of
// the table's rows, targets of the classes.
Batch from_file(const ddp::StateDict& data, const std::string& file, int trainer, int step) {
  Batch batch;
  const std::string suffix = fmt::format(".{}.{}", trainer, step);
  batch.indices = entry(data, "indices" + suffix, file);
  batch.offsets = entry(data, "offsets" + suffix, file);
  batch.target = entry(data, "target" + suffix, file);
  auto bad = [&](const std::string& what) {
    return ddp::ConfigError(
        fmt::format("train-hybrid: {}: {} of trainer {} step {}", file, what, trainer, step));
  };
  for (const auto* t : {&batch.indices, &batch.offsets, &batch.target}) {
    if (t->scalar_type() != torch::kInt64 || t->dim() != 1) throw bad("a tensor not 1-D int64");
  }
  const auto n = batch.indices.numel();
  const auto offsets = batch.offsets;
  if (offsets.numel() == 0 || offsets[0].item<std::int64_t>() != 0 ||
      (offsets.numel() > 1 && (offsets.diff() < 0).any().item<bool>()) ||
      offsets[-1].item<std::int64_t>() > n) {
    throw bad("offsets that do not start at 0, decrease or pass the indices");
  }
  if (n > 0 && (batch.indices.min().item<std::int64_t>() < 0 ||
                batch.indices.max().item<std::int64_t>() >= kRows)) {
    throw bad(fmt::format("an index outside the table's {} rows", kRows));
  }
  if (batch.target.numel() != offsets.numel() || batch.target.min().item<std::int64_t>() < 0 ||
      batch.target.max().item<std::int64_t>() >= kClasses) {
    throw bad(fmt::format("targets that are not one per bag in 0..{}", kClasses - 1));
  }
  return batch;
}

void copy_checked(const torch::Tensor& into, const torch::Tensor& from, const std::string& key,
                  const std::string& file) {
  if (from.sizes() != into.sizes()) {
    throw ddp::ConfigError(fmt::format("train-hybrid: {}: '{}' has shape {}, the model {}", file,
                                       key, fmt::join(from.sizes(), "x"),
                                       fmt::join(into.sizes(), "x")));
  }
  torch::NoGradGuard no_grad;
  into.copy_(from);
}

void register_embedding(const Options& options) {
  ddp::rpc::register_module(
      "embedding_bag",
      [options](const std::vector<c10::IValue>&) {
        torch::manual_seed(options.seed);
        auto bag = std::make_shared<torch::nn::EmbeddingBagImpl>(
            torch::nn::EmbeddingBagOptions(kRows, kDim).mode(torch::kSum));
        if (!options.init.empty()) {
          const auto init = ddp::read_state_dict(options.init);
          copy_checked(bag->weight, entry(init, "embedding.weight", options.init),
                       "embedding.weight", options.init);
        }
        return bag;
      },
      [](torch::nn::Module& module, const std::vector<c10::IValue>& args) {
        return c10::IValue(module.as<torch::nn::EmbeddingBagImpl>()->forward(
            args.at(0).toTensor(), args.at(1).toTensor()));
      });
}

int run(const Options& options) {
  const ddp::World world = ddp::rendezvous();
  const int rank = world.rank(), size = world.size();
  if (size < 2) {
    throw ddp::ConfigError(
        "train-hybrid: needs a parameter server and at least one trainer "
        "(ddprun --nproc-per-node 2 or more)");
  }
  const int trainers = size - 1;
  register_embedding(options);

  // The parameter server's records: each trainer's loss by step.
  std::mutex losses_mutex;
  std::map<std::pair<int, int>, double> losses;
  ddp::rpc::register_function("report_loss", [&](const std::vector<c10::IValue>& args) {
    std::lock_guard lock(losses_mutex);
    losses[{static_cast<int>(args.at(0).toInt()), static_cast<int>(args.at(1).toInt())}] =
        args.at(2).toDouble();
    return c10::IValue();
  });
  std::shared_ptr<torch::nn::LinearImpl> fc;  // the trainers' Linear (DDP's module)
  ddp::rpc::register_function("fc_state", [&](const std::vector<c10::IValue>&) {
    return c10::IValue(c10::ivalue::Tuple::create({fc->weight.detach(), fc->bias.detach()}));
  });

  ddp::rpc::RpcOptions rpc_options;
  rpc_options.store = world.store;
  rpc_options.rank = rank;
  rpc_options.world_size = size;
  ddp::rpc::init_rpc(rank == 0 ? "ps" : fmt::format("trainer{}", rank), rpc_options);

  if (rank == 0) {
    ddp::rpc::RemoteModule bag("ps", "embedding_bag");
    world.store->set("hybrid/embedding", std::to_string(bag.id()));
    std::vector<std::string> done;
    for (int t = 1; t <= trainers; ++t)
      done.push_back(fmt::format("hybrid/done/{}", t));
    world.store->wait(done, world.timeout);
    // Every trainer's Linear must be the same (DDP), then the export and the last line.
    const auto first = ddp::rpc::rpc_sync("trainer1", "fc_state").toTupleRef().elements();
    for (int t = 2; t <= trainers; ++t) {
      const auto other =
          ddp::rpc::rpc_sync(fmt::format("trainer{}", t), "fc_state").toTupleRef().elements();
      if (!torch::equal(other[0].toTensor(), first[0].toTensor()) ||
          !torch::equal(other[1].toTensor(), first[1].toTensor())) {
        throw ddp::Error(
            fmt::format("train-hybrid: trainer {}'s Linear differs from trainer "
                        "1's after the last step",
                        t));
      }
    }
    const auto embedding = bag.remote_parameters()[0].local_value().toTensor().detach();
    ddp::StateDict state;
    state.insert("embedding.weight", embedding.clone());
    state.insert("fc.weight", first[0].toTensor().clone());
    state.insert("fc.bias", first[1].toTensor().clone());
    if (!options.export_path.empty()) ddp::save_state_dict(state, options.export_path);
    double sum = 0;
    for (const auto& item : state)
      sum += item.value().to(torch::kFloat64).sum().item<double>();
    auto mean_loss = [&](int step) {
      double total = 0;
      for (int t = 0; t < trainers; ++t)
        total += losses.at({t, step});
      return total / trainers;
    };
    ddp::rpc::shutdown();
    std::printf("final loss=%.6f->%.6f param_sum=%.6f\n", mean_loss(0),
                mean_loss(options.steps - 1), sum);
    return 0;
  }

  // A trainer.
  const int trainer = rank - 1;
  auto group_store = std::make_shared<ddp::PrefixStore>("hybrid/trainers", world.store);
  auto group = ddp::make_ring_process_group(group_store, trainer, trainers, {});
  torch::manual_seed(options.seed + 1);
  fc = std::make_shared<torch::nn::LinearImpl>(kDim, kClasses);
  std::optional<ddp::StateDict> data;
  if (!options.init.empty()) {
    const auto init = ddp::read_state_dict(options.init);
    copy_checked(fc->weight, entry(init, "fc.weight", options.init), "fc.weight", options.init);
    copy_checked(fc->bias, entry(init, "fc.bias", options.init), "fc.bias", options.init);
  }
  if (!options.data.empty()) data = ddp::read_state_dict(options.data);
  ddp::DistributedDataParallel<torch::nn::LinearImpl> model(fc, group);
  const auto bag = ddp::rpc::RemoteModule::existing(
      "ps", std::stoll(world.store->get_string("hybrid/embedding", world.timeout)));
  std::vector<ddp::rpc::RRef> parameters = bag.remote_parameters();
  for (const auto& p : fc->parameters())
    parameters.push_back(ddp::rpc::RRef::local(p));
  ddp::rpc::DistributedOptimizer optimizer("sgd", {{"lr", 0.05}}, parameters);
  std::vector<double> step_seconds;  // barrier to barrier (bench/compare/compare_hybrid.py)
  group->barrier()->wait();
  auto last = std::chrono::steady_clock::now();
  for (int step = 0; step < options.steps; ++step) {
    const Batch batch = data ? from_file(*data, options.data, trainer, step)
                             : generated(options.seed, trainer, step);
    double loss_value = 0;
    {
      ddp::rpc::dist_autograd::Context context;
      const auto embedded = bag.forward({batch.indices, batch.offsets}).toTensor();
      const auto loss =
          torch::nn::functional::cross_entropy(model->forward(embedded), batch.target);
      ddp::rpc::dist_autograd::backward(context.id(), {loss});
      optimizer.step(context.id());
      loss_value = loss.item<double>();
    }
    ddp::rpc::rpc_sync("ps", "report_loss", {trainer, step, loss_value});
    group->barrier()->wait();  // every forward of the next step sees this step's updates
    const auto now = std::chrono::steady_clock::now();
    step_seconds.push_back(std::chrono::duration<double>(now - last).count());
    last = now;
  }
  if (!options.step_seconds.empty() && trainer == 0) {
    std::ofstream out(options.step_seconds);
    for (const double seconds : step_seconds)
      out << fmt::format("{:.9f}\n", seconds);
    if (!out.flush()) {
      throw ddp::Error(
          fmt::format("train-hybrid: cannot write the step times to '{}'", options.step_seconds));
    }
  }
  world.store->set(fmt::format("hybrid/done/{}", rank), "1");
  ddp::rpc::shutdown();  // serves the parameter server's last calls, then ends with everyone
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  CLI::App app{"train-hybrid: DDP with distributed RPC (PyTorch's HybridModel tutorial)"};
  app.add_option("--steps", options.steps, "training steps")->check(CLI::PositiveNumber);
  app.add_option("--seed", options.seed, "seed of the parameters and generated batches");
  app.add_option("--init-state-dict", options.init, "torch.save of the initial parameters")
      ->check(CLI::ExistingFile);
  app.add_option("--data", options.data, "torch.save of every trainer's batches")
      ->check(CLI::ExistingFile);
  app.add_option("--export-state-dict", options.export_path, "where to write the parameters");
  app.add_option("--step-seconds", options.step_seconds,
                 "where the first trainer writes each step's wall time, barrier to barrier, one "
                 "a line (bench/compare/compare_hybrid.py)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train-hybrid: %s\n", e.what());
    return 1;
  }
}
