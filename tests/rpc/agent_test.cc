// The RPC agent (src/rpc/agent.h) in real processes over a real TCP store: calls to every worker
// and to oneself, every failure by its kind and with the names in it, deadlines, a worker that
// dies mid-call, the job's secret, a stranger's bytes, and many concurrent calls with none lost or
// doubled.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "net/socket.h"
#include "rpc/agent.h"
#include "support/multiprocess.h"

namespace ddp::rpc::transport {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

Bytes bytes_of(const std::string& text) {
  return Bytes(text.begin(), text.end());
}
std::string text_of(const Bytes& bytes) {
  return std::string(bytes.begin(), bytes.end());
}

std::unique_ptr<TcpStore> make_store(int rank, int port) {
  TcpStoreOptions options;
  options.is_server = rank == 0;
  options.timeout = 30s;
  options.connect_timeout = 30s;
  return std::make_unique<TcpStore>("127.0.0.1", static_cast<std::uint16_t>(port), options);
}

AgentOptions options_for(int rank, int world, std::string secret = {}) {
  AgentOptions options;
  options.name = rank == 0 ? "ps" : fmt::format("trainer{}", rank);
  options.rank = rank;
  options.world_size = world;
  options.host = "127.0.0.1";
  options.bind_host = "127.0.0.1";
  options.secret = std::move(secret);
  options.timeout = 20s;
  return options;
}

void register_echo(Agent& agent) {
  agent.register_function("echo", [](const CallerInfo& caller, Bytes in, const CallPromise& r) {
    Bytes out = bytes_of(caller.name + ":");
    out.insert(out.end(), in.begin(), in.end());
    r.complete({std::move(out)});
  });
}

TEST(RpcAgent, CallsEveryWorkerAndItselfAndNamesEveryFailure) {
  const int port = test::free_port();
  auto results = run_ranks(3, [&](int rank) {
    auto store = make_store(rank, port);
    Agent agent(*store, options_for(rank, 3));
    register_echo(agent);
    agent.register_function("throw", [](const CallerInfo&, Bytes, const CallPromise&) {
      throw std::invalid_argument("the argument was bad");
    });
    agent.register_function("later", [&agent](const CallerInfo&, Bytes in, const CallPromise& r) {
      // Completed from another thread after the handler returned.
      agent.post([in = std::move(in), r] {
        std::this_thread::sleep_for(20ms);
        r.complete({in});
      });
    });
    agent.register_function("slow", [](const CallerInfo&, Bytes, const CallPromise& r) {
      std::this_thread::sleep_for(1500ms);
      r.complete({bytes_of("too late")});
    });
    // Every worker must have registered before anyone calls (the functions are registered by
    // name on every process).
    store->set(fmt::format("ready/{}", rank), "1");
    store->wait(std::vector<std::string>{"ready/0", "ready/1", "ready/2"}, 30s);

    for (int to = 0; to < 3; ++to) {
      const Reply echo = agent.call(to, "echo", bytes_of("hello"), 10s).wait();
      require(echo.ok(), "echo failed: " + (echo.ok() ? "" : echo.failure->message));
      require(text_of(echo.payload) == agent.self().name + ":hello",
              "echo returned " + text_of(echo.payload));
      const Reply later = agent.call(to, "later", bytes_of("x"), 10s).wait();
      require(later.ok() && text_of(later.payload) == "x", "a reply completed later was lost");
    }
    const int peer = (rank + 1) % 3;
    const std::string peer_name = agent.workers()[static_cast<std::size_t>(peer)].name;

    const Reply thrown = agent.call(peer, "throw", {}, 10s).wait();
    require(!thrown.ok() && thrown.failure->kind == FailureKind::kRemoteException,
            "a throwing function did not fail as a remote exception");
    require(thrown.failure->type_name == "std::invalid_argument",
            "the exception's type came back as " + thrown.failure->type_name);
    require(contains(thrown.failure->message, "the argument was bad") &&
                contains(thrown.failure->message, "'" + peer_name + "'") &&
                contains(thrown.failure->message, "'throw'"),
            "the remote exception's text: " + thrown.failure->message);

    const Reply unknown = agent.call(peer, "nope", {}, 10s).wait();
    require(!unknown.ok() && unknown.failure->kind == FailureKind::kUnknownFunction &&
                contains(unknown.failure->message, "no function 'nope'") &&
                contains(unknown.failure->message, "echo"),
            "an unknown function: " + (unknown.ok() ? "ok" : unknown.failure->message));

    const Reply nobody = agent.call(7, "echo", {}, 10s).wait();
    require(!nobody.ok() && nobody.failure->kind == FailureKind::kUnknownWorker &&
                contains(nobody.failure->message, "rank 7"),
            "a call to rank 7 of 3 did not fail as an unknown worker");

    const auto start = std::chrono::steady_clock::now();
    const Reply slow = agent.call(peer, "slow", {}, 300ms).wait();
    const auto took = std::chrono::steady_clock::now() - start;
    require(!slow.ok() && slow.failure->kind == FailureKind::kTimeout &&
                contains(slow.failure->message, "300 ms"),
            "a call past its deadline: " + (slow.ok() ? "ok" : slow.failure->message));
    require(took < 1200ms, fmt::format("the deadline of 300 ms failed the call after {} ms",
                                       std::chrono::duration_cast<Milliseconds>(took).count()));
    // The late reply is dropped, and the connection still works.
    std::this_thread::sleep_for(1500ms);
    require(agent.call(peer, "echo", {}, 10s).wait().ok(), "the connection broke after a timeout");

    agent.shutdown(30s);
    require(agent.pending_calls() == 0, "calls left after the shut-down");
    const Reply after = agent.call(peer, "echo", {}, 10s).wait();
    require(!after.ok() && after.failure->kind == FailureKind::kShutdown,
            "a call after the shut-down did not fail as such");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RpcAgent, ThousandsOfConcurrentCallsNoneLostOrDoubled) {
  constexpr int kWorld = 4, kCalls = 2000;
  const int port = test::free_port();
  auto results = run_ranks(
      kWorld,
      [&](int rank) {
        auto store = make_store(rank, port);
        Agent agent(*store, options_for(rank, kWorld));
        std::atomic<int> served{0};
        agent.register_function("inc",
                                [&served](const CallerInfo&, Bytes in, const CallPromise& r) {
                                  ++served;
                                  std::uint64_t v = 0;
                                  require(in.size() == sizeof v, "a request of the wrong size");
                                  std::memcpy(&v, in.data(), sizeof v);
                                  ++v;
                                  Bytes out(sizeof v);
                                  std::memcpy(out.data(), &v, sizeof v);
                                  r.complete({std::move(out)});
                                });
        store->set(fmt::format("ready/{}", rank), "1");
        std::vector<std::string> ready;
        for (int r = 0; r < kWorld; ++r)
          ready.push_back(fmt::format("ready/{}", r));
        store->wait(ready, 30s);
        if (rank != 0) {
          std::vector<CallFuture> futures;
          for (std::uint64_t i = 0; i < kCalls; ++i) {
            Bytes in(sizeof i);
            const std::uint64_t v = (static_cast<std::uint64_t>(rank) << 32) | i;
            std::memcpy(in.data(), &v, sizeof v);
            futures.push_back(agent.call(0, "inc", std::move(in), 60s));
          }
          std::atomic<int> callbacks{0};
          for (auto& f : futures)
            f.then([&callbacks](const Reply&) { ++callbacks; });
          for (std::uint64_t i = 0; i < kCalls; ++i) {
            const Reply& reply = futures[i].wait();
            require(reply.ok(), "call " + std::to_string(i) +
                                    " failed: " + (reply.ok() ? "" : reply.failure->message));
            std::uint64_t v = 0;
            std::memcpy(&v, reply.payload.data(), sizeof v);
            require(v == ((static_cast<std::uint64_t>(rank) << 32) | i) + 1,
                    fmt::format("call {} got the answer to another call", i));
          }
          for (int i = 0; i < 100 && callbacks < kCalls; ++i)
            std::this_thread::sleep_for(10ms);
          require(callbacks == kCalls,
                  fmt::format("{} of {} callbacks ran", callbacks.load(), kCalls));
        }
        agent.shutdown(60s);
        if (rank == 0) {
          require(served == (kWorld - 1) * kCalls,
                  fmt::format("the server ran {} calls, {} were made", served.load(),
                              (kWorld - 1) * kCalls));
        }
      },
      150s);
  EXPECT_ALL_RANKS_OK(results);
}

// Payloads of 16 KiB and more cross in the shared-memory rings (shared_ring.h) between workers of
// one host: requests and replies intact, whatever their size against the ring (which wraps, and
// fills under concurrent calls so that some go by TCP), with attachments, and with the readers
// sleeping at once (spin 0). Both workers call each other, so each writes both kinds of frame.
TEST(RpcAgent, LargePayloadsCrossSharedMemoryIntactWhileTheRingWrapsAndFills) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    auto options = options_for(rank, 2);
    options.shared_memory_bytes = 64 << 10;  // the smallest: it wraps and fills
    options.spin_before_sleep = rank == 0 ? 0us : 100us;
    Agent agent(*store, options);
    agent.register_function("reverse", [](const CallerInfo&, Bytes in, const CallPromise& r) {
      std::reverse(in.begin(), in.end());
      r.complete({std::move(in)});
    });
    store->set(fmt::format("ready/{}", rank), "1");
    store->wait(std::vector<std::string>{"ready/0", "ready/1"}, 30s);
    const int peer = 1 - rank;
    auto payload = [](std::size_t n, std::size_t seed) {
      Bytes b(n);
      for (std::size_t i = 0; i < n; ++i)
        b[i] = static_cast<std::uint8_t>((i * 131 + seed * 17 + (i >> 8)) & 0xff);
      return b;
    };
    auto check = [&](const Reply& reply, Bytes sent, const std::string& what) {
      require(reply.ok(), what + " failed: " + (reply.ok() ? "" : reply.failure->message));
      std::reverse(sent.begin(), sent.end());
      require(reply.payload == sent, what + " came back changed");
    };
    std::size_t seed = 0;
    for (int round = 0; round < 20; ++round) {
      for (std::size_t n : {std::size_t{16} << 10, std::size_t{20000}, std::size_t{48} << 10,
                            std::size_t{64} << 10, std::size_t{200} << 10, std::size_t{100}}) {
        Bytes in = payload(n, ++seed);
        const Reply reply = agent.call(peer, "reverse", in, 20s).wait();
        check(reply, std::move(in), fmt::format("a call of {} bytes in round {}", n, round));
      }
      // Half in the message, half attached (a tensor's storage, as the torch layer sends it).
      Bytes head = payload(10000, ++seed), tail = payload(30000, ++seed);
      auto keep = std::make_shared<Bytes>(tail);
      Bytes whole = head;
      whole.insert(whole.end(), tail.begin(), tail.end());
      const Reply attached =
          agent
              .call_attached(peer, "reverse",
                             Outgoing{std::move(head), {{keep->data(), keep->size(), keep}}}, 20s)
              .wait();
      check(attached, std::move(whole), "a call with an attachment");
    }
    // Many in flight: the ring fills, and what does not fit goes by TCP, in order all the same.
    std::vector<std::pair<CallFuture, Bytes>> calls;
    for (int i = 0; i < 64; ++i) {
      Bytes in = payload(std::size_t{30} << 10, ++seed);
      calls.emplace_back(agent.call(peer, "reverse", in, 60s), std::move(in));
    }
    for (auto& [future, sent] : calls)
      check(future.wait(), std::move(sent), "a concurrent call");
    require(agent.ring_payloads_sent() > 40,
            fmt::format("only {} payloads went through shared memory", agent.ring_payloads_sent()));
    require(agent.ring_offers_refused() == 0, "a ring of one host was refused");
    agent.shutdown(30s);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Threads that spin while they wait read the connections themselves, and the connections'
// readers sleep meanwhile (agent_spin.cc): calls whose callers spin for them (as rpc_sync's do),
// with spin 0 and 100 us, beside calls nobody spins for, all complete; a call is served at once
// while the pool's spinning thread runs a handler that blocks; and bursts of frames that one recv
// brings together are not left in a buffer.
TEST(RpcAgent, SpinningCallersAndThePoolsSpinningThreadReadTheirConnectionsAndLeaveNothingBehind) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    auto options = options_for(rank, 2);
    options.threads = 4;
    Agent agent(*store, options);
    register_echo(agent);
    agent.register_function("block", [](const CallerInfo&, Bytes in, const CallPromise& r) {
      std::this_thread::sleep_for(600ms);
      r.complete({std::move(in)});
    });
    store->set(fmt::format("ready/{}", rank), "1");
    store->wait(std::vector<std::string>{"ready/0", "ready/1"}, 30s);
    const int peer = 1 - rank;
    const std::string prefix = agent.self().name + ":";
    for (const auto spin : {100us, 0us, 100us}) {
      set_spin_before_sleep(spin);
      for (int i = 0; i < 300; ++i) {
        const std::string text = fmt::format("{}-{}", i, spin.count());
        // Some nobody spins for, in flight across the spinning ones.
        CallFuture async = agent.call(peer, "echo", bytes_of("a" + text), 10s);
        const Reply reply =
            agent.call_attached(peer, "echo", Outgoing{bytes_of(text), {}}, 10s, true).take();
        require(reply.ok() && text_of(reply.payload) == prefix + text,
                "a call whose caller spun: " +
                    (reply.ok() ? text_of(reply.payload) : reply.failure->message));
        require(text_of(async.take().payload) == prefix + "a" + text, "a call nobody spun for");
      }
    }
    set_spin_before_sleep(kDefaultSpinBeforeSleep);
    // A burst: many frames at once, some arriving together in one recv.
    std::vector<CallFuture> burst;
    for (int i = 0; i < 500; ++i)
      burst.push_back(agent.call(peer, "echo", bytes_of(std::to_string(i)), 20s));
    for (int i = 0; i < 500; ++i) {
      require(
          text_of(burst[static_cast<std::size_t>(i)].take().payload) == prefix + std::to_string(i),
          fmt::format("call {} of a burst", i));
    }
    store->set(fmt::format("burst/{}", rank), "1");
    store->wait(std::vector<std::string>{"burst/0", "burst/1"}, 30s);
    if (rank == 0) {
      // The callee's spinning pool thread takes the blocking call; the next is still served at
      // once (by the connection's reader, its lease over, or another pool thread).
      CallFuture blocked = agent.call(peer, "block", bytes_of("b"), 10s);
      std::this_thread::sleep_for(50ms);
      const auto start = std::chrono::steady_clock::now();
      const Reply quick =
          agent.call_attached(peer, "echo", Outgoing{bytes_of("q"), {}}, 10s, true).take();
      const auto took = std::chrono::steady_clock::now() - start;
      require(quick.ok() && text_of(quick.payload) == prefix + "q",
              "the call beside a blocked one");
      require(took < 300ms, fmt::format("a call waited {} ms behind a blocking handler",
                                        std::chrono::duration_cast<Milliseconds>(took).count()));
      require(blocked.take().ok(), "the blocking call");
    }
    agent.shutdown(30s);
  });
  EXPECT_ALL_RANKS_OK(results);
}

