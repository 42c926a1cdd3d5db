// C10dStoreClient against PyTorch 2.x's own TCPStore server (both of its backends, driven from
// Python at the same time), and against servers that do not speak the protocol: each is a named
// error within its deadline, never a hang.
#include "store/c10d_store_client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <regex>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/tcp_store_server.h"
#include "net/socket.h"
#include "support/subprocess.h"
#include "support/unity_namespace.h"

namespace ddp {
namespace {
namespace DDP_UNITY_ID {

using namespace std::chrono_literals;
using test::Subprocess;
using ::testing::HasSubstr;

const std::string kPython = std::string(DDP_PYTORCH_VENV) + "/bin/python";

Milliseconds since(net::Clock::time_point start) {
  return std::chrono::duration_cast<Milliseconds>(net::Clock::now() - start);
}

// Waits for the line "PORT n" a Python server prints; 0 when it does not come.
std::uint16_t wait_for_port(Subprocess& process, Milliseconds timeout) {
  const auto deadline = net::deadline_after(timeout);
  const std::regex port_line(R"(PORT (\d+))");
  while (net::Clock::now() < deadline) {
    std::smatch match;
    const std::string output = process.output_so_far();
    if (std::regex_search(output, match, port_line)) {
      return static_cast<std::uint16_t>(std::stoi(match[1]));
    }
    std::this_thread::sleep_for(20ms);
  }
  return 0;
}

// The Python side of the round trip: hosts the store, reads what C++ set, answers, and checks
// what C++ left behind once C++ sets cpp/done.
constexpr const char* kPythonServer = R"(
import sys, datetime
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
               use_libuv=(sys.argv[1] == "1"), timeout=datetime.timedelta(seconds=60))
print("PORT", s.port, flush=True)
v = s.get("cpp/key")
s.add("counter", 5)
s.set("py/key", v + b"!")
s.wait(["cpp/done"])
print("COUNTER", s.get("counter").decode(), flush=True)
print("PYKEY", s.check(["py/key"]), flush=True)
print("CAS", s.get("cas").decode(), flush=True)
print("PYOK", flush=True)
)";

class C10dStorePython : public ::testing::TestWithParam<bool> {};

TEST_P(C10dStorePython, RoundTripWithPyTorchsOwnServerAndPythonClient) {
  if (!std::filesystem::exists(kPython)) {
    GTEST_SKIP() << "no PyTorch 2.x environment at " << DDP_PYTORCH_VENV
                 << "; scripts/install-deps.sh installs it";
  }
  auto python = Subprocess::start({kPython, "-c", kPythonServer, GetParam() ? "1" : "0"},
                                  {{"PYTHONUNBUFFERED", "1"}});
  const auto port = wait_for_port(python, 60s);
  ASSERT_NE(port, 0) << python.output_so_far();

  C10dStoreClient store("127.0.0.1", port, {.timeout = 30s, .connect_timeout = 30s});
  store.set("cpp/key", "hello");
  EXPECT_EQ(store.get_string("py/key"), "hello!");  // waits for Python's answer
  EXPECT_EQ(store.add("counter", 2), 7);
  EXPECT_EQ(store.get_string("counter"), "7");
  EXPECT_TRUE(store.check(std::vector<std::string>{"py/key", "cpp/key"}));
  EXPECT_FALSE(store.check(std::vector<std::string>{"py/key", "absent"}));
  EXPECT_TRUE(store.check(std::vector<std::string>{}));  // nothing missing; nothing sent
  store.wait(std::vector<std::string>{}, 100ms);

  // compare_set keeps ddp's contract on top of c10d's.
  EXPECT_EQ(store.compare_set("cas", "", "a"), "a");
  EXPECT_EQ(store.compare_set("cas", "x", "b"), "a");
  EXPECT_EQ(store.compare_set("cas", "a", "a"), "a");
  EXPECT_EQ(store.compare_set("absent-cas", "x", "y"), "");
  EXPECT_EQ(store.compare_set("absent-cas2", "q", "q"), "");
  EXPECT_FALSE(store.check(std::vector<std::string>{"absent-cas"}));

  // A wait past its deadline is a TimeoutError naming the key, and the client stays usable.
  const auto start = net::Clock::now();
  try {
    store.wait(std::vector<std::string>{"never"}, 300ms);
    ADD_FAILURE() << "wait for a key nobody sets returned";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("'never'"));
  }
  EXPECT_LT(since(start), 5s);
  EXPECT_THROW(store.get("never", 200ms), TimeoutError);
  store.set("after", "1");
  EXPECT_EQ(store.get_string("after"), "1");

