// The receiving half of Agent (agent.h): accepting peers, reading their frames, running the
// functions they call and answering; and what a broken connection fails.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/fd_io.h"
#include "rpc/agent.h"
#include "rpc/agent_connection.h"
#include "rpc/current_exception.h"

namespace ddp::rpc::transport {
namespace {

using namespace std::chrono_literals;

// A payload this large takes long enough to receive (tens of microseconds) to hide the wake-up of
// the thread that takes it next.
constexpr std::uint64_t kExpectPayloadBytes = std::uint64_t{256} << 10;

// Inbound connections still in their handshake; more are closed at once, so a flood of strangers
// costs a descriptor for a moment each, not a thread each.
constexpr int kMaxHandshakes = 64;

}  // namespace

void Agent::accept_loop() {
  while (!stopping_) {
    if (!listener_.wait_readable(net::deadline_after(100ms))) {
      reap_finished();
      continue;
    }
    if (stopping_) return;
    net::Socket socket;
    try {
      socket = net::accept_tcp(listener_, net::deadline_after(100ms));
    } catch (const Error&) {
      continue;  // the caller gave up, or no descriptor: the listener is still there
    }
    std::lock_guard lock(connections_mutex_);
    if (handshakes_running_ >= kMaxHandshakes) {
      ++refused_;
      continue;  // closed as it goes out of scope
    }
    ++handshakes_running_;
    auto connection = std::make_shared<Connection>();
    connection->socket = std::move(socket);
    connection->socket.set_no_delay(true);
    all_connections_.push_back(connection);
    connection->thread = std::thread([this, connection] {
      serve_inbound(connection);
      connection->finished = true;
    });
  }
}

void Agent::reap_finished() {
  std::vector<std::shared_ptr<Connection>> done;
  {
    std::lock_guard lock(connections_mutex_);
    std::erase_if(all_connections_, [&](const std::shared_ptr<Connection>& c) {
      // Only the refused: a connection of a worker stays listed until stop().
      if (!c->finished || c->peer_rank >= 0) return false;
      done.push_back(c);
      return true;
    });
  }
  for (auto& c : done) {
    if (c->thread.joinable()) c->thread.join();
  }
}

void Agent::serve_inbound(std::shared_ptr<Connection> connection) {
  int caller = -1;
  try {
    caller = handshake_as_callee(
        connection->socket, handshake_self_,
        [this](int r) { return workers_[static_cast<std::size_t>(r)].name; },
        net::deadline_after(options_.timeout));
    std::lock_guard lock(connections_mutex_);
    --handshakes_running_;
    auto& slot = inbound_[static_cast<std::size_t>(caller)];
    if (slot) {
      ++refused_;
      std::fprintf(stderr, "ddp rpc: %s: a second connection from %s refused\n",
                   who(options_.rank).c_str(), who(caller).c_str());
      return;
    }
    connection->peer_rank = caller;
    slot = connection;
    connections_cv_.notify_all();
  } catch (const Error& e) {
    std::lock_guard lock(connections_mutex_);
    --handshakes_running_;
    ++refused_;
    if (!stopping_) {
      std::fprintf(stderr, "ddp rpc: %s refused a connection from %s: %s\n",
                   who(options_.rank).c_str(), connection->socket.peer().c_str(), e.what());
    }
    return;
  }
  read_frames(connection);
}

void Agent::read_frames(const std::shared_ptr<Connection>& connection) {
  for (;;) {
    if (connection->broken) return;
    if (park(*connection)) continue;  // a spinning thread reads this connection: look again later
    bool buffered = false;
    {
      std::lock_guard lock(connection->read_mutex);
      buffered = connection->reader.buffered();
    }
    if (!buffered) connection->socket.wait_readable(net::Deadline::max());
    std::lock_guard lock(connection->read_mutex);
    // A spinning thread may have taken what woke this one.
    if (!connection->reader.buffered() && !readable_now(connection->socket)) continue;
    if (!read_one_frame(connection)) return;
  }
}

bool Agent::read_one_frame(const std::shared_ptr<Connection>& connection) {
  std::array<std::uint8_t, kFrameHeaderBytes> head{};
  const std::string peer = who(connection->peer_rank);
  BufferedReader& reader = connection->reader;
  try {
    {
      // Once a frame has started, all of it must come within the timeout.
      const net::Deadline deadline = net::deadline_after(options_.timeout);
      reader.read(head.data(), head.size(), deadline);
      const FrameHeader header = decode_frame_header(head.data(), limits_, peer);
      std::string name(header.name_bytes, '\0');
      reader.read(name.data(), name.size(), deadline);
      // A large payload takes a while to copy out: the thread that will take the call (a pool
      // thread) or its reply (the caller) is woken now, and is looking for it when it is done.
      if (header.payload_bytes >= kExpectPayloadBytes) {
        if (header.kind == FrameKind::kRequest && !connection->outbound) pool_.expect_task();
        if (header.kind == FrameKind::kReply && connection->outbound) {
          expect_completion(header.call_id, connection->peer_rank);
        }
      }
      Bytes payload(header.payload_bytes);
      if (header.payload_in_ring) {
        if (!connection->ring_reader) {
          throw ProtocolError(fmt::format(
              "rpc: {} sent a payload in a shared-memory ring this worker has not mapped; the "
              "connection is closed",
              peer));
        }
        connection->ring_reader->read(payload.data(), payload.size(), peer, deadline,
                                      spin_before_sleep(), connection->socket.fd());
      } else {
        reader.read(payload.data(), payload.size(), deadline);
      }
      if (header.kind == FrameKind::kRingOffer || header.kind == FrameKind::kRingAnswer) {
        read_ring_frame(connection, header, payload);
        return true;
      }
      if (!connection->outbound) {
        if (header.kind != FrameKind::kRequest) {
          throw ProtocolError(
              fmt::format("rpc: {} sent a reply on the connection that carries "
                          "its own calls",
                          peer));
        }
        dispatch(connection, header.call_id, header.timeout_ms, std::move(name),
                 std::move(payload));
        return true;
      }
      if (header.kind == FrameKind::kRequest) {
        throw ProtocolError(
            fmt::format("rpc: {} sent a request on the connection that carries "
                        "this worker's calls",
                        peer));
      }
      Reply reply;
      if (header.kind == FrameKind::kReply) {
        reply.payload = std::move(payload);
      } else {
        const auto kind = name.empty() ? 0 : static_cast<std::uint8_t>(name[0]);
        if (kind < 1 || kind > kLastFailureKind) {
          throw ProtocolError(fmt::format("rpc: {} sent a failure of unknown kind {}", peer, kind));
        }
        reply.failure = Failure{static_cast<FailureKind>(kind), name.substr(1),
                                std::string(payload.begin(), payload.end())};
      }
      complete_call(header.call_id, connection->peer_rank, std::move(reply));
    }
    return true;
  } catch (const ProtocolError& e) {
    ++refused_;
    if (!stopping_) std::fprintf(stderr, "ddp rpc: %s: %s\n", who(options_.rank).c_str(), e.what());
    connection_failed(*connection, e.what(), FailureKind::kProtocol);
  } catch (const Error& e) {
    connection_failed(*connection, e.what(), FailureKind::kWorkerGone);
  } catch (const std::bad_alloc&) {
    connection_failed(*connection, "no memory for a frame of " + peer, FailureKind::kProtocol);
  }
  return false;
}

void Agent::expect_completion(std::uint64_t call_id, int from_rank) {
  CallPromise promise;
  {
    std::lock_guard lock(pending_mutex_);
    auto it = pending_.find(call_id);
    if (it == pending_.end() || it->second.to_rank != from_rank) return;
    promise = it->second.promise;
  }
  promise.expect_completion();
}

void Agent::read_ring_frame(const std::shared_ptr<Connection>& connection,
                            const FrameHeader& header, const Bytes& payload) {
  const std::string peer = who(connection->peer_rank);
  if (header.kind == FrameKind::kRingAnswer) {
    const RingAnswer answer = decode_ring_answer(payload, peer);
    if (!connection->ring_offered.load(std::memory_order_acquire)) {
      throw ProtocolError(fmt::format(
          "rpc: {} answered a shared-memory offer this worker never made; the connection is "
          "closed",
          peer));
    }
    if (answer.nonce != connection->offered_nonce) {
      throw ProtocolError(fmt::format(
          "rpc: {} answered another shared-memory offer than this worker's; the connection is "
          "closed",
          peer));
    }
    int none = 0;
    if (!connection->ring_answer.compare_exchange_strong(none, answer.refusal.empty() ? 1 : 2)) {
      throw ProtocolError(fmt::format(
          "rpc: {} answered this worker's shared-memory offer twice; the connection is closed",
          peer));
    }
    return;
  }
  if (connection->peer_offered_ring) {
    throw ProtocolError(
        fmt::format("rpc: {} offered a second shared-memory ring; the connection is closed", peer));
  }
  connection->peer_offered_ring = true;
  const RingOffer offer = decode_ring_offer(payload, peer);
  RingAnswer answer{offer.nonce, {}};
  if (shared_memory_domain_.empty()) {
    answer.refusal = options_.shared_memory_bytes == 0
                         ? "shared memory is off on " + who(options_.rank)
                         : who(options_.rank) + " cannot tell which host it is on";
  } else {
    try {
      connection->ring_reader = std::make_unique<RingReader>(offer, shared_memory_domain_);
    } catch (const Error& e) {
      answer.refusal = e.what();
    }
  }
  if (!answer.refusal.empty()) ++ring_offers_refused_;
  // Answered from the pool: this thread never waits for the connection's send lock.
  auto text = std::make_shared<std::string>(encode_ring_answer(answer));
  pool_.post(
      [this, connection, text] {
        const Bytes bytes(text->begin(), text->end());
        try {
          send_frame(*connection, FrameHeader{FrameKind::kRingAnswer, 0, 0, 0, bytes.size(), false},
                     {}, bytes, {}, net::deadline_after(options_.timeout));
        } catch (const Error& e) {
          connection_failed(*connection, e.what(), FailureKind::kWorkerGone);
        }
      },
      !reading_for_pool());
}

void Agent::connection_failed(Connection& connection, const std::string& reason, FailureKind kind) {
  if (connection.broken.exchange(true)) return;
  net::shutdown_socket(connection.socket.fd(), net::ShutdownHow::kBoth);
  if (!connection.outbound || connection.peer_rank < 0) return;
  {
    std::lock_guard lock(connections_mutex_);
    auto& slot = broken_[static_cast<std::size_t>(connection.peer_rank)];
    if (slot.empty()) slot = reason;
  }
  std::vector<std::uint64_t> ids;
  {
    std::lock_guard lock(pending_mutex_);
    for (const auto& [id, pending] : pending_) {
      if (pending.to_rank == connection.peer_rank) ids.push_back(id);
    }
  }
  for (std::uint64_t id : ids) {
    fail_call(id, stopping_ ? FailureKind::kShutdown : kind,
              "the connection broke during the call: " + reason);
  }
}

void Agent::dispatch(const std::shared_ptr<Connection>& connection, std::uint64_t call_id,
                     std::uint32_t timeout_ms, std::string function, Bytes payload) {
  const net::Deadline deadline = net::deadline_after(Milliseconds(timeout_ms));
  // No executor: the reply is sent on the thread that completes it, the pool thread that ran the
  // handler (a hand-over to another pool thread cost every call a context switch), and a result's
  // tensors are sent as they were when the handler returned, not as they are later.
  CallPromise reply{Executor{}};
  reply.future().then(
      [this, connection, call_id](const Reply& r) { send_reply(connection, call_id, r); });
  auto shared = std::make_shared<Bytes>(std::move(payload));
  const int caller = connection->peer_rank;
  if (!pool_.post([this, caller, deadline, function = std::move(function), shared,
                   reply] { run_handler(caller, deadline, function, std::move(*shared), reply); },
                  !reading_for_pool())) {
    reply.fail(FailureKind::kShutdown, who(options_.rank) + " is shutting down");
  }
}

void Agent::run_handler(int caller_rank, net::Deadline deadline, const std::string& function,
                        Bytes payload, const CallPromise& reply) {
  Handler handler;
  {
    std::shared_lock lock(handlers_mutex_);
    auto it = handlers_.find(function);
    if (it == handlers_.end()) {
      std::string known;
      for (const auto& [name, unused] : handlers_)
        known += (known.empty() ? "" : ", ") + name;
      reply.fail(FailureKind::kUnknownFunction,
                 fmt::format("{} has no function '{}' registered (it has: {}); register it on "
                             "every worker before calling it",
                             who(options_.rank), function, known.empty() ? "none" : known));
      return;
    }
    handler = it->second;
  }
  if (net::Clock::now() >= deadline) {
    reply.fail(FailureKind::kTimeout,
               fmt::format("its deadline passed before it ran on {}", who(options_.rank)));
    return;
  }
  try {
    handler(CallerInfo{caller_rank, workers_[static_cast<std::size_t>(caller_rank)].name, deadline},
            std::move(payload), reply);
  } catch (...) {
    const auto [type, what] = describe_current_exception();
    reply.fail(FailureKind::kRemoteException,
               fmt::format("{} threw {}: {}", who(options_.rank), type, what), type);
  }
}

void Agent::send_reply(const std::shared_ptr<Connection>& connection, std::uint64_t call_id,
                       const Reply& reply) {
  if (connection->broken) return;  // the caller is gone: nobody to answer
  FrameHeader header{reply.ok() ? FrameKind::kReply : FrameKind::kFailure, call_id, 0, 0, 0};
  std::string name;
  Bytes message;
  const Bytes* payload = &reply.payload;
  const std::vector<Attachment> none;
  const std::vector<Attachment>* attachments = &reply.attachments;
  if (!reply.ok()) {
    attachments = &none;
    name.push_back(static_cast<char>(reply.failure->kind));
    name += reply.failure->type_name.substr(0, limits_.max_name_bytes - 1);
    message.assign(reply.failure->message.begin(), reply.failure->message.end());
    payload = &message;
  }
  header.name_bytes = static_cast<std::uint32_t>(name.size());
  header.payload_bytes = payload->size();
  for (const auto& a : *attachments)
    header.payload_bytes += a.size;
  try {
    send_frame(*connection, header, name, *payload, *attachments,
               net::deadline_after(options_.timeout));
  } catch (const Error& e) {
    connection_failed(*connection, e.what(), FailureKind::kWorkerGone);
  }
}

}  // namespace ddp::rpc::transport
