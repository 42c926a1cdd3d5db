// libFuzzer harness: the bytes a peer sends to an RPC worker's port (src/rpc: the handshake of
// handshake.h, then the frames of frame.h).
//
// Each input plays worker 1 of two against a real worker 0 (rpc::Agent on an in-memory store, in
// a thread of this process, no secret). The first byte picks what the rest is:
//   even  the whole connection from its first byte: the handshake, then frames;
//   odd   the frames after a real handshake (handshake_as_caller).
// The harness also answers worker 0's own connection to worker 1 (a real handshake_as_callee),
// and after a raw input opens a proper connection, so that worker 0's start-up completes whatever
// the input did. Worker 0 serves "echo" until the input's connection has closed, then stops. The
// code under test must end every input with a ddp::Error (or success) and close the connection,
// never crash, hang or throw anything else.
//
// Seeds: make_seeds.py (corpus/fuzz_rpc_peer/).
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "fuzz_util.h"
#include "memory_store.h"
#include "net/socket.h"
#include "rpc/agent.h"
#include "rpc/handshake.h"

namespace {

using namespace std::chrono_literals;

struct Rendezvous {
  std::mutex mutex;
  std::condition_variable cv;
  std::string prefix;  // worker 0's keys, learnt from its session key
  std::string session;
  std::uint16_t port = 0;  // worker 0's
  bool input_done = false;
};

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_rpc_peer: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool after_handshake = (data[0] & 1) != 0;
  ++data;
  --size;

  auto store = std::make_shared<ddp::fuzz::MemoryStore>();
  auto rendezvous = std::make_shared<Rendezvous>();
  ddp::net::Socket listener = ddp::net::listen_tcp("127.0.0.1", 0);
  const std::uint16_t my_port = listener.local_port();
  store->on_set = [rendezvous](const std::string& key, ddp::Bytes& value) {
    const std::string suffix = "/session";
    if (key.size() > suffix.size() && key.ends_with(suffix)) {
      std::lock_guard lock(rendezvous->mutex);
      rendezvous->prefix = key.substr(0, key.size() - suffix.size());
      rendezvous->session.assign(value.begin(), value.end());
    }
    if (key.ends_with("/worker/0")) {
      const std::string entry(value.begin(), value.end());
      std::lock_guard lock(rendezvous->mutex);
      rendezvous->port = static_cast<std::uint16_t>(
          std::stoi(entry.substr(entry.find('\n', entry.find('\n') + 1) + 1)));
    }
    rendezvous->cv.notify_all();
  };

  std::thread worker0([store, rendezvous] {
    try {
      ddp::rpc::transport::AgentOptions options;
      options.name = "w0";
      options.rank = 0;
      options.world_size = 2;
      options.host = "127.0.0.1";
      options.bind_host = "127.0.0.1";
      options.timeout = 2000ms;
      options.threads = 2;
      ddp::rpc::transport::Agent agent(*store, options);
      agent.register_function(
          "echo",
          [](const ddp::rpc::transport::CallerInfo&, ddp::rpc::transport::Bytes in,
             const ddp::rpc::transport::CallPromise& reply) { reply.complete({std::move(in)}); });
      std::unique_lock lock(rendezvous->mutex);
      rendezvous->cv.wait_for(lock, 10s, [&] { return rendezvous->input_done; });
    } catch (const ddp::Error&) {
      // Refused input: what the code under test should do.
    } catch (const std::exception& e) {
      finding(fmt::format("worker 0 threw a non-ddp exception: {}", e.what()));
    }
  });

  std::string prefix, session;
  std::uint16_t port0 = 0;
  {
    std::unique_lock lock(rendezvous->mutex);
    if (!rendezvous->cv.wait_for(
            lock, 5s, [&] { return !rendezvous->prefix.empty() && rendezvous->port != 0; })) {
      finding("worker 0 never published itself");
    }
    prefix = rendezvous->prefix;
    session = rendezvous->session;
    port0 = rendezvous->port;
  }
  store->set(prefix + "/worker/1", fmt::format("w1\n127.0.0.1\n{}\n2", my_port));
  const ddp::rpc::transport::HandshakeSelf self{session, 2, 1, "w1", ""};

  // Worker 0's own connection to worker 1, answered as worker 1 would; then held open until
  // worker 0 closes it.
  std::thread answer([&listener, self] {
    try {
      ddp::net::Socket s = ddp::net::accept_tcp(listener, ddp::net::deadline_after(5s));
      ddp::rpc::transport::handshake_as_callee(
          s, self, [](int r) { return "w" + std::to_string(r); }, ddp::net::deadline_after(5s));
      char sink[4096];
      while (s.wait_readable(ddp::net::deadline_after(15s))) {
        if (s.recv_some(sink, sizeof sink) < 0) break;
      }
    } catch (const ddp::Error&) {
      // Worker 0 stopped before or during this: its start-up was refused.
    }
  });

  try {
    ddp::net::Socket socket =
        ddp::net::connect_tcp("127.0.0.1", port0, ddp::net::deadline_after(5s));
    if (after_handshake) {
      ddp::rpc::transport::handshake_as_caller(socket, self, 0, "w0", ddp::net::deadline_after(5s));
    }
    if (!ddp::fuzz::send_and_drain(socket.fd(), data, size, 5000ms, 50ms)) {
      ddp::fuzz::report_hang("worker 0");
    }
    if (!after_handshake) {
      // A proper connection, so that start-up completes (refused as a second one when the input
      // was a whole handshake).
      ddp::net::Socket proper =
          ddp::net::connect_tcp("127.0.0.1", port0, ddp::net::deadline_after(5s));
      try {
        ddp::rpc::transport::handshake_as_caller(proper, self, 0, "w0",
                                                 ddp::net::deadline_after(5s));
      } catch (const ddp::Error&) {
      }
    }
  } catch (const ddp::Error&) {
    // Worker 0 gave up first (its start-up deadline): fine, as long as it did not hang.
  }
  {
    std::lock_guard lock(rendezvous->mutex);
    rendezvous->input_done = true;
  }
  rendezvous->cv.notify_all();
  worker0.join();
  answer.join();
  return 0;
}
