#include "rpc/agent.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "ddp/error.h"
#include "net/fd_io.h"
#include "rpc/agent_connection.h"
#include "rpc/current_exception.h"
#include "settings/settings.h"

namespace ddp::rpc::transport {
namespace {

using namespace std::chrono_literals;

std::atomic<int> g_agent_instances{0};

std::string random_session(bool secret) {
  if (secret) {
    const auth::Nonce nonce = auth::random_nonce();
    std::string hex;
    for (std::uint8_t b : nonce)
      hex += fmt::format("{:02x}", b);
    return hex;
  }
  std::random_device device;
  return fmt::format("{:08x}{:08x}", device(), device());
}

// Sends every byte of `iov` or throws: TimeoutError at the deadline, Error when the connection
// fails.
void send_all_iov(int fd, iovec* iov, int count, net::Deadline deadline, const std::string& peer) {
  int at = 0;
  while (at < count) {
    if (iov[at].iov_len == 0) {
      ++at;
      continue;
    }
    // sendmsg takes at most IOV_MAX buffers at a time (a message with many attachments has more).
    const ssize_t sent = net::send_iov_nonblocking(fd, iov + at, std::min(count - at, IOV_MAX));
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        throw Error(fmt::format("rpc: sending to {} failed: {}", peer, std::strerror(errno)));
      }
      pollfd p{fd, POLLOUT, 0};
      const int ready = net::poll_fds({&p, 1}, net::poll_timeout_ms(deadline));
      if (ready == 0 && net::Clock::now() >= deadline) {
        throw TimeoutError(
            fmt::format("rpc: sending to {} did not finish by its deadline (the "
                        "peer does not read)",
                        peer));
      }
      continue;
    }
    auto left = static_cast<std::size_t>(sent);
    while (at < count && left >= iov[at].iov_len) {
      left -= iov[at].iov_len;
      ++at;
    }
    if (at < count) {
      iov[at].iov_base = static_cast<std::uint8_t*>(iov[at].iov_base) + left;
      iov[at].iov_len -= left;
    }
  }
}

}  // namespace

Agent::Agent(Store& store, AgentOptions options)
    : store_(store), options_(std::move(options)), pool_(std::max(1, options_.threads)) {
  check_worker_name(options_.name);
  if (options_.spin_before_sleep < std::chrono::microseconds(0) ||
      options_.spin_before_sleep > std::chrono::microseconds(10'000)) {
    throw ConfigError(fmt::format(
        "rpc: spin_before_sleep of {} us is outside 0 to 10000 us (0: a waiting thread sleeps at "
        "once; the default, {} us, suits calls between workers of one host)",
        options_.spin_before_sleep.count(), kDefaultSpinBeforeSleep.count()));
  }
  set_spin_before_sleep(options_.spin_before_sleep);
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size) {
    throw ConfigError(fmt::format("rpc: rank {} is not in a world of {} workers", options_.rank,
                                  options_.world_size));
  }
  limits_.max_payload_bytes = options_.max_message_bytes;
  if (options_.shared_memory_bytes != 0) {
    // Refused here, where the option was given, not at the first large call.
    if (options_.shared_memory_bytes < kMinRingBytes ||
        options_.shared_memory_bytes > kMaxRingBytes ||
        options_.shared_memory_bytes % kRingHeaderBytes != 0) {
      throw ConfigError(fmt::format(
          "rpc: shared_memory_bytes of {} is not a multiple of {} from {} to {} (0 turns the "
          "shared-memory rings off)",
          options_.shared_memory_bytes, kRingHeaderBytes, kMinRingBytes, kMaxRingBytes));
    }
    shared_memory_domain_ = net::shared_memory_domain(settings::host_id());
  }
  // Before anyone can find this worker, so that no peer's first call misses them.
  for (auto& [name, handler] : options_.functions)
    register_function(name, std::move(handler));
  options_.functions.clear();
  prefix_ = fmt::format("{}/{}", options_.store_prefix, g_agent_instances++);
  listener_ = net::listen_tcp(options_.bind_host, 0);

  WorkerInfo me{options_.name, options_.rank,
                options_.host.empty() ? net::host_name() : options_.host, listener_.local_port()};
  const std::string session_key = prefix_ + "/session";
  if (options_.rank == 0) store_.set(session_key, random_session(!options_.secret.empty()));
  workers_ = exchange_workers(store_, prefix_, me, options_.world_size, options_.timeout);
  handshake_self_ = {store_.get_string(session_key, options_.timeout), options_.world_size,
                     options_.rank, options_.name, options_.secret};

  const auto world = static_cast<std::size_t>(options_.world_size);
  outbound_.resize(world);
  inbound_.resize(world);
  broken_.resize(world);
  timer_ = std::thread([this] { timer_loop(); });
  acceptor_ = std::thread([this] { accept_loop(); });
  try {
    const net::Deadline deadline = net::deadline_after(options_.timeout);
    for (const WorkerInfo& peer : workers_) {
      if (peer.rank == options_.rank) continue;
      auto connection = std::make_shared<Connection>();
      connection->socket = net::connect_tcp(peer.host, peer.port, deadline);
      connection->socket.set_no_delay(true);
      handshake_as_caller(connection->socket, handshake_self_, peer.rank, peer.name, deadline);
      connection->peer_rank = peer.rank;
      connection->outbound = true;
      std::lock_guard lock(connections_mutex_);
      outbound_[static_cast<std::size_t>(peer.rank)] = connection;
      all_connections_.push_back(connection);
      connection->thread = std::thread([this, connection] {
        read_frames(connection);
        connection->finished = true;
      });
    }
    std::unique_lock lock(connections_mutex_);
    const bool all_in = connections_cv_.wait_until(lock, deadline, [&] {
      for (int r = 0; r < options_.world_size; ++r) {
        if (r != options_.rank && !inbound_[static_cast<std::size_t>(r)]) return false;
      }
      return true;
    });
    if (!all_in) {
      std::string missing;
      for (int r = 0; r < options_.world_size; ++r) {
        if (r != options_.rank && !inbound_[static_cast<std::size_t>(r)]) {
          missing += (missing.empty() ? "" : ", ") + who(r);
        }
      }
      throw TimeoutError(fmt::format("rpc: {} did not hear from {} within {} ms of starting",
                                     who(options_.rank), missing, options_.timeout.count()));
    }
    lock.unlock();
    set_up_spinning();
  } catch (...) {
    stop();
    throw;
  }
}

