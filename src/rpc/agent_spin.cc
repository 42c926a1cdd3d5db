// Threads that spin while they wait read the connections their work comes on themselves
// (leader/follower): a caller waiting for its reply reads the outbound connection, the pool's
// spinning thread the inbound ones. Meanwhile the connections' reader threads sleep on a futex of
// their own instead of in poll on the sockets, so a frame wakes nobody: on this host a wake-up
// across vCPUs costs about 15 us, and an empty call paid two of them (issue 51). A reader sleeps
// so only while a thread holds a lease on its connection, renewed as it spins (and, outbound,
// while every pending call has a thread spinning for it); when the lease ends the reader is back
// in poll within it, or at once when a spinner gives up (unpark).
#include <poll.h>

#include <chrono>
#include <shared_mutex>

#include "net/shared_memory.h"
#include "rpc/agent.h"
#include "rpc/agent_connection.h"

namespace ddp::rpc::transport {
namespace {

// How long a spinner's claim on a connection lasts unless renewed: the longest a frame can wait
// for a reader when its spinner stops without saying so (a pool thread whose handler blocks).
constexpr std::int64_t kLeaseNs = 1'000'000;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic_ref<std::uint32_t> word(std::uint32_t& w) {
  return std::atomic_ref<std::uint32_t>(w);
}

}  // namespace

bool readable_now(const net::Socket& socket) {
  pollfd p{socket.fd(), POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

bool& reading_for_pool() {
  thread_local bool reading = false;
  return reading;
}

// A caller spinning for the reply of one call (Agent::call_attached with caller_spins).
class Agent::CallerSpin final : public SpinHook {
 public:
  CallerSpin(Agent& agent, std::shared_ptr<Connection> connection, std::uint64_t call_id)
      : agent_(agent), life_(agent.life_), connection_(std::move(connection)), call_id_(call_id) {}
  void poll() override {
    std::shared_lock lock(life_->mutex, std::try_to_lock);
    if (!lock.owns_lock() || !life_->alive) return;
    connection_->lease_until.store(now_ns() + kLeaseNs, std::memory_order_release);
    agent_.try_read(connection_, false);
  }
  void end(bool found) override {
    if (found) return;
    // Going to sleep: from now on the connection's reader takes this call's reply.
    std::shared_lock lock(life_->mutex);
    if (life_->alive) agent_.uncover(call_id_);
  }

 private:
  Agent& agent_;
  std::shared_ptr<Life> life_;
  std::shared_ptr<Connection> connection_;
  std::uint64_t call_id_;
};

// The pool's spinning thread (TaskPool::run): it reads the inbound connections for requests.
class Agent::PoolSpin final : public SpinHook {
 public:
  explicit PoolSpin(Agent& agent) : agent_(agent), life_(agent.life_) {}
  void poll() override {
    std::shared_lock lock(life_->mutex, std::try_to_lock);
    if (!lock.owns_lock() || !life_->alive ||
        !agent_.inbound_ready_.load(std::memory_order_acquire)) {
      return;
    }
    agent_.pool_lease_until_.store(now_ns() + kLeaseNs, std::memory_order_release);
    for (const auto& connection : agent_.inbound_snapshot_) {
      if (agent_.try_read(connection, true)) return;  // this thread takes its task next
    }
  }
  void end(bool found) override {
    // With a task found, the lease runs on: this thread spins again after the task, and a task
    // that blocks ends the lease by its time.
    if (found) return;
    std::shared_lock lock(life_->mutex, std::try_to_lock);
    if (!lock.owns_lock() || !life_->alive ||
        !agent_.inbound_ready_.load(std::memory_order_acquire)) {
      return;
    }
    agent_.pool_lease_until_.store(0, std::memory_order_release);
    for (const auto& connection : agent_.inbound_snapshot_)
      unpark(*connection);
  }

 private:
  Agent& agent_;
  std::shared_ptr<Life> life_;
};

void Agent::set_up_spinning() {
  {
    std::lock_guard lock(connections_mutex_);
    for (const auto& connection : inbound_)
      if (connection) inbound_snapshot_.push_back(connection);
  }
  pool_spin_ = std::make_unique<PoolSpin>(*this);
  pool_.set_spin_hook(pool_spin_.get());
  inbound_ready_.store(true, std::memory_order_release);
}

std::shared_ptr<SpinHook> Agent::caller_spin(const std::shared_ptr<Connection>& connection,
                                             std::uint64_t call_id) {
  // Before the request goes out: the reader parks before the reply can come.
  connection->lease_until.store(now_ns() + kLeaseNs, std::memory_order_release);
  return std::make_shared<CallerSpin>(*this, connection, call_id);
}

bool Agent::try_read(const std::shared_ptr<Connection>& connection, bool for_pool) {
  if (connection->broken) return false;
  std::unique_lock lock(connection->read_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (!connection->reader.buffered() && !readable_now(connection->socket)) return false;
  reading_for_pool() = for_pool;
  bool ok = read_one_frame(connection);
  reading_for_pool() = false;
  // Frames the same recv brought along wait in the buffer, where no poll of the socket would
  // show them to the reader thread: this thread handles them too (their tasks wake other threads).
  while (ok && connection->reader.buffered())
    ok = read_one_frame(connection);
  if (for_pool && ok && readable_now(connection->socket)) {
    // A burst: more than this thread takes one at a time. The readers take over.
    pool_lease_until_.store(0, std::memory_order_release);
    for (const auto& c : inbound_snapshot_)
      unpark(*c);
  }
  return true;
}

bool Agent::park(Connection& connection) {
  auto lease = [&]() -> std::int64_t {
    if (!connection.outbound) return pool_lease_until_.load(std::memory_order_acquire);
    if (connection.uncovered.load(std::memory_order_acquire) != 0) return 0;
    return connection.lease_until.load(std::memory_order_acquire);
  };
  const std::int64_t now = now_ns();
  if (lease() <= now || !inbound_ready_.load(std::memory_order_acquire)) return false;
  // Never with frames waiting: a spinner takes one at a time, a burst is the reader's.
  if (readable_now(connection.socket)) return false;
  {
    std::unique_lock lock(connection.read_mutex, std::try_to_lock);
    if (lock.owns_lock() && connection.reader.buffered()) return false;
  }
  const std::uint32_t seen = word(connection.park_word).load(std::memory_order_acquire);
  // Again after reading the word: an unpark since the first look has bumped it, or ended the
  // lease, and the wait below returns at once or is skipped.
  const std::int64_t until = lease();
  if (until <= now || connection.broken) return true;
  net::futex_wait(&connection.park_word, seen,
                  std::chrono::nanoseconds(std::min(until - now, kLeaseNs)));
  return true;
}

void Agent::unpark(Connection& connection) {
  word(connection.park_word).fetch_add(1, std::memory_order_acq_rel);
  net::futex_wake_all(&connection.park_word);
}

void Agent::uncover(std::uint64_t call_id) {
  std::shared_ptr<Connection> connection;
  {
    std::lock_guard lock(pending_mutex_);
    auto it = pending_.find(call_id);
    if (it == pending_.end() || it->second.uncovered || !it->second.connection) return;
    it->second.uncovered = true;
    if (it->second.connection->uncovered.fetch_add(1) == 0) connection = it->second.connection;
  }
  if (connection) unpark(*connection);
}

void Agent::release_cover(const Pending& pending) {
  if (pending.uncovered && pending.connection) pending.connection->uncovered.fetch_sub(1);
}

}  // namespace ddp::rpc::transport
