// P2pEngine: moving bytes, deadlines, failures and the progress thread (see p2p_state.h).
#include "comm/ring/p2p/p2p_state.h"

#include <cerrno>
#include <limits>

#include "comm/ring/p2p/p2p_connector.h"
#include "net/fd_io.h"

namespace ddp::comm::p2p {

void P2pEngine::State::drain(std::unique_lock<std::mutex>& lock) {
  while (!completions.empty()) {
    auto done = std::move(completions);
    completions.clear();
    lock.unlock();
    for (auto& [work, error] : done)
      work->complete(error);
    done.clear();  // drop the references outside the lock too
    lock.lock();
  }
  if (all_idle()) idle_cv.notify_all();
}

void P2pEngine::State::fail_pending(Peer& p, const std::exception_ptr& error) {
  for (auto& [number, op] : p.sends)
    completions.emplace_back(op->work, error);
  for (auto& [number, op] : p.recvs)
    completions.emplace_back(op->work, error);
  p.sends.clear();
  p.recvs.clear();
  p.posted.clear();
  p.awaiting_data.clear();
  p.out.clear();
  p.in_recv.reset();
  p.in_left = 0;
}

void P2pEngine::State::fail_peer(Peer& p, std::exception_ptr error) {
  if (p.failed) return;
  p.failed = error;
  fail_pending(p, error);
  p.unexpected.clear();
  if (p.fd >= 0) net::shutdown_socket(p.fd, net::ShutdownHow::kBoth);
  fail_any_if_no_peer_left(error);
}

std::string P2pEngine::State::first_pending(const Peer& p) const {
  if (!p.recvs.empty()) {
    const auto& r = *p.recvs.begin()->second;
    return describe_recv(r.dtype, r.count, r.tag, r.peer, r.number);
  }
  if (!p.sends.empty()) return p.sends.begin()->second->work->description();
  return "point-to-point";
}

std::exception_ptr P2pEngine::State::closed_error(const Peer& p, const std::string& detail,
                                                  const std::string& named) const {
  const int peer = peer_index(p);
  const std::string reason = options.reason_of ? options.reason_of(peer) : std::string();
  const std::string op = named.empty() ? first_pending(p) : named;
  const std::string others = p.recvs.empty() ? std::string() : unmatched(p);
  return comm_error(
      reason.empty() ? CommErrorKind::kPeerGone : CommErrorKind::kAborted,
      fmt::format("rank {}: rank {} closed the point-to-point connection of group '{}'{} during "
                  "{}{}{}",
                  options.rank, peer, options.group, detail, op,
                  reason.empty() ? fmt::format(" (rank {} left no reason: it died, failed, timed "
                                               "out or destroyed its group)",
                                               peer)
                                 : fmt::format("; rank {} reported: {}", peer, reason),
                  others.empty() ? std::string()
                                 : fmt::format("; rank {} had sent {}, which no receive took (a "
                                               "different tag?)",
                                               peer, others)),
      op, 0, peer);
}

void P2pEngine::State::on_closed(Peer& p, const std::string& detail) {
  if (p.in_header_done != 0 || p.in_left != 0) return fail_peer(p, closed_error(p, detail));
  p.closed = true;
  // Everything the peer sent has been read: the receives still pending cannot be satisfied.
  if (!p.idle()) fail_pending(p, closed_error(p, detail));
  for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
    it = it->complete && it->header.type == FrameType::kEager ? std::next(it)
                                                              : p.unexpected.erase(it);
  }
  if (!any_posted.empty() && !any_peer_left()) {
    const std::string waiting = any_posted.front()->work->description();
    fail_any_if_no_peer_left(comm_error(
        CommErrorKind::kPeerGone,
        fmt::format("rank {}: {} in group '{}' cannot match: every other rank closed its "
                    "point-to-point connection (the last was rank {}{}) without sending it",
                    options.rank, waiting, options.group, peer_index(p), detail),
        waiting, 0, -1));
  }
}