Agent::~Agent() {
  stop();
}

void Agent::register_function(const std::string& name, Handler handler) {
  if (name.empty() || name.size() > limits_.max_name_bytes) {
    throw ConfigError(fmt::format("rpc: a function name must have 1 to {} bytes; '{}' has {}",
                                  limits_.max_name_bytes, name.substr(0, 200), name.size()));
  }
  std::unique_lock lock(handlers_mutex_);
  handlers_[name] = std::move(handler);
}

const WorkerInfo* Agent::find_worker(std::string_view name) const {
  for (const WorkerInfo& w : workers_) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

Executor Agent::executor() {
  return [this](std::function<void()> task) {
    auto shared = std::make_shared<std::function<void()>>(std::move(task));
    if (!pool_.post([shared] { (*shared)(); })) (*shared)();
  };
}

std::string Agent::who(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(workers_.size())) return fmt::format("rank {}", rank);
  return fmt::format("worker '{}' (rank {})", workers_[static_cast<std::size_t>(rank)].name, rank);
}

std::size_t Agent::pending_calls() const {
  std::lock_guard lock(pending_mutex_);
  return pending_.size();
}

std::string Agent::broken_reason(int rank) const {
  std::lock_guard lock(connections_mutex_);
  if (rank < 0 || rank >= static_cast<int>(broken_.size())) return {};
  return broken_[static_cast<std::size_t>(rank)];
}

CallFuture Agent::call(int to_rank, const std::string& function, Bytes payload,
                       Milliseconds timeout) {
  return call_attached(to_rank, function, Outgoing{std::move(payload), {}}, timeout);
}

