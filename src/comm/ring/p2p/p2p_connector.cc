#include "comm/ring/p2p/p2p_connector.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "comm/ring/p2p/p2p_engine.h"
#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "net/descriptors.h"
#include "net/fd_io.h"

namespace ddp::comm::p2p {

P2pConnector::P2pConnector(Store& store, const MeshParams& params, net::Deadline deadline)
    : params_(params) {
  params_.on_knock = [this](int from) { request(from); };  // on this connector's thread
  // A peer whose address is published listens: refused, it is gone. This thread must not spend
  // the group's timeout on it (the other connections wait behind it).
  params_.refused_for = std::chrono::seconds(3);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    throw Error(fmt::format("eventfd failed for the point-to-point connector of group '{}': {}",
                            params.group, net::system_error_text(errno)));
  }
  try {
    mesh_.open(store, params_, /*eager=*/{}, deadline);
  } catch (...) {
    ::close(wake_fd_);
    throw;
  }
}

P2pConnector::~P2pConnector() {
  stop();
  ::close(wake_fd_);
}

void P2pConnector::start(P2pEngine& engine) {
  engine_ = &engine;
  gone_.assign(static_cast<std::size_t>(params_.size), 0);
  thread_ = std::thread([this] { run(); });
}

void P2pConnector::request(int peer) {
  std::lock_guard lock(mutex_);
  requests_.push_back(peer);
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
}

void P2pConnector::stop() noexcept {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void P2pConnector::run() {
  for (;;) {
    std::vector<int> wanted;
    {
      std::lock_guard lock(mutex_);
      if (stopping_) break;
      std::uint64_t value;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd_, &value, sizeof value);
      wanted.swap(requests_);
    }
    for (const int peer : wanted) {
      if (gone_[static_cast<std::size_t>(peer)] != 0) continue;
      if (peer < params_.rank) {
        connect_below(peer);
      } else {
        knock_above(peer);
      }
    }
    // Accept (ranks above, knocks from below) until a rank above arrives or a request, a knock
    // or stop() wakes this thread. The deadline only bounds one wait: the loop comes back.
    check_knocks();
    // While knocks wait for their answer, this wait is short: they are looked at between waits.
    const auto wait = knocks_.empty() ? std::chrono::milliseconds(std::chrono::hours(1))
                                      : std::chrono::milliseconds(2);
    try {
      mesh_.accept_from_above({.deadline = net::deadline_after(wait),
                               .timeout = params_.timeout,
                               .wake_fd = wake_fd_,
                               .return_on_first = true});
    } catch (...) {
      // poll failed (out of memory, a signal storm): the operations that need a connection from
      // above fail at their deadlines; nothing to hand over. Wait a little before trying again.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    hand_over_from_above();
    check_knocks();
  }
  // Stopping (the engine is going: nothing is pending here). Knocks that reached this rank are
  // answered with a connection the engine closes: the rank that knocked waits in a receive from
  // any source, and only a connection that closes tells it that this rank has gone.
  try {
    mesh_.accept_from_above({.deadline = net::deadline_after(std::chrono::milliseconds(5)),
                             .timeout = params_.timeout});
  } catch (...) {
  }
  std::vector<int> knocked;
  {
    std::lock_guard lock(mutex_);
    knocked.swap(requests_);
  }
  for (const int peer : knocked) {
    if (peer < params_.rank && gone_[static_cast<std::size_t>(peer)] == 0) connect_below(peer);
  }
  hand_over_from_above();
}

void P2pConnector::connect_below(int peer) {
  try {
    mesh_.connect_peer(peer, {.deadline = net::deadline_after(params_.timeout),
                              .timeout = params_.timeout,
                              .op = "point-to-point"});
  } catch (const std::exception&) {
    give_up(peer, std::current_exception());
    return;
  }
  // connect_peer does nothing for a peer connected (and taken) before.
  if (mesh_.sockets()[static_cast<std::size_t>(peer)].valid()) {
    engine_->adopt(peer, mesh_.take(peer));
  }
}

void P2pConnector::knock_above(int peer) {
  try {
    knocks_.push_back({peer, mesh_.knock(peer, net::deadline_after(params_.timeout)),
                       net::Clock::now() + std::chrono::seconds(5)});
  } catch (const std::exception&) {
    give_up(peer, std::current_exception());
  }
}

void P2pConnector::give_up(int peer, std::exception_ptr error) {
  gone_[static_cast<std::size_t>(peer)] = 1;
  engine_->fail_connection(peer, std::move(error));
}

void P2pConnector::check_knocks() {
  const auto now = net::Clock::now();
  for (auto it = knocks_.begin(); it != knocks_.end();) {
    std::uint8_t byte = 0;
    std::ptrdiff_t n = 0;
    try {
      n = it->socket.recv_some(&byte, 1);
    } catch (const Error& e) {
      give_up(it->peer,
              std::make_exception_ptr(CommError(
                  CommErrorKind::kPeerGone,
                  fmt::format("rank {} of group '{}' asked rank {} to open their point-to-point "
                              "connection, but rank {} reset the request unread: it has exited or "
                              "failed ({})",
                              params_.rank, params_.group, it->peer, it->peer, e.what()),
                  params_.group, "connect", 0, it->peer)));
      it = knocks_.erase(it);
      continue;
    }
    // End of stream: taken. Past given_up_at: the connection it makes is awaited like any other.
    if (n < 0 || now >= it->given_up_at) {
      it = knocks_.erase(it);
    } else {
      ++it;
    }
  }
}

void P2pConnector::hand_over_from_above() {
  auto& sockets = mesh_.sockets();
  for (int r = params_.rank + 1; r < params_.size; ++r) {
    if (sockets[static_cast<std::size_t>(r)].valid()) engine_->adopt(r, mesh_.take(r));
  }
}

}  // namespace ddp::comm::p2p