void P2pEngine::State::on_write_broken(Peer& p, const std::string& detail) {
  p.write_broken = true;
  p.out.clear();
  if (!p.sends.empty()) {
    const auto error = closed_error(p, detail, p.sends.begin()->second->work->description());
    for (auto& [number, op] : p.sends)
      completions.emplace_back(op->work, error);
    p.sends.clear();
  }
}

void P2pEngine::State::fail_protocol(Peer& p, const std::string& what) {
  const int peer = peer_index(p);
  fail_peer(p, comm_error(CommErrorKind::kTransport,
                          fmt::format("rank {}: rank {} sent a malformed point-to-point frame in "
                                      "group '{}' ({}); is it running the same ddp version?",
                                      options.rank, peer, options.group, what),
                          "point-to-point", 0, peer));
}

void P2pEngine::State::read_from(Peer& p) {
  std::size_t budget = kReadBudget;
  while (!p.failed && !p.closed && budget > 0) {
    ssize_t n;
    if (p.in_left > 0) {
      std::byte* dst = p.in_discard ? discard.data() : p.in_dst;
      const std::size_t len = p.in_discard ? std::min(p.in_left, discard.size()) : p.in_left;
      n = net::recv_nonblocking(p.fd, dst, len);
      if (n > 0) {
        if (!p.in_discard) p.in_dst += n;
        p.in_left -= static_cast<std::size_t>(n);
        budget -= std::min(budget, static_cast<std::size_t>(n));
        if (p.in_left == 0) payload_done(p);
        continue;
      }
    } else {
      auto* dst = reinterpret_cast<std::byte*>(&p.in) + p.in_header_done;
      n = net::recv_nonblocking(p.fd, dst, kFrameBytes - p.in_header_done);
      if (n > 0) {
        p.in_header_done += static_cast<std::size_t>(n);
        if (p.in_header_done == kFrameBytes) {
          p.in_header_done = 0;
          on_frame(p);
        }
        continue;
      }
    }
    if (n == 0) return on_closed(p, "");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return;
    // A reset once the bytes that arrived before it are read (e.g. the peer exited with our
    // credit unread): the stream ended there, as with EOF, and nothing can be written any more.
    if (errno == ECONNRESET) {
      p.write_broken = true;
      return on_closed(p, fmt::format(" ({})", error_text(errno)));
    }
    return fail_peer(p, closed_error(p, fmt::format(" ({})", error_text(errno))));
  }
}

void P2pEngine::State::need_connection(Peer& p) {
  if (p.fd >= 0 || p.connect_requested || connector == nullptr) return;
  p.connect_requested = true;
  connector->request(peer_index(p));
}

void P2pEngine::State::need_every_connection() {
  if (connected_to_all) return;
  connected_to_all = true;
  for (auto& p : peers) {
    if (peer_index(p) != options.rank) need_connection(p);
  }
}

std::string P2pEngine::State::unconnected_reason(const Peer& p) const {
  const int peer = peer_index(p);
  if (peer < options.rank) {
    return fmt::format("connecting to rank {} did not complete (is it stuck?)", peer);
  }
  return fmt::format(
      "rank {} never opened the point-to-point connection, which it does when asked (the higher "
      "rank of a pair connects): it is stuck, or died without closing its listener",
      peer);
}