// Workers that cannot share memory stay on TCP, calls intact: one whose rings are off (0) refuses
// its peer's offer and makes none; workers of different "hosts" (DDP_HOST_ID) refuse each other's.
// A ring size that is not one is refused by name before the agent starts.
TEST(RpcAgent, PeersThatCannotShareMemoryStayOnTcpAndABadRingSizeIsRefused) {
  for (const bool other_hosts : {false, true}) {
    const int port = test::free_port();
    auto results = run_ranks(2, [&](int rank) {
      if (other_hosts) ::setenv("DDP_HOST_ID", rank == 0 ? "host-a" : "host-b", 1);
      auto store = make_store(rank, port);
      auto options = options_for(rank, 2);
      if (!other_hosts && rank == 1) options.shared_memory_bytes = 0;
      Agent agent(*store, options);
      register_echo(agent);
      store->set(fmt::format("ready/{}", rank), "1");
      store->wait(std::vector<std::string>{"ready/0", "ready/1"}, 30s);
      for (int i = 0; i < 20; ++i) {
        Bytes in(std::size_t{100} << 10, static_cast<std::uint8_t>(i));
        const Reply reply = agent.call(1 - rank, "echo", in, 20s).wait();
        require(reply.ok() && reply.payload.size() == in.size() + agent.self().name.size() + 1 &&
                    std::equal(in.begin(), in.end(), reply.payload.end() - in.size()),
                "a large call over TCP failed or came back changed");
      }
      require(agent.ring_payloads_sent() == 0,
              fmt::format("{} payloads went through a ring no peer could map",
                          agent.ring_payloads_sent()));
      const bool refuses = other_hosts || rank == 1;
      require(refuses == (agent.ring_offers_refused() > 0),
              fmt::format("{} offers refused", agent.ring_offers_refused()));
      agent.shutdown(30s);
    });
    EXPECT_ALL_RANKS_OK(results);
  }
  const int port = test::free_port();
  auto store = make_store(0, port);
  auto options = options_for(0, 1);
  options.shared_memory_bytes = 1000;
  try {
    Agent agent(*store, options);
    ADD_FAILURE() << "a ring of 1000 bytes was taken";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "shared_memory_bytes of 1000")) << e.what();
  }
}

