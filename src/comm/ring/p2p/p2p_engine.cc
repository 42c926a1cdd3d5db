#include "comm/ring/p2p/p2p_engine.h"

#include <sys/eventfd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "comm/argument_checks.h"
#include "comm/ring/p2p/p2p_connector.h"
#include "comm/ring/p2p/p2p_state.h"
#include "ddp/error.h"
#include "net/descriptors.h"
#include "net/fd_io.h"

namespace ddp::comm::p2p {
namespace {

// A Work whose wait() first drives its connection on the waiting thread for a moment.
class P2pWork final : public Work {
 public:
  P2pWork(std::string description, milliseconds timeout, std::chrono::microseconds spin,
          std::function<void()> help)
      : Work(std::move(description), timeout), spin_(spin), help_(std::move(help)) {}

 protected:
  void help_until_completed() override {
    if (spin_.count() <= 0) return;
    const auto until = Clock::now() + spin_;
    while (!is_completed() && Clock::now() < until) {
      help_();
      if (!is_completed()) std::this_thread::yield();
    }
  }

 private:
  std::chrono::microseconds spin_;
  std::function<void()> help_;
};

// A receive's checks and fields, before it is bound to a peer (recv and recv_any_source).
std::shared_ptr<RecvOp> make_recv_op(void* buf, std::size_t count, DType dtype, int tag,
                                     const CallOptions& options, milliseconds group_timeout) {
  check_enums("recv", dtype, std::nullopt);
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  auto op = std::make_shared<RecvOp>();
  op->timeout = options.timeout.count() > 0 ? options.timeout : group_timeout;
  op->deadline = net::deadline_after(op->timeout);
  op->data = static_cast<std::byte*>(buf);
  op->count = count;
  op->dtype = dtype;
  op->tag = tag;
  return op;
}

}  // namespace

std::shared_ptr<Work> P2pEngine::State::make_work(std::string description, milliseconds timeout,
                                                  int peer, const std::shared_ptr<State>& self) {
  std::weak_ptr<State> weak = self;
  return std::make_shared<P2pWork>(std::move(description), timeout, options.spin, [weak, peer] {
    if (auto s = weak.lock()) s->help(peer);
  });
}

P2pEngine::P2pEngine(int size, std::unique_ptr<P2pConnector> connector, EngineOptions options)
    : state_(std::make_shared<State>()), connector_(std::move(connector)) {
  state_->options = std::move(options);
  state_->peers.resize(static_cast<std::size_t>(size));
  state_->connector = connector_.get();
  state_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (state_->wake_fd < 0) {
    throw Error(fmt::format("eventfd failed for the point-to-point engine of group '{}': {}",
                            state_->options.group, net::system_error_text(errno)));
  }
  thread_ = std::thread([s = state_] { s->run(); });
  if (connector_) connector_->start(*this);
}

int P2pEngine::connections() const {
  std::lock_guard lock(state_->mutex);
  return static_cast<int>(std::count_if(state_->peers.begin(), state_->peers.end(),
                                        [](const Peer& p) { return p.fd >= 0; }));
}

void P2pEngine::adopt(int peer, net::Socket socket) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  Peer& p = s.peers[static_cast<std::size_t>(peer)];
  // A peer that failed meanwhile (its operations timed out, or the group was aborted) gets its
  // connection closed: it sees the close and fails too. A second connection is a protocol
  // violation of the peer: dropped the same way.
  if (s.stopping || p.fd >= 0 || p.failed) return;
  socket.set_nonblocking(true);
  p.fd = socket.fd();
  p.socket = std::move(socket);
  if (!p.out.empty()) s.write_to(p);
  // The Works this completed complete on the progress thread (its next turn drains them): their
  // callbacks must not run on the connector's thread, which a callback that drops the group
  // would have to join.
  s.wake();
}

void P2pEngine::fail_connection(int peer, std::exception_ptr error) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  s.fail_peer(s.peers[static_cast<std::size_t>(peer)], std::move(error));
  s.wake();  // as in adopt()
}

P2pEngine::~P2pEngine() {
  State& s = *state_;
  if (thread_.get_id() == std::this_thread::get_id()) {
    // Dropped from a Work callback on the progress thread: it cannot wait for itself. It stops
    // after the callback returns, and the state (and the connections) go with its reference.
    if (connector_) connector_->stop();
    std::lock_guard lock(s.mutex);
    s.stopping = true;
    s.connector = nullptr;
    thread_.detach();
    return;
  }
  {
    // Every operation has a deadline, so this wait is bounded. The connector still runs: an
    // operation may be waiting for its connection.
    std::unique_lock lock(s.mutex);
    s.idle_cv.wait(lock, [&] { return s.all_idle(); });
  }
  if (connector_) connector_->stop();
  {
    std::lock_guard lock(s.mutex);
    s.stopping = true;
    s.connector = nullptr;
    s.wake();
  }
  thread_.join();
  // Let the kernel deliver what was written (a close with unread input would reset the
  // connection and could drop it), then close.
  for (auto& p : s.peers) {
    if (p.fd >= 0) net::shutdown_socket(p.fd, net::ShutdownHow::kWrite);
  }
  const auto until = Clock::now() + kCloseLinger;
  for (auto& p : s.peers) {
    // A peer whose end is gone (a write failed) takes nothing more: no waiting for it.
    if (p.fd < 0 || p.failed || p.write_broken) continue;
    for (;;) {
      while (net::recv_nonblocking(p.fd, s.discard.data(), s.discard.size()) > 0) {
      }
      if (net::unsent_bytes(p.fd) <= 0 || Clock::now() >= until) break;
      ::usleep(1000);
    }
  }
}

