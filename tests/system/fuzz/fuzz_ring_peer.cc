// libFuzzer harness: the bytes a peer sends to a rank's data port (the ring backend's hello, then
// operation headers and payloads, src/comm/wire.h and ring_process_group.cc).
//
// Each input plays rank 1 of a group of two against a real rank 0 (make_ring_process_group on an
// in-memory store, in a thread of this process): the harness connects to rank 0's data port,
// sends the input, half-closes and reads until rank 0 closes. Rank 0 sets the group up and runs
// allreduce, broadcast and barrier. The code under test must end every input with a ddp::Error
// (or success) and close the connection, never crash, hang or throw anything else.
//
// The seed corpus is recorded from two real ranks (what rank 1 sends to rank 0, through a proxy):
//   DDP_FUZZ_RECORD=tests/system/fuzz/corpus/fuzz_ring_peer/session ./fuzz_ring_peer
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <poll.h>
#include <sys/socket.h>

#include "ddp/comm/ring_process_group.h"
#include "ddp/error.h"
#include "fuzz_util.h"
#include "memory_store.h"
#include "net/socket.h"

namespace {

using namespace std::chrono_literals;

constexpr const char* kGroup = "fuzz";
// Store prefix of the first group named kGroup: "ring/<name>/<(joins - 1) / size>/".
constexpr const char* kPrefix = "ring/fuzz/0/";

ddp::RingOptions options() {
  return {.timeout = 2000ms,
          .group_name = kGroup,
          .advertise_host = "127.0.0.1",
          .socket_buffer_bytes = 256 * 1024,
          .spin = 0us,
          .worker_linger = 0us,
          .transport = ddp::Transport::kTcp};
}

// What both ranks run once the group is up; small messages so a session fits in a seed.
void run_program(ddp::ProcessGroup& pg) {
  std::vector<float> data(4, static_cast<float>(pg.rank() + 1));
  pg.allreduce(data.data(), data.size(), ddp::DType::kFloat32, ddp::ReduceOp::kSum)->wait();
  pg.broadcast(data.data(), data.size(), ddp::DType::kFloat32, /*root=*/1)->wait();
  pg.barrier()->wait();
}

// Rank `rank` of the group on `store`: errors the harness expects (ddp::Error) end the rank;
// anything else is a finding.
void run_rank(std::shared_ptr<ddp::Store> store, int rank) {
  try {
    auto pg = ddp::make_ring_process_group(std::move(store), rank, 2, options());
    run_program(*pg);
  } catch (const ddp::Error&) {
    // Refused input: what the code under test should do.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_ring_peer: rank %d threw a non-ddp exception: %s\n", rank, e.what());
    std::abort();
  }
}

// Records what a real rank 1 sends to a real rank 0 (both in this process) into `path`.
void record(const char* path) {
  auto store = std::make_shared<ddp::fuzz::MemoryStore>();
  ddp::net::Socket proxy = ddp::net::listen_tcp("127.0.0.1", 0);
  std::string real_address;
  store->on_set = [&](const std::string& key, ddp::Bytes& value) {
    if (key == std::string(kPrefix) + "addr/0") {
      real_address.assign(value.begin(), value.end());
      const std::string ours = "127.0.0.1:" + std::to_string(proxy.local_port());
      value.assign(ours.begin(), ours.end());
    }
  };
  std::vector<std::uint8_t> recorded;
  std::thread pump([&] {
    const auto deadline = ddp::net::deadline_after(10s);
    ddp::net::Socket from_rank1 = ddp::net::accept_tcp(proxy, deadline);
    const auto colon = real_address.rfind(':');
    ddp::net::Socket to_rank0 = ddp::net::connect_tcp(
        real_address.substr(0, colon),
        static_cast<std::uint16_t>(std::stoi(real_address.substr(colon + 1))), deadline);
    std::vector<char> buffer(1 << 16);
    bool open1 = true, open0 = true;
    while (open1 || open0) {
      pollfd p[2] = {{.fd = open1 ? from_rank1.fd() : -1, .events = POLLIN},
                     {.fd = open0 ? to_rank0.fd() : -1, .events = POLLIN}};
      if (::poll(p, 2, ddp::net::poll_timeout_ms(deadline)) <= 0) break;
      if (p[0].revents) {
        const ssize_t n = ::recv(from_rank1.fd(), buffer.data(), buffer.size(), 0);
        if (n <= 0) {
          open1 = false;
          ::shutdown(to_rank0.fd(), SHUT_WR);
        } else {
          recorded.insert(recorded.end(), buffer.begin(), buffer.begin() + n);
          ::send(to_rank0.fd(), buffer.data(), static_cast<std::size_t>(n), MSG_NOSIGNAL);
        }
      }
      if (p[1].revents) {
        const ssize_t n = ::recv(to_rank0.fd(), buffer.data(), buffer.size(), 0);
        if (n <= 0) {
          open0 = false;
          ::shutdown(from_rank1.fd(), SHUT_WR);
        } else {
          ::send(from_rank1.fd(), buffer.data(), static_cast<std::size_t>(n), MSG_NOSIGNAL);
        }
      }
    }
  });
  std::thread rank0([&] { run_rank(store, 0); });
  run_rank(store, 1);
  rank0.join();
  pump.join();
  std::FILE* out = std::fopen(path, "wb");
  if (out == nullptr || std::fwrite(recorded.data(), 1, recorded.size(), out) != recorded.size()) {
    std::perror(path);
    std::exit(1);
  }
  std::fclose(out);
  std::fprintf(stderr, "fuzz_ring_peer: recorded %zu bytes rank 1 sent to rank 0 into %s\n",
               recorded.size(), path);
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* path = std::getenv("DDP_FUZZ_RECORD")) record(path);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto store = std::make_shared<ddp::fuzz::MemoryStore>();
  // Rank 1's host entry, as rank 1 would have set it: TCP transport, another host.
  store->set(std::string(kPrefix) + "host/1", std::string_view("tcp\nfuzz-peer"));
  std::thread rank0([store] { run_rank(store, 0); });
  try {
    const std::string address = store->get_string(std::string(kPrefix) + "addr/0", 5000ms);
    const auto colon = address.rfind(':');
    ddp::net::Socket socket = ddp::net::connect_tcp(
        address.substr(0, colon), static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))),
        ddp::net::deadline_after(5000ms));
    if (!ddp::fuzz::send_and_drain(socket.fd(), data, size, 5000ms)) {
      ddp::fuzz::report_hang("rank 0");
    }
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "fuzz_ring_peer: harness could not reach rank 0: %s\n", e.what());
    std::abort();
  }
  rank0.join();
  return 0;
}
