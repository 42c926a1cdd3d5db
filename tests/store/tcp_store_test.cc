// TcpStore and TcpStoreServer through the public API: every operation, blocking and deadlines,
// concurrency, connection set-up and loss.
#include "ddp/store/tcp_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/error.h"
#include "net/socket.h"
#include "store/protocol.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using net::Clock;
using testing::HasSubstr;

constexpr Milliseconds kTestTimeout{5'000};

TcpStoreOptions client_options() {
  return {.timeout = kTestTimeout, .connect_timeout = kTestTimeout};
}

TcpStoreOptions server_options() {
  return {.is_server = true,
          .timeout = kTestTimeout,
          .connect_timeout = kTestTimeout,
          .listen_host = "127.0.0.1"};
}

// Polls `condition` until it holds or `timeout` passes; returns whether it held.
bool eventually(const std::function<bool()>& condition, Milliseconds timeout = kTestTimeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return condition();
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

// A thread whose exception becomes a test failure instead of std::terminate.
class Background {
 public:
  explicit Background(std::function<void()> fn)
      : thread_([this, fn = std::move(fn)] {
          try {
            fn();
          } catch (const std::exception& e) {
            error_ = e.what();
          }
        }) {}
  ~Background() {
    if (thread_.joinable()) thread_.join();
  }
  // Joins and returns the exception's message ("" when the function returned).
  std::string join() {
    thread_.join();
    return error_;
  }

 private:
  std::string error_;
  std::thread thread_;
};

class TcpStoreTest : public testing::Test {
 protected:
  TcpStore server_store_{"127.0.0.1", 0, server_options()};
  TcpStoreServer& server_ = *server_store_.server();

  TcpStore client() { return TcpStore("127.0.0.1", server_store_.port(), client_options()); }
};

TEST_F(TcpStoreTest, PortZeroPicksARealPort) {
  EXPECT_NE(server_store_.port(), 0);
  EXPECT_EQ(server_store_.port(), server_.port());
}

TEST_F(TcpStoreTest, SetThenGetFromAnotherClientRoundTripsBytes) {
  auto other = client();
  const Bytes binary = {0, 1, 2, 255, 0, 10};
  server_store_.set("bin", binary);
  server_store_.set("text", "hello");
  server_store_.set("empty", "");
  EXPECT_EQ(other.get("bin"), binary);
  EXPECT_EQ(other.get_string("text"), "hello");
  EXPECT_EQ(other.get_string("empty"), "");
  other.set("text", "replaced");
  EXPECT_EQ(server_store_.get_string("text"), "replaced");
}

TEST_F(TcpStoreTest, LargeValueRoundTrips) {
  Bytes big(8 * 1024 * 1024);
  for (std::size_t i = 0; i < big.size(); ++i)
    big[i] = static_cast<std::uint8_t>(i * 31);
  auto other = client();
  other.set("big", big);
  EXPECT_EQ(server_store_.get("big"), big);
}

TEST_F(TcpStoreTest, GetBlocksUntilAnotherClientSetsTheKey) {
  std::string value;
  Background getter([&] {
    auto store = client();
    value = store.get_string("late", kTestTimeout);
  });
  ASSERT_TRUE(eventually([&] { return server_.num_parked_requests() == 1; }));
  EXPECT_TRUE(value.empty());
  server_store_.set("late", "arrived");
  EXPECT_EQ(getter.join(), "");
  EXPECT_EQ(value, "arrived");
  // The server may answer the parked get before it drops it from its count: the client can hold
  // the value a moment before the count reaches 0 (seen under ASan).
  EXPECT_TRUE(eventually([&] { return server_.num_parked_requests() == 0; }));
}

TEST_F(TcpStoreTest, ParkedGetDoesNotBlockOtherClients) {
  Background getter([&] {
    auto store = client();
    EXPECT_EQ(store.get_string("gate", kTestTimeout), "open");
  });
  ASSERT_TRUE(eventually([&] { return server_.num_parked_requests() == 1; }));
  auto other = client();
  for (int i = 0; i < 100; ++i)
    other.add("busy", 1);
  EXPECT_EQ(other.get_string("busy"), "100");
  server_store_.set("gate", "open");
  EXPECT_EQ(getter.join(), "");
}

TEST_F(TcpStoreTest, GetTimesOutWithinItsDeadlineNamingTheKeyAndStaysUsable) {
  auto store = client();
  const auto start = Clock::now();
  const std::string message = message_of([&] { store.get("never/set", 200ms); });
  const auto elapsed = Clock::now() - start;
  EXPECT_THAT(message, HasSubstr("'never/set'"));
  EXPECT_THAT(message, HasSubstr("200 ms"));
  EXPECT_GE(elapsed, 200ms);
  EXPECT_LT(elapsed, 2s);
  EXPECT_THROW(store.get("never/set", 50ms), TimeoutError);
  // The server dropped the parked request, and the connection is still in step.
  EXPECT_TRUE(eventually([&] { return server_.num_parked_requests() == 0; }));
  store.set("after", "ok");
  EXPECT_EQ(store.get_string("after"), "ok");
}

TEST_F(TcpStoreTest, WaitTimeoutNamesOnlyTheMissingKeys) {
  server_store_.set("present", "1");
  const std::vector<std::string> keys = {"present", "absent/1", "absent/2"};
  const std::string message = message_of([&] { server_store_.wait(keys, 100ms); });
  EXPECT_THAT(message, HasSubstr("keys still missing: 'absent/1', 'absent/2' ("));
  EXPECT_THAT(message, HasSubstr("100 ms"));
  EXPECT_THROW(server_store_.wait(keys, 10ms), TimeoutError);
}

TEST_F(TcpStoreTest, WaitReturnsOnceEveryKeyExists) {
  std::atomic<bool> done{false};
  Background waiter([&] {
    auto store = client();
    const std::vector<std::string> keys = {"x", "y", "x"};
    store.wait(keys, kTestTimeout);
    done = true;
  });
  ASSERT_TRUE(eventually([&] { return server_.num_parked_requests() == 1; }));
  server_store_.set("x", "1");
  // Still one key missing: the waiter must stay parked.
  EXPECT_TRUE(server_store_.check(std::vector<std::string>{"x"}));
  EXPECT_EQ(server_.num_parked_requests(), 1u);
  EXPECT_FALSE(done);
  server_store_.add("y", 5);
  EXPECT_EQ(waiter.join(), "");
  EXPECT_TRUE(done);
  server_store_.wait(std::vector<std::string>{"x", "y"});  // all present: returns at once
  server_store_.wait(std::vector<std::string>{});
}

TEST_F(TcpStoreTest, AddCountsAndStoresDecimalText) {
  EXPECT_EQ(server_store_.add("counter", 5), 5);
  EXPECT_EQ(server_store_.add("counter", -7), -2);
  EXPECT_EQ(server_store_.add("counter", 0), -2);
  EXPECT_EQ(server_store_.get_string("counter"), "-2");
  server_store_.set("counter", "40");
  EXPECT_EQ(server_store_.add("counter", 2), 42);
}

TEST_F(TcpStoreTest, AddOnANonIntegerValueIsAStoreErrorAndTheClientStaysUsable) {
  server_store_.set("text", "not a number");
  const std::string message = message_of([&] { server_store_.add("text", 1); });
  EXPECT_THAT(message, HasSubstr("'text' is not a decimal integer"));
  EXPECT_THROW(server_store_.add("text", 1), StoreError);
  EXPECT_EQ(server_store_.add("fine", 1), 1);
  server_store_.set("huge", std::to_string(INT64_MAX));
  EXPECT_THROW(server_store_.add("huge", 1), StoreError);
}

TEST_F(TcpStoreTest, AddFrom32ConcurrentClientsGivesTheExactTotal) {
  constexpr int kClients = 32;
  constexpr int kAddsEach = 50;
  std::vector<std::thread> threads;  // each catches its own errors
  std::vector<std::string> errors(kClients);
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto store = client();
        for (int n = 0; n < kAddsEach; ++n)
          store.add("total", 1);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads)
    t.join();
  for (int i = 0; i < kClients; ++i)
    EXPECT_EQ(errors[i], "") << "client " << i;
  EXPECT_EQ(server_store_.add("total", 0), kClients * kAddsEach);
}

TEST_F(TcpStoreTest, OneClientSharedByThreadsIsSafe) {
  auto shared = client();
  std::vector<std::unique_ptr<Background>> threads;
  for (int i = 0; i < 4; ++i) {
    threads.push_back(std::make_unique<Background>([&] {
      for (int n = 0; n < 100; ++n)
        shared.add("shared", 1);
    }));
  }
  for (auto& t : threads)
    EXPECT_EQ(t->join(), "");
  EXPECT_EQ(shared.get_string("shared"), "400");
}

TEST_F(TcpStoreTest, CompareSetFollowsTheDocumentedSemantics) {
  // Missing key, non-empty expected: no change, returns empty.
  EXPECT_EQ(server_store_.compare_set("k", "old", "new"), "");
  EXPECT_FALSE(server_store_.check(std::vector<std::string>{"k"}));
  // Missing key equals empty expected: set.
  EXPECT_EQ(server_store_.compare_set("k", "", "first"), "first");
  // Mismatch: returns the current value, unchanged.
  EXPECT_EQ(server_store_.compare_set("k", "wrong", "second"), "first");
  EXPECT_EQ(server_store_.get_string("k"), "first");
  // Match: swapped.
  EXPECT_EQ(server_store_.compare_set("k", "first", "second"), "second");
  EXPECT_EQ(server_store_.get_string("k"), "second");
}

TEST_F(TcpStoreTest, CompareSetWakesAParkedGet) {
  Background getter([&] {
    auto store = client();
    EXPECT_EQ(store.get_string("cas", kTestTimeout), "v");
  });
  ASSERT_TRUE(eventually([&] { return server_.num_parked_requests() == 1; }));
  server_store_.compare_set("cas", "", "v");
  EXPECT_EQ(getter.join(), "");
}

TEST_F(TcpStoreTest, CompareSetRaceHasExactlyOneWinner) {
  constexpr int kClients = 16;
  std::vector<std::unique_ptr<Background>> threads;
  std::atomic<int> winners{0};
  std::vector<std::string> won_with(kClients);
  for (int i = 0; i < kClients; ++i) {
    threads.push_back(std::make_unique<Background>([&, i] {
      auto store = client();
      const std::string mine = "client-" + std::to_string(i);
      if (store.compare_set("leader", "", mine) == mine) {
        ++winners;
        won_with[i] = mine;
      }
    }));
  }
  for (auto& t : threads)
    EXPECT_EQ(t->join(), "");
  EXPECT_EQ(winners, 1);
  const std::string leader = server_store_.get_string("leader");
  EXPECT_NE(std::find(won_with.begin(), won_with.end(), leader), won_with.end()) << leader;
}

TEST_F(TcpStoreTest, DeleteCheckAndNumKeys) {
  EXPECT_EQ(server_store_.num_keys(), 0);
  server_store_.set("a", "1");
  server_store_.set("b", "2");
  EXPECT_EQ(server_store_.num_keys(), 2);
  EXPECT_TRUE(server_store_.check(std::vector<std::string>{"a", "b"}));
  EXPECT_FALSE(server_store_.check(std::vector<std::string>{"a", "c"}));
  EXPECT_TRUE(server_store_.check(std::vector<std::string>{}));
  EXPECT_TRUE(server_store_.delete_key("a"));
  EXPECT_FALSE(server_store_.delete_key("a"));
  EXPECT_EQ(server_store_.num_keys(), 1);
  EXPECT_FALSE(server_store_.check(std::vector<std::string>{"a"}));
  EXPECT_THROW(server_store_.get("a", 10ms), TimeoutError);
}

TEST_F(TcpStoreTest, KeysAndValuesOverTheLimitsAreConfigErrors) {
  const std::string long_key(kStoreMaxKeyBytes + 1, 'k');
  EXPECT_THROW(server_store_.set(long_key, "v"), ConfigError);
  EXPECT_THROW(server_store_.get(long_key, 10ms), ConfigError);
  const Bytes too_big(kStoreMaxValueBytes + 1);
  EXPECT_THAT(message_of([&] { server_store_.set("k", too_big); }), HasSubstr("over the limit"));
  // At the limit is fine, and nothing above broke the connection.
  server_store_.set(std::string(kStoreMaxKeyBytes, 'k'), "v");
  EXPECT_EQ(server_store_.num_keys(), 1);
}

TEST_F(TcpStoreTest, ServerOnAPortInUseIsAConfigErrorNamingThePort) {
  const auto port = server_store_.port();
  const std::string message =
      message_of([&] { TcpStore second("127.0.0.1", port, server_options()); });
  EXPECT_THAT(message, HasSubstr(std::to_string(port)));
  EXPECT_THAT(message, HasSubstr("already in use"));
  EXPECT_THAT(message, HasSubstr("MASTER_PORT"));
  EXPECT_THROW(TcpStoreServer({.listen_host = "127.0.0.1", .port = port}), ConfigError);
}

TEST(TcpStoreConnect, ClientStartedBeforeTheServerConnectsOnceItIsUp) {
  const auto port = net::pick_free_port();
  std::string result;
  std::thread early([&] {
    try {
      TcpStore store("127.0.0.1", port, client_options());
      result = store.get_string("hello", kTestTimeout);
    } catch (const std::exception& e) {
      result = e.what();
    }
  });
  // Let the client fail a few connection attempts first; that is the point of this test.
  std::this_thread::sleep_for(150ms);
  TcpStore server("127.0.0.1", port, server_options());
  server.set("hello", "world");
  early.join();
  EXPECT_EQ(result, "world");
}

TEST(TcpStoreConnect, NoServerIsATimeoutErrorAfterConnectTimeout) {
  const auto port = net::pick_free_port();
  const auto start = Clock::now();
  const std::string message = message_of([&] {
    TcpStore store("127.0.0.1", port, {.timeout = kTestTimeout, .connect_timeout = 300ms});
  });
  const auto elapsed = Clock::now() - start;
  EXPECT_THAT(message, HasSubstr("127.0.0.1:" + std::to_string(port)));
  EXPECT_THAT(message, HasSubstr("300 ms"));
  EXPECT_GE(elapsed, 300ms);
  EXPECT_LT(elapsed, 3s);
  EXPECT_THROW(TcpStore("127.0.0.1", port, {.connect_timeout = 50ms}), TimeoutError);
}

TEST(TcpStoreConnect, ServerStoppedUnderAParkedGetIsAStoreError) {
  TcpStoreServer server({.listen_host = "127.0.0.1"});
  TcpStore store("127.0.0.1", server.port(), client_options());
  std::string message;
  auto start = Clock::now();
  Background getter([&] { message = message_of([&] { store.get("never", 30s); }); });
  ASSERT_TRUE(eventually([&] { return server.num_parked_requests() == 1; }));
  start = Clock::now();
  server.stop();
  EXPECT_EQ(getter.join(), "");
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_THAT(
      message,
      HasSubstr("connection to store at 127.0.0.1:" + std::to_string(server.port()) + " lost"));
  // Later calls fail at once with StoreError too.
  EXPECT_THROW(store.set("k", "v"), StoreError);
}

TEST(TcpStoreConnect, ServerStoppedBetweenCallsIsAStoreError) {
  TcpStoreServer server({.listen_host = "127.0.0.1"});
  TcpStore store("127.0.0.1", server.port(), client_options());
  store.set("k", "v");
  server.stop();
  EXPECT_THROW(store.num_keys(), StoreError);
}

// A fake server that answers the handshake with `reply`, to test what the client makes of it.
std::string handshake_against(const std::vector<std::uint8_t>& reply) {
  net::Socket listener = net::listen_tcp("127.0.0.1", 0);
  Background fake([&] {
    net::Socket conn = net::accept_tcp(listener, net::deadline_after(kTestTimeout));
    std::uint8_t hello[store::kHelloBytes];
    conn.recv_all(hello, sizeof hello, net::deadline_after(kTestTimeout));
    conn.send_all(reply.data(), reply.size(), net::deadline_after(kTestTimeout));
  });
  std::string message =
      message_of([&] { TcpStore store("127.0.0.1", listener.local_port(), client_options()); });
  EXPECT_EQ(fake.join(), "");
  return message;
}

TEST(TcpStoreConnect, ProtocolVersionMismatchNamesBothVersions) {
  std::vector<std::uint8_t> reply(store::kHelloReplyBytes);
  store::put_u32(reply.data(), store::kMagic);
  store::put_u32(reply.data() + 4, 7);
  reply[8] = static_cast<std::uint8_t>(store::HelloStatus::kVersionMismatch);
  const std::string message = handshake_against(reply);
  EXPECT_THAT(message, HasSubstr("version mismatch"));
  EXPECT_THAT(message, HasSubstr("speaks version " + std::to_string(store::kProtocolVersion)));
  EXPECT_THAT(message, HasSubstr("speaks version 7"));
}

TEST(TcpStoreConnect, SomethingElseOnThePortIsAStoreError) {
  const std::string http = "HTTP/1.1 400";
  const std::string message = handshake_against({http.begin(), http.end()});
  EXPECT_THAT(message, HasSubstr("not a ddp store server"));
}

TEST(TcpStoreWorkers, ServerWaitsForAllWorkers) {
  const auto port = net::pick_free_port();
  std::vector<std::unique_ptr<Background>> workers;
  std::atomic<int> joined{0};
  for (int i = 0; i < 2; ++i) {
    workers.push_back(std::make_unique<Background>([&] {
      TcpStoreOptions options = client_options();
      options.num_workers = 3;
      TcpStore store("127.0.0.1", port, options);
      ++joined;
      store.wait(std::vector<std::string>{"release"});
    }));
  }
  TcpStoreOptions options = server_options();
  options.num_workers = 3;
  TcpStore server("127.0.0.1", port, options);
  EXPECT_EQ(server.get_string("__ddp_store/workers"), "3");
  server.set("release", "1");
  for (auto& t : workers)
    EXPECT_EQ(t->join(), "");
  EXPECT_EQ(joined, 2);
}

TEST(TcpStoreWorkers, MissingWorkersAreATimeoutErrorSayingHowManyCame) {
  TcpStoreOptions options = server_options();
  options.timeout = 200ms;
  options.num_workers = 3;
  const std::string message = message_of([&] { TcpStore server("127.0.0.1", 0, options); });
  EXPECT_THAT(message, HasSubstr("waited 200 ms for 3 workers"));
  EXPECT_THAT(message, HasSubstr("only 1 did"));
  options.num_workers = 0;
  EXPECT_THROW(TcpStore("127.0.0.1", 0, options), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
