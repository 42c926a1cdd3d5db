// ddp::rpc (include/ddp/torch/rpc/rpc.h) in real processes over a real TCP store: rpc_sync and
// rpc_async on tensors and plain values, every failure as RpcError of its kind or TimeoutError,
// and init_rpc's refusals.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <torch/torch.h>

#include "ddp/store/tcp_store.h"
#include "ddp/torch/rpc/dist_autograd.h"
#include "ddp/torch/rpc/distributed_optimizer.h"
#include "ddp/torch/rpc/remote_module.h"
#include "ddp/torch/rpc/rpc.h"
#include "ddp/torch/rpc/rref.h"
#include "support/multiprocess.h"
#include "support/unity_namespace.h"
#include "torch/rpc/rpc_internal.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::run_ranks;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

std::string name_of(int rank) {
  return rank == 0 ? "ps" : fmt::format("trainer{}", rank);
}

std::shared_ptr<TcpStore> store_for(int rank, int port) {
  TcpStoreOptions options;
  options.is_server = rank == 0;
  options.timeout = 30s;
  options.connect_timeout = 30s;
  return std::make_shared<TcpStore>("127.0.0.1", static_cast<std::uint16_t>(port), options);
}

rpc::RpcOptions options_for(std::shared_ptr<Store> store, int rank, int world) {
  rpc::RpcOptions options;
  options.store = std::move(store);
  options.rank = rank;
  options.world_size = world;
  options.advertise_host = "127.0.0.1";
  options.bind_host = "127.0.0.1";
  options.timeout = 20s;
  return options;
}

void register_test_functions() {
  rpc::register_function("add", [](const std::vector<c10::IValue>& args) {
    return c10::IValue(args.at(0).toTensor() + args.at(1).toTensor());
  });
  rpc::register_function("echo", [](const std::vector<c10::IValue>& args) {
    return c10::IValue(c10::ivalue::Tuple::create(args));
  });
  rpc::register_function("throw", [](const std::vector<c10::IValue>&) -> c10::IValue {
    throw std::out_of_range("index 7 is past the end");
  });
  rpc::register_function("sleep", [](const std::vector<c10::IValue>& args) {
    std::this_thread::sleep_for(std::chrono::milliseconds(args.at(0).toInt()));
    return c10::IValue();
  });
  rpc::register_function("whoami", [](const std::vector<c10::IValue>&) {
    return c10::IValue(rpc::get_worker_info().name);
  });
  rpc::register_function("table", [](const std::vector<c10::IValue>& args) {
    return c10::IValue(torch::arange(args.at(0).toInt(), torch::kFloat64));
  });
  // Takes an RRef and returns the sum of its value, fetched from wherever it lives.
  rpc::register_function("sum_rref", [](const std::vector<c10::IValue>& args) {
    return c10::IValue(rpc::RRef::from(args.at(0)).to_here().toTensor().sum().item<double>());
  });
  rpc::register_function("owned", [](const std::vector<c10::IValue>&) {
    return c10::IValue(static_cast<std::int64_t>(rpc::owned_rref_count()));
  });
  // Returns an RRef it made itself (owned here): a fork travels back in the result.
  rpc::register_function("make_rref", [](const std::vector<c10::IValue>&) {
    return rpc::remote(rpc::get_worker_info().name, "table", {4}).ivalue();
  });
}

// Polls `count` until it is `want` (the owner's releases are messages, asynchronous).
bool eventually(const std::function<std::int64_t()>& count, std::int64_t want) {
  for (int i = 0; i < 300; ++i) {
    if (count() == want) return true;
    std::this_thread::sleep_for(10ms);
  }
  return count() == want;
}

template <typename E>
E expect_throw(const std::function<void()>& call, const std::string& what) {
  try {
    call();
  } catch (const E& e) {
    return e;
  }
  throw std::runtime_error(what + ": did not throw the expected error");
}