  EXPECT_TRUE(store.delete_key("py/key"));
  EXPECT_FALSE(store.delete_key("py/key"));
  EXPECT_EQ(store.num_keys(), 4);  // cpp/key, counter, cas, after
  store.set("cpp/done", "1");

  const auto result = python.wait(60s);
  ASSERT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("COUNTER 7"));
  EXPECT_THAT(result.output, HasSubstr("PYKEY False"));
  EXPECT_THAT(result.output, HasSubstr("CAS a"));
  EXPECT_THAT(result.output, HasSubstr("PYOK"));
}

INSTANTIATE_TEST_SUITE_P(Backends, C10dStorePython, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "libuv" : "classic"; });

// A loopback server that accepts one connection and hands it to `behave`, then holds it open
// until the test ends.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(net::Socket&)> behave)
      : listener_(net::listen_tcp("127.0.0.1", 0)), port_(listener_.local_port()) {
    thread_ = std::thread([this, behave = std::move(behave)] {
      try {
        net::Socket peer = net::accept_tcp(listener_, net::deadline_after(10s));
        behave(peer);
        const auto until = net::deadline_after(10s);
        while (!done_ && net::Clock::now() < until)
          std::this_thread::sleep_for(10ms);
      } catch (const std::exception&) {
        // The client went away: nothing more to do.
      }
    });
  }
  ~FakeServer() {
    done_ = true;
    thread_.join();
  }
  std::uint16_t port() const { return port_; }

 private:
  net::Socket listener_;
  std::uint16_t port_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

TEST(C10dStoreClient, GarbageAnswerIsANamedErrorNotAHang) {
  FakeServer server([](net::Socket& peer) {
    const std::string garbage = "HTTP/1.1 400 Bad Request\r\n\r\n";
    peer.send_all(garbage.data(), garbage.size(), net::deadline_after(5s));
  });
  const auto start = net::Clock::now();
  try {
    C10dStoreClient store("127.0.0.1", server.port(), {.timeout = 5s, .connect_timeout = 5s});
    ADD_FAILURE() << "a server answering HTTP was taken for a c10d store";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("the store at 127.0.0.1:{} does not speak the "
                                                "c10d TCPStore protocol",
                                                server.port())));
    EXPECT_THAT(e.what(), HasSubstr("answered the ping"));
  }
  EXPECT_LT(since(start), 4s);
}

TEST(C10dStoreClient, SilentServerIsATimeoutWithinTheDeadline) {
  FakeServer server([](net::Socket&) {});
  const auto start = net::Clock::now();
  try {
    C10dStoreClient store("127.0.0.1", server.port(), {.timeout = 5s, .connect_timeout = 700ms});
    ADD_FAILURE() << "a silent server was taken for a c10d store";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(), HasSubstr("does not speak the c10d TCPStore protocol"));
    EXPECT_THAT(e.what(), HasSubstr("did not answer the handshake"));
  }
  EXPECT_LT(since(start), 3s);
}

TEST(C10dStoreClient, DdpsOwnStoreServerIsRefusedByName) {
  TcpStoreServer server({.listen_host = "127.0.0.1", .log = [](const std::string&) {}});
  try {
    C10dStoreClient store("127.0.0.1", server.port(), {.timeout = 5s, .connect_timeout = 5s});
    ADD_FAILURE() << "ddp's store server was taken for a c10d store";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("does not speak the c10d TCPStore protocol"));
    EXPECT_THAT(e.what(), HasSubstr("closed the connection during the handshake"));
  }
}