CallFuture Agent::call_attached(int to_rank, const std::string& function, Outgoing payload,
                                Milliseconds timeout, bool caller_spins) {
  CallPromise promise(executor());
  CallFuture future = promise.future();
  const std::string target = who(to_rank);
  if (to_rank < 0 || to_rank >= options_.world_size) {
    promise.fail(FailureKind::kUnknownWorker,
                 fmt::format("rpc: no worker has rank {}; the world has {} (0 to {})", to_rank,
                             options_.world_size, options_.world_size - 1));
    return future;
  }
  if (stopping_) {
    promise.fail(FailureKind::kShutdown,
                 fmt::format("rpc: '{}' on {}: this worker's RPC is shut down", function, target));
    return future;
  }
  const std::size_t payload_bytes = payload.size();
  if (payload_bytes > options_.max_message_bytes || function.empty() ||
      function.size() > limits_.max_name_bytes) {
    promise.fail(
        FailureKind::kCallerError,
        fmt::format("rpc: '{}' on {}: {}", function.substr(0, 200), target,
                    function.empty() || function.size() > limits_.max_name_bytes
                        ? fmt::format("a function name has 1 to {} bytes", limits_.max_name_bytes)
                        : fmt::format("the arguments are {} bytes, more than the limit "
                                      "of {} (RpcOptions::max_message_bytes)",
                                      payload_bytes, options_.max_message_bytes)));
    return future;
  }
  const net::Deadline deadline = net::deadline_after(timeout);
  std::shared_ptr<Connection> connection;
  std::string broken;
  if (to_rank != options_.rank) {
    std::lock_guard lock(connections_mutex_);
    connection = outbound_[static_cast<std::size_t>(to_rank)];
    broken = broken_[static_cast<std::size_t>(to_rank)];
  }
  const bool uncovered = connection != nullptr && !caller_spins;
  std::uint64_t id = 0;
  bool earliest = false;
  bool unpark_reader = false;
  {
    std::lock_guard lock(pending_mutex_);
    id = next_call_id_++;
    auto [it, fresh] = pending_.emplace(
        id, Pending{promise, to_rank, function, timeout, {}, connection, uncovered});
    it->second.deadline_entry = deadlines_.emplace(deadline, id);
    earliest = deadline < timer_wakes_at_;
    // Counted under the lock that its completion uncounts it under.
    if (uncovered) unpark_reader = connection->uncovered.fetch_add(1) == 0;
  }
  // Nobody spins for this reply: the connection's reader must not stay parked.
  if (unpark_reader) unpark(*connection);
  // Only a deadline before the one the timer sleeps until wakes it (waking it for every call cost
  // a context switch per call): calls one at a time each have the earliest deadline, but the
  // timer, which still sleeps until the first one's, wakes in time for them all.
  if (earliest) timer_cv_.notify_one();

  if (to_rank == options_.rank) {
    CallPromise local(executor());
    local.future().then_take(
        [this, id](Reply reply) { complete_call(id, options_.rank, std::move(reply)); });
    auto shared = std::make_shared<Bytes>(std::move(payload).flatten());
    if (!pool_.post([this, deadline, function, shared, local] {
          run_handler(options_.rank, deadline, function, std::move(*shared), local);
        })) {
      fail_call(id, FailureKind::kShutdown, "this worker's RPC is shut down");
    }
    return future;
  }

  if (!connection || connection->broken) {
    fail_call(id, FailureKind::kWorkerGone,
              "the connection to it broke earlier: " + (broken.empty() ? "closed" : broken));
    return future;
  }
  const auto left = std::chrono::duration_cast<Milliseconds>(deadline - net::Clock::now());
  FrameHeader header{FrameKind::kRequest, id,
                     static_cast<std::uint32_t>(std::clamp<std::int64_t>(
                         left.count(), 1, std::numeric_limits<std::uint32_t>::max())),
                     static_cast<std::uint32_t>(function.size()), payload_bytes};
  if (caller_spins) promise.set_spin_hook(caller_spin(connection, id));
  try {
    send_frame(*connection, header, function, payload.bytes, payload.attachments, deadline);
  } catch (const Error& e) {
    // Part of a frame may be on the wire: the stream has lost its place, so the connection goes.
    connection_failed(*connection, e.what(), FailureKind::kWorkerGone);
  }
  return future;
}