TEST(Rpc, SyncAndAsyncCallsCarryTensorsAndValuesToEveryWorker) {
  const int port = test::free_port();
  auto results = run_ranks(3, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::init_rpc(name_of(rank), options_for(store, rank, 3));
    require(rpc::get_worker_infos().size() == 3, "not three workers");
    for (int to = 0; to < 3; ++to) {
      const std::string target = name_of(to);
      require(rpc::rpc_sync(target, "whoami").toStringRef() == target, "whoami on " + target);
      auto a = torch::arange(12, torch::kFloat64).reshape({3, 4});
      auto b = torch::full({3, 4}, 0.5, torch::kFloat64);
      require(torch::equal(rpc::rpc_sync(target, "add", {a, b}).toTensor(), a + b),
              "add on " + target);
    }
    // Values of every kind RPC carries, views of one storage among them, back unchanged.
    auto base = torch::randn({4, 6});
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("lr", 0.05);
    dict.insert("name", std::string("table"));
    c10::impl::GenericList list(c10::AnyType::get());
    list.push_back(torch::tensor({1, 2, 3}, torch::kInt64));
    list.push_back(c10::IValue());
    std::vector<c10::IValue> args{base.t(),
                                  base.narrow(1, 2, 3),
                                  torch::tensor({true, false}),
                                  torch::randn({2}).to(torch::kBFloat16),
                                  7,
                                  2.5,
                                  true,
                                  std::string("text"),
                                  dict,
                                  list,
                                  c10::IValue()};
    const auto echoed =
        rpc::rpc_sync(name_of((rank + 1) % 3), "echo", args).toTupleRef().elements();
    require(echoed.size() == args.size(), "echo lost arguments");
    require(torch::equal(echoed[0].toTensor(), base.t()), "a transposed view");
    require(torch::equal(echoed[1].toTensor(), base.narrow(1, 2, 3)), "a narrowed view");
    require(torch::equal(echoed[2].toTensor(), args[2].toTensor()), "a bool tensor");
    require(torch::equal(echoed[3].toTensor(), args[3].toTensor()), "a bfloat16 tensor");
    require(echoed[4].toInt() == 7 && echoed[5].toDouble() == 2.5 && echoed[6].toBool() &&
                echoed[7].toStringRef() == "text" && echoed[10].isNone(),
            "plain values");
    const auto back = echoed[8].toGenericDict();
    require(back.at("lr").toDouble() == 0.05 && back.at("name").toStringRef() == "table", "a dict");
    require(torch::equal(echoed[9].toListRef()[0].toTensor(), torch::tensor({1, 2, 3})) &&
                echoed[9].toListRef()[1].isNone(),
            "a list");

    // Large tensors travel from their own memory and arrive in the message's (rpc_values.h):
    // to every worker, this one included, by rpc_sync, rpc_async and remote().
    const auto large = torch::randn({1 << 18}, torch::kFloat32);  // 1 MiB
    const auto medium = torch::randn({9000}, torch::kFloat64);    // 72,000 bytes
    for (int to = 0; to < 3; ++to) {
      const std::string target = name_of(to);
      const auto sync = rpc::rpc_sync(target, "echo", {large, 3, medium.narrow(0, 5, 100), large})
                            .toTupleRef()
                            .elements();
      require(torch::equal(sync[0].toTensor(), large) && sync[1].toInt() == 3 &&
                  torch::equal(sync[2].toTensor(), medium.narrow(0, 5, 100)) &&
                  torch::equal(sync[3].toTensor(), large),
              "a large echo on " + target);
      auto async = rpc::rpc_async(target, "add", {large, large});
      async->wait();
      require(torch::equal(async->value().toTensor(), large + large), "a large add on " + target);
      require(torch::equal(rpc::remote(target, "add", {large, large}).to_here().toTensor(),
                           large + large),
              "a large remote() on " + target);
    }

    std::vector<rpc::FuturePtr> futures;
    for (int i = 0; i < 200; ++i) {
      futures.push_back(
          rpc::rpc_async(name_of(i % 3), "add", {torch::full({2}, i), torch::ones({2})}));
    }
    for (int i = 0; i < 200; ++i) {
      futures[static_cast<std::size_t>(i)]->wait();
      require(torch::equal(futures[static_cast<std::size_t>(i)]->value().toTensor(),
                           torch::full({2}, i + 1.0)),
              fmt::format("async call {}", i));
    }
    rpc::shutdown();
    require(!rpc::is_initialized(), "RPC still running after shutdown");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rpc, EveryFailureIsItsOwnErrorNamingTheWorkerAndTheFunction) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::init_rpc(name_of(rank), options_for(store, rank, 2));
    const std::string peer = name_of(1 - rank);

    const auto thrown =
        expect_throw<rpc::RpcError>([&] { rpc::rpc_sync(peer, "throw"); }, "a throwing function");
    require(thrown.kind() == rpc::RpcErrorKind::kRemoteException &&
                thrown.remote_type() == "std::out_of_range" &&
                std::string(thrown.what()).find("index 7 is past the end") != std::string::npos &&
                std::string(thrown.what()).find("'" + peer + "'") != std::string::npos,
            std::string("the remote exception: ") + thrown.what());

    const auto unknown = expect_throw<rpc::RpcError>(
        [&] { rpc::rpc_sync(peer, "no_such_function"); }, "an unknown function");
    require(unknown.kind() == rpc::RpcErrorKind::kUnknownFunction, unknown.what());

    // Arguments the callee cannot decode (bytes that are not a ddp RPC value, sent to a
    // registered function through the transport underneath): kBadArguments, naming the function.
    {
      const auto agent = rpc::detail::running_agent();
      rpc::transport::Reply reply = agent
                                        ->call(agent->find_worker(peer)->rank, "echo",
                                               rpc::transport::Bytes{'n', 'o', 't', ' ', 'a'}, 10s)
                                        .take();
      require(
          !reply.ok() && reply.failure->kind == rpc::transport::FailureKind::kBadArguments,
          "undecodable arguments: " + (reply.ok() ? std::string("ok") : reply.failure->message));
      const rpc::RpcError error = [&] {
        try {
          std::rethrow_exception(rpc::detail::error_of(*reply.failure));
        } catch (const rpc::RpcError& e) {
          return e;
        }
      }();
      require(error.kind() == rpc::RpcErrorKind::kBadArguments &&
                  std::string(error.what()).find("'echo'") != std::string::npos &&
                  std::string(error.what()).find("magic") != std::string::npos,
              error.what());
    }

    const auto nobody =
        expect_throw<rpc::RpcError>([&] { rpc::rpc_sync("nobody", "echo"); }, "an unknown worker");
    require(nobody.kind() == rpc::RpcErrorKind::kUnknownWorker &&
                std::string(nobody.what()).find("trainer1") != std::string::npos,
            nobody.what());

    const auto late = expect_throw<TimeoutError>(
        [&] { rpc::rpc_sync(peer, "sleep", {1500}, 200ms); }, "a call past its deadline");
    require(std::string(late.what()).find("200 ms") != std::string::npos, late.what());

    // A value RPC does not carry is refused on the caller, naming the function.
    const auto sparse = expect_throw<Error>(
        [&] { rpc::rpc_sync(peer, "echo", {torch::eye(3).to_sparse()}); }, "a sparse tensor");
    require(std::string(sparse.what()).find("'echo'") != std::string::npos, sparse.what());

    const auto twice = expect_throw<ConfigError>(
        [&] { rpc::init_rpc("again", options_for(store, rank, 2)); }, "a second init_rpc");
    require(std::string(twice.what()).find("runs already") != std::string::npos, twice.what());

    std::this_thread::sleep_for(1500ms);  // the sleeping call ends before the shut-down
    rpc::shutdown();
    const auto after =
        expect_throw<rpc::RpcError>([&] { rpc::rpc_sync(peer, "echo"); }, "a call after shutdown");
    require(after.kind() == rpc::RpcErrorKind::kNotInitialized, after.what());
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rpc, RRefsLiveOnTheirOwnerUntilTheLastForkAnywhereIsReleased) {
  const int port = test::free_port();
  auto results = run_ranks(3, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::init_rpc(name_of(rank), options_for(store, rank, 3));
    auto owned_on_ps = [] { return rpc::rpc_sync("ps", "owned").toInt(); };
    if (rank == 1) {
      {
        rpc::RRef table = rpc::remote("ps", "table", {5});
        require(table.owner().name == "ps" && !table.is_owner(), "the owner of a remote RRef");
        require(torch::equal(table.to_here().toTensor(), torch::arange(5, torch::kFloat64)),
                "to_here");
        require(table.confirmed_by_owner(), "not confirmed after to_here");
        // Passed on to a third worker, which fetches it from the owner.
        require(rpc::rpc_sync("trainer2", "sum_rref", {table.ivalue()}).toDouble() == 10.0,
                "a forked RRef's value on trainer2");
        require(owned_on_ps() == 1, "ps owns no value while trainer1 holds an RRef");
        const auto local =
            expect_throw<rpc::RpcError>([&] { table.local_value(); }, "local_value off the owner");
        require(local.kind() == rpc::RpcErrorKind::kRefused, local.what());
      }
      require(eventually(owned_on_ps, 0), "ps still owns the value after every fork went");

      // An RRef of this worker's own value, and one that came back in a result.
      {
        rpc::RRef mine = rpc::remote("trainer1", "table", {3});
        require(mine.is_owner() &&
                    torch::equal(mine.local_value().toTensor(), torch::arange(3, torch::kFloat64)),
                "an RRef owned here");
        require(rpc::owned_rref_count() == 1, "trainer1 does not own its value");
        rpc::RRef back = rpc::RRef::from(rpc::rpc_sync("ps", "make_rref"));
        require(back.owner().name == "ps" &&
                    torch::equal(back.to_here().toTensor(), torch::arange(4, torch::kFloat64)),
                "an RRef returned by a function");
      }
      require(eventually([] { return static_cast<std::int64_t>(rpc::owned_rref_count()); }, 0),
              "trainer1 still owns its value");
      require(eventually(owned_on_ps, 0), "ps still owns the returned RRef's value");

      // Failures come out of to_here, by name.
      const auto unknown = expect_throw<rpc::RpcError>(
          [&] { rpc::remote("ps", "no_such_function").to_here(); }, "remote of nothing");
      require(unknown.kind() == rpc::RpcErrorKind::kUnknownFunction, unknown.what());
      const auto thrown = expect_throw<rpc::RpcError>([&] { rpc::remote("ps", "throw").to_here(); },
                                                      "remote of a throwing function");
      require(thrown.kind() == rpc::RpcErrorKind::kRemoteException &&
                  thrown.remote_type() == "std::out_of_range",
              thrown.what());
      require(eventually(owned_on_ps, 0), "ps keeps the failed function's value");
      store->set("rrefs/done", "1");
    }
    store->get("rrefs/done", 60s);
    rpc::shutdown();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rpc, AnRRefOfAWorkerThatDiedFailsByNameAndNeverHangs) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::init_rpc(name_of(rank), options_for(store, rank, 2));
    if (rank == 1) {
      rpc::RRef table = rpc::remote("ps", "table", {5});
      table.to_here();
      store->set("dead/ready", "1");
      store->get("dead/gone", 30s);
      std::this_thread::sleep_for(200ms);
      const auto gone =
          expect_throw<rpc::RpcError>([&] { table.to_here(); }, "to_here of a dead owner");
      require(gone.kind() == rpc::RpcErrorKind::kWorkerGone &&
                  std::string(gone.what()).find("'ps'") != std::string::npos,
              gone.what());
      rpc::shutdown(/*graceful=*/false);
      return;
    }
    store->get("dead/ready", 30s);
    store->set("dead/gone", "1");
    std::this_thread::sleep_for(100ms);  // the store (rank 0's) answers that before it goes
    ::_exit(0);
  });
  EXPECT_TRUE(results[1].ok()) << test::describe(results);
}