TEST(C10dStoreClient, UnreachablePortIsANamedErrorWithinTheDeadline) {
  const auto port = net::pick_free_port();
  const auto start = net::Clock::now();
  try {
    C10dStoreClient store("127.0.0.1", port, {.timeout = 5s, .connect_timeout = 1s});
    ADD_FAILURE() << "connected to a port nobody listens on";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(e.what(),
                HasSubstr(fmt::format("no c10d TCPStore (torchrun's store) accepted a connection "
                                      "at 127.0.0.1:{} within 1000 ms",
                                      port)));
  }
  EXPECT_LT(since(start), 4s);
}

// PyTorch 1.x's TCPStore has no validate/ping and numbers its queries differently; the handshake
// makes it close the connection instead of misreading it.
TEST(C10dStoreClient, PyTorch1ServerIsRefusedByName) {
  const std::string python = "/usr/bin/python3";
  auto probe = Subprocess::start({python, "-c", "import torch.distributed"});
  if (probe.wait(60s).exit_code != 0) {
    GTEST_SKIP() << "no PyTorch 1.x at " << python << " (Debian's python3-torch)";
  }
  auto server =
      Subprocess::start({python, "-c",
                         "import time, torch.distributed as d\n"
                         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
                         "print('PORT', s.port, flush=True)\n"
                         "time.sleep(60)\n"});
  const auto port = wait_for_port(server, 60s);
  ASSERT_NE(port, 0) << server.output_so_far();
  const auto start = net::Clock::now();
  try {
    C10dStoreClient store("127.0.0.1", port, {.timeout = 5s, .connect_timeout = 5s});
    ADD_FAILURE() << "PyTorch 1.x's store was taken for a 2.x one";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("does not speak the c10d TCPStore protocol of PyTorch 2.x"));
  }
  EXPECT_LT(since(start), 12s);
}

// The store's host dies while a wait is parked: a StoreError at once, not the wait's deadline,
// and every later call is refused by name.
TEST(C10dStoreClient, ServerGoneDuringAWaitIsAStoreErrorAtOnce) {
  FakeServer server([](net::Socket& peer) {
    std::uint8_t hello[10];
    peer.recv_all(hello, sizeof hello, net::deadline_after(5s));
    peer.send_all(hello + 6, 4, net::deadline_after(5s));
    std::uint8_t request[1];
    peer.recv_all(request, 1, net::deadline_after(5s));  // the wait arrives
    std::this_thread::sleep_for(200ms);
    peer.close();
  });
  C10dStoreClient store("127.0.0.1", server.port(), {.timeout = 5s, .connect_timeout = 5s});
  const auto start = net::Clock::now();
  try {
    store.wait(std::vector<std::string>{"k"}, 30s);
    ADD_FAILURE() << "wait returned although the server went away";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("connection to the c10d store at 127.0.0.1:{} "
                                                "lost during wait('k')",
                                                server.port())));
  }
  EXPECT_LT(since(start), 5s);
  try {
    store.set("k", "v");
    ADD_FAILURE() << "a broken client accepted a call";
  } catch (const StoreError& e) {
    EXPECT_THAT(e.what(), HasSubstr("is unusable"));
  }
}

TEST(C10dStoreClient, OversizedKeysAndValuesAreRefusedBeforeSending) {
  FakeServer server([](net::Socket& peer) {
    // Answer the handshake's ping like a c10d server: echo the nonce.
    std::uint8_t hello[10];
    peer.recv_all(hello, sizeof hello, net::deadline_after(5s));
    peer.send_all(hello + 6, 4, net::deadline_after(5s));
  });
  C10dStoreClient store("127.0.0.1", server.port(), {.timeout = 5s, .connect_timeout = 5s});
  EXPECT_THROW(store.set(std::string(kC10dMaxKeyBytes + 1, 'k'), "v"), ConfigError);
  EXPECT_THROW(store.set("k", std::string(kC10dMaxValueBytes + 1, 'v')), ConfigError);
}

}  // namespace DDP_UNITY_ID
}  // namespace
}  // namespace ddp