// A waiting thread spins before it sleeps for AgentOptions::spin_before_sleep (call_future.h); at 0
// it sleeps at once and calls still complete, one by one and a thousand in flight (frames that
// arrive together and straddle the reader's buffer); a spin outside 0 to 10 ms is refused by name
// before the agent starts.
TEST(RpcAgent, NoSpinBeforeSleepStillServesEveryCallAndASpinOutOfRangeIsRefused) {
  for (const auto spin : {std::chrono::microseconds(-1), std::chrono::microseconds(10'001)}) {
    auto store = make_store(0, test::free_port());
    AgentOptions options = options_for(0, 1);
    options.spin_before_sleep = spin;
    try {
      Agent agent(*store, std::move(options));
      ADD_FAILURE() << "a spin of " << spin.count() << " us was accepted";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(contains(e.what(), "spin_before_sleep of " + std::to_string(spin.count()) +
                                         " us is outside 0 to 10000 us"))
          << e.what();
    }
  }
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    AgentOptions options = options_for(rank, 2);
    options.spin_before_sleep = std::chrono::microseconds(0);
    Agent agent(*store, std::move(options));
    require(spin_before_sleep() == std::chrono::microseconds(0), "the agent did not set the spin");
    register_echo(agent);
    store->set(fmt::format("ready/{}", rank), "1");
    const std::vector<std::string> ready = {"ready/0", "ready/1"};
    store->wait(ready, 30s);
    if (rank == 1) {
      for (int i = 0; i < 50; ++i) {
        const Reply reply = agent.call(0, "echo", bytes_of(std::to_string(i)), 30s).take();
        require(reply.ok() && text_of(reply.payload) == "trainer1:" + std::to_string(i),
                "call " + std::to_string(i) + " came back wrong");
      }
      std::vector<CallFuture> futures;
      for (int i = 0; i < 1000; ++i)
        futures.push_back(
            agent.call(0, "echo", bytes_of(std::string(40, 'a') + std::to_string(i)), 30s));
      for (int i = 0; i < 1000; ++i) {
        const Reply& reply = futures[static_cast<std::size_t>(i)].wait();
        require(reply.ok() && text_of(reply.payload) ==
                                  "trainer1:" + std::string(40, 'a') + std::to_string(i),
                "call " + std::to_string(i) + " in flight came back wrong");
      }
    }
    agent.shutdown(30s);
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RpcAgent, AWorkerThatDiesMidCallIsNamedAtOnceNotAtTheDeadline) {
  const int port = test::free_port();
  auto results = run_ranks(3, [&](int rank) {
    auto store = make_store(rank, port);
    Agent agent(*store, options_for(rank, 3));
    agent.register_function("die", [](const CallerInfo&, Bytes, const CallPromise&) {
      std::this_thread::sleep_for(200ms);
      ::_exit(0);  // mid-call, with the reply never sent
    });
    register_echo(agent);
    store->set(fmt::format("ready/{}", rank), "1");
    store->wait(std::vector<std::string>{"ready/0", "ready/1", "ready/2"}, 30s);
    if (rank == 1) {
      const auto start = std::chrono::steady_clock::now();
      const Reply died = agent.call(2, "die", {}, 30s).wait();
      require(!died.ok() && died.failure->kind == FailureKind::kWorkerGone &&
                  contains(died.failure->message, "'trainer2'"),
              "a dead worker: " + (died.ok() ? "ok" : died.failure->message));
      require(std::chrono::steady_clock::now() - start < 10s, "the death was seen late");
      const Reply again = agent.call(2, "echo", {}, 30s).wait();
      require(!again.ok() && again.failure->kind == FailureKind::kWorkerGone,
              "a later call to the dead worker did not fail at once");
      store->set("done/1", "1");
    }
    if (rank == 0) store->wait(std::vector<std::string>{"done/1"}, 60s);
    if (rank != 2) agent.stop();                      // not graceful: a worker is gone
    if (rank == 2) std::this_thread::sleep_for(60s);  // dies in "die" before this ends
  });
  EXPECT_TRUE(results[0].ok()) << test::describe(results);
  EXPECT_TRUE(results[1].ok()) << test::describe(results);
}

TEST(RpcAgent, TheJobsSecretOpensConnectionsAndAWrongOrMissingOneIsRefused) {
  // trainer1's secret: the job's, another, or none while the parameter server has one.
  for (const std::string trainer_secret : {"job secret", "other secret", ""}) {
    const bool same = trainer_secret == "job secret";
    const int port = test::free_port();
    auto results = run_ranks(
        2,
        [&](int rank) {
          auto store = make_store(rank, port);
          auto options = options_for(rank, 2, rank == 1 ? trainer_secret : "job secret");
          options.timeout = 4s;
          if (same) {
            Agent agent(*store, options);
            register_echo(agent);
            require(agent.call(rank, "echo", {}, 5s).wait().ok(), "a call to oneself failed");
            agent.shutdown(20s);
            return;
          }
          std::string why;
          try {
            Agent agent(*store, options);
          } catch (const Error& e) {
            why = e.what();
          }
          require(!why.empty(), "an agent with secret '" + trainer_secret + "' started");
          // Which side sees the other's proof first is a race (the other may then see its
          // connection close): one of them must name the secret.
          store->set(fmt::format("why/{}", rank), why);
          if (rank == 0) {
            const std::string other = store->get_string("why/1", 20s);
            require(contains(why, "secret") || contains(other, "secret"),
                    "neither refusal names the secret: '" + why + "' and '" + other + "'");
          }
        },
        60s);
    EXPECT_ALL_RANKS_OK(results);
  }
}

TEST(RpcAgent, AWorldThatDoesNotAgreeIsRefusedOnEveryWorkerAtOnce) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    // The parameter server was started for three workers, trainer1 for two: the first waits for a
    // rank 2 that will never come, unless it reads trainer1's entry and refuses it at once.
    const auto start = std::chrono::steady_clock::now();
    try {
      Agent agent(*store, options_for(rank, rank == 0 ? 3 : 2));
    } catch (const ConfigError& e) {
      require(contains(e.what(), "do not agree on the world") &&
                  contains(e.what(), rank == 0 ? "for 3 workers, rank 1 ('trainer1') for 2"
                                               : "for 2 workers, rank 0 ('ps') for 3"),
              e.what());
      require(std::chrono::steady_clock::now() - start < 10s,
              "the disagreement was seen only at the deadline");
      std::this_thread::sleep_for(200ms);  // rank 0's store serves rank 1 until it has read
      return;
    }
    throw std::runtime_error("a world that does not agree was accepted");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RpcAgent, AWorkerThatNeverJoinsIsNamedAtTheDeadline) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    auto options = options_for(rank, 3);
    options.timeout = 1500ms;
    try {
      Agent agent(*store, options);
    } catch (const TimeoutError& e) {
      require(contains(e.what(), "rank(s) 2 never joined") && contains(e.what(), "1500 ms"),
              e.what());
      std::this_thread::sleep_for(200ms);
      return;
    }
    throw std::runtime_error("an agent started without its third worker");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RpcAgent, DuplicateNamesAreRefusedOnEveryWorker) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    auto options = options_for(rank, 2);
    options.name = "same";
    try {
      Agent agent(*store, options);
    } catch (const ConfigError& e) {
      require(contains(e.what(), "ranks 0 and 1 are both named 'same'"), e.what());
      std::this_thread::sleep_for(200ms);  // rank 0's store serves rank 1 until it has read
      return;
    }
    throw std::runtime_error("duplicate names were accepted");
  });
  EXPECT_ALL_RANKS_OK(results);
}

