// libFuzzer harness: the bytes a client sends to the rendezvous store's server (handshake, then
// frames: src/store/protocol.h, docs/store.md), through a real socket to a real TcpStoreServer.
//
// Each input gets a fresh server in this process (so a crash reproduces from its input alone): the
// harness connects, sends the input, half-closes and reads until the server closes. Then a real
// TcpStore client must still get an answer from the same server: whatever one connection sends, the
// server keeps serving the others. The server must never crash, hang or leave the connection open.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ddp/error.h"
#include "ddp/store/tcp_store.h"
#include "fuzz_util.h"
#include "net/socket.h"

using namespace std::chrono_literals;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ddp::TcpStoreServer server(ddp::TcpStoreServerOptions{
      .listen_host = "127.0.0.1", .log = [](const std::string&) {}, .drain_timeout = 0ms});
  try {
    ddp::net::Socket socket =
        ddp::net::connect_tcp("127.0.0.1", server.port(), ddp::net::deadline_after(5000ms));
    // 5 ms of quiet before the close: the server answers complete requests that came with the
    // close only once the store's close handling does (issue 15); until then it drops them.
    if (!ddp::fuzz::send_and_drain(socket.fd(), data, size, 5000ms, 5ms)) {
      ddp::fuzz::report_hang("the store server");
    }
    ddp::TcpStore client("127.0.0.1", server.port(),
                         {.timeout = 5000ms, .connect_timeout = 5000ms});
    client.set("fuzz/after", std::string_view("alive"));
    if (client.get_string("fuzz/after") != "alive") {
      std::fprintf(stderr, "fuzz_store_server: the server lost a value after the input\n");
      std::abort();
    }
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "fuzz_store_server: the server stopped serving after the input: %s\n",
                 e.what());
    std::abort();
  }
  return 0;
}