void Agent::send_frame(Connection& connection, FrameHeader header, std::string_view name,
                       const Bytes& payload, const std::vector<Attachment>& attachments,
                       net::Deadline deadline) {
  std::lock_guard lock(connection.send_mutex);
  if (connection.broken)
    throw Error("rpc: the connection to " + who(connection.peer_rank) + " is closed");
  // Under the lock: a payload goes into the ring in the order its frame goes on the wire.
  if ((header.kind == FrameKind::kRequest || header.kind == FrameKind::kReply) &&
      header.payload_bytes >= kRingMinPayloadBytes && !shared_memory_domain_.empty()) {
    header.payload_in_ring = ring_has_room(connection, header.payload_bytes, deadline);
  }
  auto bytes = encode_frame_header(header);
  std::vector<iovec> iov{{bytes.data(), bytes.size()},
                         {const_cast<char*>(name.data()), name.size()}};
  if (!header.payload_in_ring) {
    iov.push_back({const_cast<std::uint8_t*>(payload.data()), payload.size()});
    for (const auto& a : attachments)
      iov.push_back({const_cast<std::uint8_t*>(a.data), a.size});
  }
  send_all_iov(connection.socket.fd(), iov.data(), static_cast<int>(iov.size()), deadline,
               who(connection.peer_rank));
  if (header.payload_in_ring) {
    // After the frame: the peer's reader wakes while this copies, and copies out behind it.
    connection.ring_writer->append({payload.data(), payload.size()});
    for (const auto& a : attachments)
      connection.ring_writer->append({a.data, a.size});
    ++ring_payloads_sent_;
  }
}

bool Agent::ring_has_room(Connection& connection, std::size_t total, net::Deadline deadline) {
  using State = Connection::RingState;
  if (connection.ring_state == State::kOffered) {
    const int answer = connection.ring_answer.load(std::memory_order_acquire);
    if (answer != 0) {
      connection.ring_state = answer == 1 ? State::kInUse : State::kOff;
      if (answer == 1) {
        connection.ring_writer->close_descriptor();
      } else {
        connection.ring_writer.reset();
      }
    }
  }
  if (connection.ring_state == State::kNone) {
    offer_ring(connection, deadline);
    return false;  // this payload goes by TCP: the peer has not mapped the ring yet
  }
  if (connection.ring_state != State::kInUse) return false;
  bool damaged = false;
  if (connection.ring_writer->has_room(total, damaged)) return true;
  if (damaged) {
    std::fprintf(stderr,
                 "ddp rpc: %s: %s wrote an impossible count into the shared-memory ring of their "
                 "connection; its payloads go by TCP from now on\n",
                 who(options_.rank).c_str(), who(connection.peer_rank).c_str());
    connection.ring_state = State::kOff;
    connection.ring_writer.reset();
  }
  return false;  // no room now: by TCP
}

void Agent::offer_ring(Connection& connection, net::Deadline deadline) {
  connection.ring_state = Connection::RingState::kOff;  // unless the offer goes out
  try {
    connection.ring_writer = std::make_unique<RingWriter>(options_.shared_memory_bytes);
  } catch (const Error& e) {
    // Too little shared memory: this connection stays on TCP, which is slower, not wrong.
    std::fprintf(stderr, "ddp rpc: %s: no shared-memory ring for %s (%s); its payloads go by TCP\n",
                 who(options_.rank).c_str(), who(connection.peer_rank).c_str(), e.what());
    return;
  }
  std::string offer = encode_ring_offer(connection.ring_writer->offer(shared_memory_domain_));
  connection.offered_nonce = connection.ring_writer->nonce();
  connection.ring_offered.store(true, std::memory_order_release);
  const auto bytes =
      encode_frame_header(FrameHeader{FrameKind::kRingOffer, 0, 0, 0, offer.size(), false});
  std::array<iovec, 2> iov{iovec{const_cast<std::uint8_t*>(bytes.data()), bytes.size()},
                           iovec{offer.data(), offer.size()}};
  send_all_iov(connection.socket.fd(), iov.data(), 2, deadline, who(connection.peer_rank));
  connection.ring_state = Connection::RingState::kOffered;
}

void Agent::complete_call(std::uint64_t call_id, int from_rank, Reply reply) {
  Pending pending;
  {
    std::lock_guard lock(pending_mutex_);
    auto it = pending_.find(call_id);
    if (it == pending_.end()) return;  // failed already (its deadline passed): the reply is late
    if (it->second.to_rank != from_rank) return;
    pending = std::move(it->second);
    deadlines_.erase(pending.deadline_entry);
    pending_.erase(it);
    release_cover(pending);
  }
  pending_cv_.notify_all();
  if (reply.ok()) {
    if (!reply.attachments.empty()) {  // a call to this worker itself: nothing was sent
      reply.payload = Outgoing{std::move(reply.payload), std::move(reply.attachments)}.flatten();
      reply.attachments.clear();
    }
    pending.promise.complete(std::move(reply));  // a payload is not copied on its way
    return;
  }
  Failure failure = *reply.failure;
  failure.message =
      fmt::format("rpc: '{}' on {}: {}", pending.function, who(pending.to_rank), failure.message);
  pending.promise.complete(Reply{{}, std::move(failure)});
}

