// One TCP connection of an Agent (agent.h) to a peer: the outbound one carries this worker's calls
// and their replies, the inbound one the peer's calls. Private to src/rpc; agent.cc makes and
// stops connections, agent_inbound.cc accepts, reads and answers them.
#pragma once

#include <atomic>
#include <mutex>
#include <thread>

#include "net/socket.h"
#include "rpc/agent.h"

namespace ddp::rpc::transport {

struct Agent::Connection {
  net::Socket socket;
  int peer_rank = -1;
  bool outbound = false;
  std::mutex send_mutex;
  std::thread thread;
  std::atomic<bool> broken{false};
  std::atomic<bool> finished{false};  // its thread has returned: joinable without waiting
};

}  // namespace ddp::rpc::transport