TEST(Rpc, ARemoteModuleRunsOnItsWorkerAndItsParametersAreRRefsThere) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::register_module(
        "linear",
        [](const std::vector<c10::IValue>& args) {
          torch::manual_seed(args.at(2).toInt());
          return std::make_shared<torch::nn::LinearImpl>(args.at(0).toInt(), args.at(1).toInt());
        },
        [](torch::nn::Module& module, const std::vector<c10::IValue>& args) {
          return c10::IValue(module.as<torch::nn::LinearImpl>()->forward(args.at(0).toTensor()));
        });
    rpc::init_rpc(name_of(rank), options_for(store, rank, 2));
    if (rank == 1) {
      // Tells rank 0 (which holds the store) to go on even when a check below fails.
      struct Done {
        Store& store;
        ~Done() { store.set("module/done", "1"); }
      } done{*store};
      rpc::RemoteModule linear("ps", "linear", {4, 2, 7});
      const auto x = torch::randn({3, 4});
      const auto y = linear.forward({x}).toTensor();
      const auto params = linear.remote_parameters();
      require(params.size() == 2 && params[0].owner().name == "ps", "two parameters on ps");
      const auto weight = params[0].to_here().toTensor();
      const auto bias = params[1].to_here().toTensor();
      require(
          weight.sizes() == torch::IntArrayRef({2, 4}) && bias.sizes() == torch::IntArrayRef({2}),
          "the parameters' shapes");
      require(torch::allclose(y, torch::addmm(bias, x, weight.t())), "forward ran elsewhere");
      torch::manual_seed(7);
      require(torch::equal(weight, torch::nn::Linear(4, 2)->weight),
              "the module was not built from the factory's seed");
      const auto unknown = expect_throw<rpc::RpcError>(
          [&] { rpc::RemoteModule("ps", "no_such_module"); }, "an unknown module kind");
      require(
          std::string(unknown.what()).find("no module kind 'no_such_module'") != std::string::npos,
          unknown.what());
    }
    store->get("module/done", 60s);
    rpc::shutdown();
  });
  EXPECT_ALL_RANKS_OK(results);
}

