// One TCP connection of an Agent (agent.h) to a peer: the outbound one carries this worker's calls
// and their replies, the inbound one the peer's calls. Private to src/rpc; agent.cc makes and
// stops connections, agent_inbound.cc accepts, reads and answers them.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>

#include "net/socket.h"
#include "rpc/agent.h"
#include "rpc/shared_ring.h"

namespace ddp::rpc::transport {

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
  // Reading side, the reader thread's alone: the peer's ring, once mapped.
  std::unique_ptr<RingReader> ring_reader;
  bool peer_offered_ring = false;
};

}  // namespace ddp::rpc::transport