TEST(RpcAgent, AStrangersBytesCostItsConnectionAndNothingElse) {
  const int port = test::free_port();
  auto results = run_ranks(2, [&](int rank) {
    auto store = make_store(rank, port);
    auto options = options_for(rank, 2, "job secret");
    Agent agent(*store, options);
    register_echo(agent);
    if (rank == 0) {
      const auto before = agent.refused_connections();
      for (const std::string& junk :
           {std::string("GET / HTTP/1.1\r\n\r\n"), std::string(64, '\0'), std::string("DRPH")}) {
        net::Socket s = net::connect_tcp("127.0.0.1", agent.self().port, net::deadline_after(5s));
        s.send_all(junk.data(), junk.size(), net::deadline_after(5s));
        s.close();  // the truncated hello ends here
      }
      for (int i = 0; i < 200 && agent.refused_connections() < before + 3; ++i) {
        std::this_thread::sleep_for(10ms);
      }
      require(agent.refused_connections() >= before + 3,
              fmt::format("{} strangers refused", agent.refused_connections() - before));
    }
    store->set(fmt::format("ready/{}", rank), "1");
    store->wait(std::vector<std::string>{"ready/0", "ready/1"}, 30s);
    require(agent.call(1 - rank, "echo", bytes_of("z"), 10s).wait().ok(),
            "the workers' calls failed after the strangers");
    agent.shutdown(20s);
  });
  EXPECT_ALL_RANKS_OK(results);
}

}  // namespace
}  // namespace ddp::rpc::transport