void Agent::fail_call(std::uint64_t call_id, FailureKind kind, const std::string& message) {
  Pending pending;
  {
    std::lock_guard lock(pending_mutex_);
    auto it = pending_.find(call_id);
    if (it == pending_.end()) return;
    pending = std::move(it->second);
    deadlines_.erase(pending.deadline_entry);
    pending_.erase(it);
    release_cover(pending);
  }
  pending_cv_.notify_all();
  pending.promise.fail(
      kind, fmt::format("rpc: '{}' on {}: {}", pending.function, who(pending.to_rank), message));
}

void Agent::timer_loop() {
  std::unique_lock lock(pending_mutex_);
  while (!timer_stop_) {
    if (deadlines_.empty()) {
      timer_wakes_at_ = net::Deadline::max();
      timer_cv_.wait(lock);
      continue;
    }
    auto first = deadlines_.begin();
    // A copy: the entry may be erased (its call completed) while this thread waits.
    const net::Deadline earliest = first->first;
    if (net::Clock::now() < earliest) {
      timer_wakes_at_ = earliest;
      timer_cv_.wait_until(lock, earliest);
      timer_wakes_at_ = net::Clock::now();  // awake: a call's notify finds it looking anyway
      continue;
    }
    const std::uint64_t id = first->second;
    auto it = pending_.find(id);
    Pending pending = std::move(it->second);
    deadlines_.erase(first);
    pending_.erase(it);
    release_cover(pending);
    lock.unlock();
    pending_cv_.notify_all();
    pending.promise.fail(
        FailureKind::kTimeout,
        fmt::format("rpc: '{}' on {} did not complete within its deadline of {} "
                    "ms",
                    pending.function, who(pending.to_rank), pending.timeout.count()));
    lock.lock();
  }
}

void Agent::shutdown(Milliseconds timeout) {
  const net::Deadline deadline = net::deadline_after(timeout);
  try {
    {
      std::unique_lock lock(pending_mutex_);
      if (!pending_cv_.wait_until(lock, deadline, [&] { return pending_.empty(); })) {
        throw TimeoutError(
            fmt::format("rpc: shutdown of {}: {} calls of this worker were still "
                        "waiting after {} ms",
                        who(options_.rank), pending_.size(), timeout.count()));
      }
    }
    store_.set(fmt::format("{}/done/{}", prefix_, options_.rank), "1");
    std::vector<std::string> keys;
    for (int r = 0; r < options_.world_size; ++r)
      keys.push_back(fmt::format("{}/done/{}", prefix_, r));
    const auto left = std::chrono::duration_cast<Milliseconds>(deadline - net::Clock::now());
    store_.wait(keys, std::max(left, Milliseconds(1)));
  } catch (...) {
    stop();
    throw;
  }
  stop();
}

void Agent::stop() {
  std::call_once(stopped_, [&] {
    stopping_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    std::vector<std::shared_ptr<Connection>> connections;
    {
      std::lock_guard lock(connections_mutex_);
      connections = all_connections_;
    }
    for (auto& c : connections) {
      c->broken = true;
      net::shutdown_socket(c->socket.fd(), net::ShutdownHow::kBoth);
      unpark(*c);
    }
    {
      // Threads spinning in this agent's code leave it (their reads fail on the shut sockets).
      std::unique_lock lock(life_->mutex);
      life_->alive = false;
    }
    for (auto& c : connections) {
      if (c->thread.joinable()) c->thread.join();
    }
    std::vector<std::uint64_t> ids;
    {
      std::lock_guard lock(pending_mutex_);
      for (const auto& entry : pending_)
        ids.push_back(entry.first);
      timer_stop_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    for (std::uint64_t id : ids)
      fail_call(id, FailureKind::kShutdown, "this worker's RPC was stopped");
    pool_.stop();
    std::lock_guard lock(connections_mutex_);
    outbound_.clear();
    inbound_.clear();
    all_connections_.clear();
  });
}

}  // namespace ddp::rpc::transport
