// One TCP connection of an Agent (agent.h) to a peer: the outbound one carries this worker's calls
// and their replies, the inbound one the peer's calls. Private to src/rpc; agent.cc makes and
// stops connections, agent_inbound.cc accepts, reads and answers them, agent_spin.cc lets
// waiting threads read them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/socket.h"
#include "rpc/agent.h"
#include "rpc/shared_ring.h"

namespace ddp::rpc::transport {

// A connection's bytes through a buffer: a small frame (header, name and payload) arrives whole,
// and one recv takes it where reading its parts apart took three (a system call is a few
// microseconds of an empty call's 30 here, issue 51); a part at least half the buffer's size
// (a tensor) is received straight into its place. Errors as net::Socket::recv_all's.
class BufferedReader {
 public:
  explicit BufferedReader(net::Socket& socket) : socket_(socket), buffer_(kBytes) {}
  bool buffered() const { return begin_ < end_; }
  void read(void* out, std::size_t n, net::Deadline deadline) {
    auto* to = static_cast<std::uint8_t*>(out);
    while (n > 0) {
      if (begin_ < end_) {
        const std::size_t take = std::min(n, end_ - begin_);
        std::memcpy(to, buffer_.data() + begin_, take);
        begin_ += take;
        to += take;
        n -= take;
        continue;
      }
      begin_ = end_ = 0;
      if (n >= kBytes / 2) {
        socket_.recv_all(to, n, deadline);
        return;
      }
      const auto got = socket_.recv_some(buffer_.data(), buffer_.size());
      if (got < 0) throw Error(fmt::format("connection closed by peer {}", socket_.peer()));
      if (got > 0) {
        end_ = static_cast<std::size_t>(got);
      } else if (!socket_.wait_readable(deadline)) {
        throw TimeoutError(fmt::format("timed out receiving from {}", socket_.peer()));
      }
    }
  }

 private:
  static constexpr std::size_t kBytes = std::size_t{64} << 10;
  net::Socket& socket_;
  std::vector<std::uint8_t> buffer_;
  std::size_t begin_ = 0, end_ = 0;
};

// Whether bytes (or the peer's end) wait on the socket now, without waiting.
bool readable_now(const net::Socket& socket);
// True on a pool thread while it reads an inbound connection as the pool's spinning thread
// (agent_spin.cc): what it posts it takes itself, so nothing is woken for it.
bool& reading_for_pool();

struct Agent::Connection {
  net::Socket socket;
  int peer_rank = -1;
  bool outbound = false;
  std::mutex send_mutex;
  std::thread thread;
  std::atomic<bool> broken{false};
  std::atomic<bool> finished{false};  // its thread has returned: joinable without waiting

  // The shared-memory lane (shared_ring.h), offered with the first large payload to send.
  // Sending side, under send_mutex:
  enum class RingState { kNone, kOffered, kInUse, kOff };
  RingState ring_state = RingState::kNone;
  std::unique_ptr<RingWriter> ring_writer;
  // Written under send_mutex before the offer is sent, then `ring_offered`; the reader thread
  // checks the peer's answer against them and leaves it in `ring_answer` (1 mapped, 2 refused)
  // for the next sender to act on: the reader never waits for send_mutex, which a sender blocked
  // on this very connection may hold.
  RingNonce offered_nonce{};
  std::atomic<bool> ring_offered{false};
  std::atomic<int> ring_answer{0};
  // Reading side, under read_mutex: the peer's ring, once mapped.
  std::unique_ptr<RingReader> ring_reader;
  bool peer_offered_ring = false;

  // Frames are read by the connection's thread, or by a thread that spins waiting for one (a
  // caller waiting for its reply, the callee's pool thread looking for work: Agent::try_read),
  // one frame at a time under read_mutex.
  std::mutex read_mutex;
  BufferedReader reader{socket};
  // While such a thread spins for this connection's frames, its reader thread sleeps on
  // `park_word` instead of in poll on the socket, where each frame would wake it (a wake-up
  // across vCPUs is most of an empty call here, issue 51). Outbound: callers renew
  // `lease_until` (steady-clock ns) while they spin, and the reader parks until it ends unless
  // a pending call has nobody spinning for it (`uncovered` > 0). Inbound: the agent's pool
  // lease (Agent::pool_lease_until_). Unparked by a bump of `park_word`.
  std::atomic<std::int64_t> lease_until{0};
  std::atomic<int> uncovered{0};
  std::uint32_t park_word = 0;
};

}  // namespace ddp::rpc::transport