// A parameter of the server's, the same on every process (seeded).
torch::Tensor server_parameter() {
  static torch::Tensor c = [] {
    torch::manual_seed(11);
    return torch::randn({3}, torch::kFloat64).requires_grad_(true);
  }();
  return c;
}

TEST(Rpc, DistributedBackwardCrossesWorkersAndLeavesGradientsInTheContext) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::register_function("scale", [](const std::vector<c10::IValue>& args) {
      return c10::IValue(args.at(0).toTensor() * server_parameter());
    });
    rpc::register_function("server_grad", [](const std::vector<c10::IValue>& args) {
      for (const auto& [tensor, grad] : rpc::dist_autograd::get_gradients(args.at(0).toInt())) {
        if (tensor.unsafeGetTensorImpl() == server_parameter().unsafeGetTensorImpl()) {
          return c10::IValue(grad);
        }
      }
      return c10::IValue();
    });
    rpc::register_function("contexts", [](const std::vector<c10::IValue>&) {
      return c10::IValue(static_cast<std::int64_t>(rpc::dist_autograd::context_count()));
    });
    rpc::init_rpc(name_of(rank), options_for(store, rank, 2));
    if (rank == 1) {
      struct Done {
        Store& store;
        ~Done() { store.set("autograd/done", "1"); }
      } done{*store};
      torch::manual_seed(3);
      const auto w = torch::randn({3}, torch::kFloat64).requires_grad_(true);
      const auto x = torch::randn({3}, torch::kFloat64);
      const auto c = server_parameter().detach();
      std::int64_t id = 0;
      {
        rpc::dist_autograd::Context context;
        id = context.id();
        const auto y = rpc::rpc_sync("ps", "scale", {w * 2}).toTensor();
        require(y.requires_grad(), "the result of a call on a sent tensor does not require grad");
        rpc::dist_autograd::backward(context.id(), {(y * x).sum()});
        const auto grads = rpc::dist_autograd::get_gradients(context.id());
        require(
            grads.size() == 1 && grads[0].first.unsafeGetTensorImpl() == w.unsafeGetTensorImpl(),
            "the trainer's context holds one gradient, w's");
        require(torch::allclose(grads[0].second, 2 * x * c), "w's gradient crossed two workers");
        require(!w.grad().defined(), "the distributed backward wrote .grad");
        const auto server = rpc::rpc_sync("ps", "server_grad", {context.id()}).toTensor();
        require(torch::allclose(server, 2 * w.detach() * x), "the server parameter's gradient");
      }
      require(eventually([] { return rpc::rpc_sync("ps", "contexts").toInt(); }, 0),
              "the server kept the context after it ended");
      require(rpc::dist_autograd::context_count() == 0, "the trainer kept its context");
      const auto ended = expect_throw<rpc::RpcError>(
          [&] { rpc::dist_autograd::backward(id, {torch::ones({1}, torch::kFloat64)}); },
          "a backward of an ended context");
      require(ended.kind() == rpc::RpcErrorKind::kRefused &&
                  std::string(ended.what()).find(std::to_string(id)) != std::string::npos,
              ended.what());
      const std::int64_t never = id + 1000003;  // no worker ever made this context
      const auto unknown = expect_throw<rpc::RpcError>(
          [&] { rpc::dist_autograd::backward(never, {torch::ones({1}, torch::kFloat64)}); },
          "a backward of a context never created");
      require(unknown.kind() == rpc::RpcErrorKind::kRefused &&
                  std::string(unknown.what()).find(std::to_string(never)) != std::string::npos,
              unknown.what());
    }
    store->get("autograd/done", 60s);
    rpc::shutdown();
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(Rpc, ADistributedOptimizerStepsARemoteModuleAndLocalParametersAsOneProcessWould) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = store_for(rank, port);
    register_test_functions();
    rpc::register_module(
        "linear64",
        [](const std::vector<c10::IValue>& args) {
          torch::manual_seed(args.at(2).toInt());
          auto m = std::make_shared<torch::nn::LinearImpl>(args.at(0).toInt(), args.at(1).toInt());
          m->to(torch::kFloat64);
          return m;
        },
        [](torch::nn::Module& module, const std::vector<c10::IValue>& args) {
          return c10::IValue(module.as<torch::nn::LinearImpl>()->forward(args.at(0).toTensor()));
        });
    rpc::init_rpc(name_of(rank), options_for(store, rank, 2));
    if (rank == 1) {
      struct Done {
        Store& store;
        ~Done() { store.set("optim/done", "1"); }
      } done{*store};
      rpc::RemoteModule remote_linear("ps", "linear64", {3, 2, 7});
      torch::manual_seed(5);
      torch::nn::Linear local(2, 1);
      local->to(torch::kFloat64);
      auto params = remote_linear.remote_parameters();
      for (const auto& p : local->parameters())
        params.push_back(rpc::RRef::local(p));
      rpc::DistributedOptimizer optimizer("sgd", {{"lr", 0.1}, {"momentum", 0.9}}, params);
      torch::manual_seed(9);
      const auto x = torch::randn({4, 3}, torch::kFloat64);
      for (int step = 0; step < 3; ++step) {
        rpc::dist_autograd::Context context;
        const auto y = remote_linear.forward({x}).toTensor();
        rpc::dist_autograd::backward(context.id(), {local->forward(y).pow(2).sum()});
        optimizer.step(context.id());
      }
      // The same three steps in one process.
      torch::manual_seed(7);
      torch::nn::Linear ref_remote(3, 2);
      ref_remote->to(torch::kFloat64);
      torch::manual_seed(5);
      torch::nn::Linear ref_local(2, 1);
      ref_local->to(torch::kFloat64);
      std::vector<torch::Tensor> all = ref_remote->parameters();
      for (const auto& p : ref_local->parameters())
        all.push_back(p);
      torch::optim::SGD ref(all, torch::optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 3; ++step) {
        ref.zero_grad();
        ref_local->forward(ref_remote->forward(x)).pow(2).sum().backward();
        ref.step();
      }
      for (std::size_t i = 0; i < 2; ++i) {
        require(torch::allclose(params[i].to_here().toTensor(), ref_remote->parameters()[i], 1e-12,
                                1e-12),
                fmt::format("remote parameter {} after three steps", i));
        require(torch::allclose(local->parameters()[i], ref_local->parameters()[i], 1e-12, 1e-12),
                fmt::format("local parameter {} after three steps", i));
      }
      const auto bad = expect_throw<ConfigError>(
          [&] {
            rpc::DistributedOptimizer("sgd", {{"lr", 0.1}, {"beta1", 0.9}}, params);
          },
          "an option SGD does not have");
      require(std::string(bad.what()).find("'beta1'") != std::string::npos, bad.what());
    }
    store->get("optim/done", 60s);
    rpc::shutdown();
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