void P2pEngine::State::write_to(Peer& p) {
  if (p.closed || p.write_broken) {
    p.out.clear();  // only control frames can be left for a peer that has gone
    return;
  }
  if (p.fd < 0) return;  // not connected yet: written once it is (P2pEngine::adopt)
  while (!p.out.empty() && !p.failed) {
    iovec iov[kMaxIov];
    int n_iov = 0;
    for (auto it = p.out.begin(); it != p.out.end() && n_iov + 2 <= kMaxIov; ++it) {
      if (it->done < kFrameBytes) {
        iov[n_iov++] = {reinterpret_cast<char*>(&it->header) + it->done, kFrameBytes - it->done};
      }
      const std::size_t off = it->done > kFrameBytes ? it->done - kFrameBytes : 0;
      if (it->bytes > off) {
        iov[n_iov++] = {const_cast<std::byte*>(it->payload) + off, it->bytes - off};
      }
    }
    const ssize_t n = net::send_iov_nonblocking(p.fd, iov, n_iov);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // The peer closed its end; what it sent before may still be unread here (see
      // on_write_broken).
      if (errno == EPIPE || errno == ECONNRESET) {
        return on_write_broken(p, fmt::format(" ({})", error_text(errno)));
      }
      return fail_peer(p, closed_error(p, fmt::format(" ({})", error_text(errno))));
    }
    auto left = static_cast<std::size_t>(n);
    while (left > 0 && !p.out.empty()) {
      OutItem& item = p.out.front();
      const std::size_t take = std::min(left, kFrameBytes + item.bytes - item.done);
      item.done += take;
      left -= take;
      if (item.done == kFrameBytes + item.bytes) {
        auto op = std::move(item.completes);
        p.out.pop_front();
        if (op) finish_send(p, op, nullptr);
      }
    }
  }
}

void P2pEngine::State::check_deadlines() {
  const auto now = Clock::now();
  Clock::time_point next = Clock::time_point::max();
  for (auto& p : peers) {
    std::exception_ptr timed_out;
    for (auto& [number, op] : p.sends) {
      if (op->deadline <= now) {
        timed_out = timeout_error(p, *op);
        break;
      }
      next = std::min(next, op->deadline);
    }
    for (auto& [number, op] : p.recvs) {
      if (timed_out) break;
      if (op->deadline <= now) {
        timed_out = timeout_error(p, *op);
        break;
      }
      next = std::min(next, op->deadline);
    }
    if (timed_out) fail_peer(p, timed_out);
  }
  // A receive from any source that no message bound times out alone: no connection is to blame.
  for (auto it = any_posted.begin(); it != any_posted.end();) {
    if ((*it)->deadline <= now) {
      completions.emplace_back((*it)->work, any_timeout_error(**it));
      it = any_posted.erase(it);
    } else {
      next = std::min(next, (*it)->deadline);
      ++it;
    }
  }
  next_check = next;
}

std::exception_ptr P2pEngine::State::timeout_error(const Peer& p, const SendOp& op) const {
  const int peer = peer_index(p);
  const std::string what = p.fd < 0 ? unconnected_reason(p)
                           : op.header.type == FrameType::kRequest && !op.cleared
                               ? fmt::format(
                                     "rank {} posted no matching receive (same tag, in "
                                     "posting order)",
                                     peer)
                               : fmt::format("rank {} did not read it", peer);
  const std::string desc = op.work->description();
  return comm_error(CommErrorKind::kTimeout,
                    fmt::format("rank {} timed out after {} ms in {} in group '{}': {}",
                                options.rank, op.timeout.count(), desc, options.group, what),
                    desc, op.header.message, peer);
}

std::string P2pEngine::State::unmatched(const Peer& p) const {
  std::string others;
  for (const auto& u : p.unexpected) {
    if (u.claimed || u.rejected) continue;
    if (others.size() > 400) {
      others += ", …";
      break;
    }
    others += fmt::format("{}{}", others.empty() ? "" : ", ",
                          describe_send(static_cast<DType>(u.header.dtype), u.header.count,
                                        u.header.tag, options.rank, u.header.message));
  }
  return others;
}

std::exception_ptr P2pEngine::State::timeout_error(const Peer& p, const RecvOp& op) const {
  const int peer = peer_index(p);
  const std::string others = unmatched(p);
  const std::string desc = op.work->description();
  const std::string what =
      p.fd < 0         ? unconnected_reason(p)
      : others.empty() ? fmt::format("rank {} sent no message with tag {} for it", peer, op.tag)
                       : fmt::format(
                             "rank {} sent no message with tag {} for it, but sent {}, which no "
                             "receive took (a different tag?)",
                             peer, op.tag, others);
  return comm_error(CommErrorKind::kTimeout,
                    fmt::format("rank {} timed out after {} ms in {} in group '{}': {}",
                                options.rank, op.timeout.count(), desc, options.group, what),
                    desc, op.number, peer);
}