std::shared_ptr<Work> P2pEngine::send(const void* buf, std::size_t count, DType dtype, int dst,
                                      int tag, CallOptions options) {
  check_enums("send", dtype, std::nullopt);
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  State& s = *state_;
  auto op = std::make_shared<SendOp>();
  op->timeout = options.timeout.count() > 0 ? options.timeout : s.options.timeout;
  op->deadline = net::deadline_after(op->timeout);
  op->data = static_cast<const std::byte*>(buf);
  op->bytes = count * dtype_size(dtype);
  op->peer = dst;
  std::unique_lock lock(s.mutex);
  Peer& p = s.peers[static_cast<std::size_t>(dst)];
  op->header.dtype = static_cast<std::uint8_t>(dtype);
  op->header.tag = tag;
  op->header.count = count;
  op->header.message = p.next_message++;
  op->work = s.make_work(describe_send(dtype, count, tag, dst, op->header.message), op->timeout,
                         dst, state_);
  auto work = op->work;
  std::exception_ptr error = s.poison ? s.poison : p.failed;
  if (!error && (p.closed || p.write_broken)) {
    error = s.comm_error(CommErrorKind::kPeerGone,
                         fmt::format("rank {}: {} in group '{}': rank {} closed its "
                                     "point-to-point connection (it destroyed its group or "
                                     "exited)",
                                     s.options.rank, work->description(), s.options.group, dst),
                         work->description(), op->header.message, dst);
  }
  if (error) {
    lock.unlock();
    work->complete(error);
    return work;
  }
  p.sends[op->header.message] = op;
  s.need_connection(p);
  if (op->bytes <= kEagerMaxBytes && eager_cost(op->bytes) <= p.credit) {
    p.credit -= eager_cost(op->bytes);
    op->header.type = FrameType::kEager;
    p.out.push_back(OutItem{op->header, op->data, op->bytes, 0, op});
  } else {
    op->header.type = FrameType::kRequest;
    p.out.push_back(OutItem{op->header, nullptr, 0, 0, nullptr});
  }
  // Write at once when the connection is free: no hand-off to the progress thread.
  if (p.out.size() == 1) s.write_to(p);
  if (!p.out.empty()) s.wake();
  s.note_deadline(op->deadline);
  s.drain(lock);
  return work;
}

std::shared_ptr<Work> P2pEngine::recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                      CallOptions options) {
  State& s = *state_;
  auto op = make_recv_op(buf, count, dtype, tag, options, s.options.timeout);
  op->peer = src;
  std::unique_lock lock(s.mutex);
  Peer& p = s.peers[static_cast<std::size_t>(src)];
  op->number = p.next_recv++;
  op->order = s.next_post_order++;
  op->work =
      s.make_work(describe_recv(dtype, count, tag, src, op->number), op->timeout, src, state_);
  auto work = op->work;
  if (std::exception_ptr error = s.poison ? s.poison : p.failed) {
    lock.unlock();
    work->complete(error);
    return work;
  }
  p.recvs[op->number] = op;
  s.need_connection(p);
  s.match_posted(p, op);
  if (!p.out.empty()) {
    if (p.out.size() == 1) s.write_to(p);
    if (!p.out.empty()) s.wake();
  }
  if (p.recvs.count(op->number) != 0) s.note_deadline(op->deadline);
  s.drain(lock);
  return work;
}

std::shared_ptr<Work> P2pEngine::recv_any_source(void* buf, std::size_t count, DType dtype,
                                                 int* source, int tag, CallOptions options) {
  State& s = *state_;
  auto op = make_recv_op(buf, count, dtype, tag, options, s.options.timeout);
  op->peer = -1;
  op->source = source;
  std::unique_lock lock(s.mutex);
  op->order = s.next_post_order++;
  op->work =
      s.make_work(describe_recv_any(dtype, count, tag, s.next_any++), op->timeout, -1, state_);
  auto work = op->work;
  if (s.poison) {
    lock.unlock();
    work->complete(s.poison);
    return work;
  }
  s.need_every_connection();
  s.match_posted_any(op);
  // Bound to a peer, it may have queued a clear-to-send or a rejection for it.
  if (op->peer >= 0) {
    Peer& p = s.peers[static_cast<std::size_t>(op->peer)];
    if (!p.out.empty()) {
      if (p.out.size() == 1) s.write_to(p);
      if (!p.out.empty()) s.wake();
    }
  }
  s.note_deadline(op->deadline);
  s.drain(lock);
  return work;
}

void P2pEngine::abort(std::exception_ptr error) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  if (!s.poison) s.poison = error;
  for (auto& p : s.peers)
    s.fail_peer(p, s.poison);
  s.wake();
  s.drain(lock);
}

}  // namespace ddp::comm::p2p