std::exception_ptr P2pEngine::State::any_timeout_error(const RecvOp& op) const {
  std::string others;
  for (const Peer& p : peers) {
    const std::string sent = unmatched(p);
    if (!sent.empty())
      others += fmt::format("{}rank {} sent {}", others.empty() ? "" : "; ", peer_index(p), sent);
  }
  const std::string desc = op.work->description();
  return comm_error(
      CommErrorKind::kTimeout,
      fmt::format("rank {} timed out after {} ms in {} in group '{}': no rank sent a message with "
                  "tag {} for it{}",
                  options.rank, op.timeout.count(), desc, options.group, op.tag,
                  others.empty() ? std::string()
                                 : fmt::format(", but {}, which no receive took (a different "
                                               "tag?)",
                                               others)),
      desc, op.number, -1);
}

void P2pEngine::State::note_deadline(Clock::time_point deadline) {
  if (deadline < next_check) {
    next_check = deadline;
    wake();
  }
}

void P2pEngine::State::help(int peer) {
  if (peer < 0) return;  // a receive from any source: the progress thread watches every peer
  std::unique_lock lock(mutex, std::try_to_lock);
  if (!lock.owns_lock() || stopping) return;
  Peer& p = peers[static_cast<std::size_t>(peer)];
  if (p.fd < 0 || p.failed || p.closed) return;
  if (!p.out.empty()) write_to(p);
  read_from(p);
  if (!p.out.empty()) write_to(p);  // e.g. a rejection, before its receive fails
  if (!p.out.empty()) wake();       // what it could not write is the progress thread's
  drain(lock);
}

void P2pEngine::State::run() {
  std::unique_lock lock(mutex);
  std::vector<pollfd> fds;
  std::vector<int> who;
  while (!stopping) {
    for (auto& p : peers) {
      if (p.fd >= 0 && !p.failed && !p.out.empty()) write_to(p);
    }
    if (Clock::now() >= next_check) check_deadlines();
    drain(lock);
    if (stopping) break;
    fds.clear();
    who.clear();
    fds.push_back({wake_fd, POLLIN, 0});
    who.push_back(-1);
    for (auto& p : peers) {
      if (p.fd < 0 || p.failed || p.closed) continue;
      fds.push_back({p.fd, static_cast<short>(POLLIN | (p.out.empty() ? 0 : POLLOUT)), 0});
      who.push_back(peer_index(p));
    }
    const auto now = Clock::now();
    int timeout_ms = 1000;
    if (next_check != Clock::time_point::max()) {
      const auto left =
          std::chrono::duration_cast<milliseconds>(next_check - now) + milliseconds(1);
      timeout_ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1000));
    }
    lock.unlock();
    const int ready = net::poll_fds(fds, timeout_ms);
    lock.lock();
    if (ready <= 0) continue;
    if (fds[0].revents & POLLIN) {
      std::uint64_t value;
      [[maybe_unused]] const ssize_t n = ::read(wake_fd, &value, sizeof value);
    }
    for (std::size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Peer& p = peers[static_cast<std::size_t>(who[i])];
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_from(p);
      if ((fds[i].revents & POLLOUT) && !p.failed) write_to(p);
    }
  }
  // Control frames still queued (a rejection, credit) go out before the connections close:
  // they are small, the sockets take them.
  for (auto& p : peers) {
    if (p.fd >= 0 && !p.failed && !p.out.empty()) write_to(p);
  }
  // Stopped with operations pending (only when the group was dropped from a callback on this
  // thread): they fail rather than never complete.
  if (!all_idle()) {
    const auto error =
        comm_error(CommErrorKind::kAborted,
                   fmt::format("rank {}: group '{}' was destroyed with this operation pending",
                               options.rank, options.group),
                   "point-to-point", 0, -1);
    for (auto& p : peers)
      fail_pending(p, error);
    for (auto& op : any_posted)
      completions.emplace_back(op->work, error);
    any_posted.clear();
    drain(lock);
  }
}

}  // namespace ddp::comm::p2p
