#include "comm/ring/exchange.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "comm/reduce_kernels.h"
#include "net/fd_io.h"

namespace ddp::comm {

void Exchange::reset(const OpHeader& header, DType dtype, const ExchangeContext& context) {
  header_ = header;
  dtype_ = dtype;
  element_size_ = dtype_size(dtype);
  context_ = context;
  send_pieces_.clear();
  recv_pieces_.clear();
  send_streams_.clear();
  recv_streams_.clear();
  streams_done_ = 0;
  idle_peer_done_.assign(static_cast<std::size_t>(context.size), 0);
}

void Exchange::add_send_stream(int peer, int fd) {
  send_streams_.push_back(SendStream{peer, fd, 0, send_pieces_.size(), send_pieces_.size(),
                                     send_pieces_.size(), 0, false});
}

void Exchange::add_send_piece(const void* data, std::size_t len, int gate) {
  send_pieces_.push_back(SendPiece{static_cast<const std::byte*>(data), len, gate});
  send_streams_.back().last = send_pieces_.size();
}

void Exchange::add_recv_stream(int peer, int fd, std::byte* scratch, std::size_t scratch_bytes) {
  recv_streams_.push_back(RecvStream{peer, fd, scratch, scratch_bytes, header_, OpHeader{}, 0,
                                     recv_pieces_.size(), recv_pieces_.size(), recv_pieces_.size(),
                                     0});
}

int Exchange::add_recv_copy(void* dst, std::size_t len) {
  recv_pieces_.push_back(
      RecvPiece{static_cast<std::byte*>(dst), nullptr, len, 0, ReduceOp::kSum, 0});
  recv_streams_.back().last = recv_pieces_.size();
  return static_cast<int>(recv_pieces_.size() - 1);
}

int Exchange::add_recv_reduce(void* dst, const void* a, std::size_t len, ReduceOp op,
                              int avg_divisor) {
  recv_pieces_.push_back(RecvPiece{static_cast<std::byte*>(dst), static_cast<const std::byte*>(a),
                                   len, 0, op, avg_divisor});
  recv_streams_.back().last = recv_pieces_.size();
  return static_cast<int>(recv_pieces_.size() - 1);
}

// Returns whether any byte moved. Sends the header and as much of the current piece as its gate
// allows, until the socket would block.
bool Exchange::try_send(SendStream& s) {
  bool progressed = false;
  for (;;) {
    while (s.cur < s.last && s.offset == send_pieces_[s.cur].len) {
      ++s.cur;
      s.offset = 0;
    }
    if (s.header_done == sizeof(OpHeader) && s.cur == s.last) {
      ++streams_done_;
      s.fd = -1;  // marks done
      return true;
    }
    iovec iov[2];
    int iovcnt = 0;
    if (s.header_done < sizeof(OpHeader)) {
      iov[iovcnt++] = {reinterpret_cast<std::byte*>(&header_) + s.header_done,
                       sizeof(OpHeader) - s.header_done};
    }
    if (s.cur < s.last) {
      const SendPiece& piece = send_pieces_[s.cur];
      const std::size_t available =
          piece.gate < 0 ? piece.len : std::min(piece.len, recv_pieces_[piece.gate].processed);
      if (available > s.offset) {
        iov[iovcnt++] = {const_cast<std::byte*>(piece.data) + s.offset, available - s.offset};
      }
    }
    if (iovcnt == 0) {
      s.want_write = false;  // waiting for a gate, not for the socket
      return progressed;
    }
    const ssize_t n = net::send_iov_nonblocking(s.fd, iov, iovcnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        s.want_write = true;
        return progressed;
      }
      fail_io(s.peer, errno, "sending to");
    }
    progressed = true;
    std::size_t moved = static_cast<std::size_t>(n);
    if (s.header_done < sizeof(OpHeader)) {
      const std::size_t h = std::min(moved, sizeof(OpHeader) - s.header_done);
      s.header_done += h;
      moved -= h;
    }
    s.offset += moved;
  }
}

bool Exchange::try_recv(RecvStream& s) {
  bool progressed = false;
  for (;;) {
    while (s.cur < s.last && recv_pieces_[s.cur].processed == recv_pieces_[s.cur].len) {
      ++s.cur;
    }
    if (s.header_done == sizeof(OpHeader) && s.cur == s.last) {
      ++streams_done_;
      s.fd = -1;
      return true;
    }
    iovec iov[2];
    int iovcnt = 0;
    if (s.header_done < sizeof(OpHeader)) {
      iov[iovcnt++] = {reinterpret_cast<std::byte*>(&s.got) + s.header_done,
                       sizeof(OpHeader) - s.header_done};
    }
    RecvPiece* piece = s.cur < s.last ? &recv_pieces_[s.cur] : nullptr;
    if (piece != nullptr) {
      if (piece->a == nullptr) {
        iov[iovcnt++] = {piece->dst + piece->processed, piece->len - piece->processed};
      } else {
        const std::size_t left = piece->len - piece->processed - s.pending;
        iov[iovcnt++] = {s.scratch + s.pending, std::min(left, s.scratch_bytes - s.pending)};
      }
    }
    const ssize_t n = net::recv_iov_nonblocking(s.fd, iov, iovcnt);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return progressed;
      fail_io(s.peer, errno, "receiving from");
    }
    if (n == 0) fail_io(s.peer, 0, "receiving from");
    progressed = true;
    std::size_t moved = static_cast<std::size_t>(n);
    if (s.header_done < sizeof(OpHeader)) {
      const std::size_t h = std::min(moved, sizeof(OpHeader) - s.header_done);
      s.header_done += h;
      moved -= h;
      if (s.header_done == sizeof(OpHeader)) check_header(s);
    }
    if (moved == 0) continue;
    if (piece->a == nullptr) {
      piece->processed += moved;
    } else {
      s.pending += moved;
      const std::size_t elements = s.pending / element_size_;
      const std::size_t bytes = elements * element_size_;
      reduce(piece->dst + piece->processed, piece->a + piece->processed, s.scratch, elements,
             dtype_, piece->op, piece->avg_divisor);
      piece->processed += bytes;
      s.pending -= bytes;
      if (s.pending > 0) std::memmove(s.scratch, s.scratch + bytes, s.pending);
    }
  }
}

void Exchange::check_header(const RecvStream& s) const {
  if (s.got == s.expected) return;
  fail_mismatch(s.peer, s.expected, s.got);
}

void Exchange::fail_mismatch(int peer, const OpHeader& expected, const OpHeader& got) const {
  std::string mine = describe(expected);
  std::string theirs = describe(got);
  if (mine == theirs) {
    mine += fmt::format(" [algorithm {}]", to_string(expected.algorithm));
    theirs += fmt::format(" [algorithm {}]", to_string(got.algorithm));
    if (expected.algorithm != got.algorithm) {
      theirs += " (do the ranks use different RingOptions::small_message_bytes?)";
    }
  }
  throw CommError(CommErrorKind::kMismatch,
                  fmt::format("collective mismatch in group '{}': rank {} called {} but rank {} "
                              "called {}; every rank must issue the same collectives in the same "
                              "order with the same count, dtype, op and root",
                              *context_.group, context_.rank, mine, peer, theirs),
                  *context_.group, std::string(context_.op), header_.sequence, peer);
}

// A header from a peer this step does not read from: the same sequence number with another
// fingerprint means that peer issued a different call (ours would never be read). Anything else
// (a later step or operation, a closed connection) is left for whoever reads it.
void Exchange::peek_idle_peer(int peer) {
  idle_peer_done_[static_cast<std::size_t>(peer)] = 1;
  OpHeader got;
  const ssize_t n = net::peek_nonblocking(context_.peer_fds[peer], &got, sizeof got);
  if (n != static_cast<ssize_t>(sizeof got)) return;
  if (got.magic == kHeaderMagic && got.sequence == header_.sequence && !(got == header_)) {
    fail_mismatch(peer, header_, got);
  }
}

void Exchange::fail_io(int peer, int err, const char* what) const {
  const std::string reason = err == 0 ? std::string("connection closed by the peer")
                                      : fmt::format("{} (errno {})", std::strerror(err), err);
  throw PeerClosedError(
      fmt::format("rank {} failed {} rank {} during {} in group '{}': {}", context_.rank, what,
                  peer, context_.op, *context_.group, reason),
      *context_.group, std::string(context_.op), header_.sequence, peer);
}

std::string Exchange::waiting_for(int& peer) const {
  std::string waiting;
  peer = -1;
  for (const auto& s : recv_streams_) {
    if (s.fd < 0) continue;
    std::size_t got = 0, total = 0;
    for (std::size_t i = s.first; i < s.last; ++i) {
      got += recv_pieces_[i].processed;
      total += recv_pieces_[i].len;
    }
    if (peer < 0) peer = s.peer;
    waiting += fmt::format(
        "{}data from rank {} ({} of {} bytes{})", waiting.empty() ? "" : ", ", s.peer, got, total,
        s.header_done < sizeof(OpHeader) ? ", nothing of this operation yet" : "");
  }
  for (const auto& s : send_streams_) {
    if (s.fd < 0 || !s.want_write) continue;
    if (peer < 0) peer = s.peer;
    waiting +=
        fmt::format("{}rank {} to read what it was sent", waiting.empty() ? "" : ", ", s.peer);
  }
  return waiting;
}

// Once per operation: a wait this long is no network delay but a rank that is behind or stuck;
// saying so long before the deadline (and the flight recorder's dump) lets an operator look.
void Exchange::warn_waiting(std::chrono::milliseconds waited, std::chrono::milliseconds left) {
  warned_for_ = header_.sequence + 1;
  int peer = -1;
  const std::string line = fmt::format(
      "ddp: warning: rank {} has waited {} s in {} in group '{}' for {}; it fails in {} s unless "
      "that changes (is a rank behind or stuck? SIGUSR1 dumps the flight recorder, "
      "docs/observability.md)",
      context_.rank, waited.count() / 1000, context_.op, *context_.group, waiting_for(peer),
      left.count() / 1000);
  if (context_.warn != nullptr && *context_.warn) {
    (*context_.warn)(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

void Exchange::fail_timeout(std::chrono::milliseconds timeout) const {
  int peer = -1;
  const std::string waiting = waiting_for(peer);
  throw CommError(
      CommErrorKind::kTimeout,
      fmt::format("rank {} timed out after {} ms in {} in group '{}' waiting for {}; "
                  "the peer is stuck, stopped, or did not issue this collective",
                  context_.rank, timeout.count(), context_.op, *context_.group, waiting),
      *context_.group, std::string(context_.op), header_.sequence, peer);
}

void Exchange::run(net::Deadline deadline, std::chrono::microseconds spin,
                   std::chrono::milliseconds timeout_for_message) {
  bool spinning = false;
  net::Clock::time_point spin_start;
  for (;;) {
    bool progressed = false;
    for (auto& s : send_streams_) {
      if (s.fd >= 0) progressed |= try_send(s);
    }
    for (auto& s : recv_streams_) {
      if (s.fd >= 0) progressed |= try_recv(s);
    }
    if (done()) return;
    if (progressed) {
      spinning = false;
      continue;
    }
    const auto now = net::Clock::now();
    if (now >= deadline) fail_timeout(timeout_for_message);
    if (context_.wait_warning.count() > 0 && warned_for_ != header_.sequence + 1 &&
        now - (deadline - timeout_for_message) >= context_.wait_warning) {
      warn_waiting(std::chrono::duration_cast<std::chrono::milliseconds>(
                       now - (deadline - timeout_for_message)),
                   std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now));
    }
    if (spin.count() > 0) {
      if (!spinning) {
        spinning = true;
        spin_start = now;
        continue;
      }
      if (now - spin_start < spin) continue;
    }
    pollfds_.clear();
    for (const auto& s : send_streams_) {
      if (s.fd >= 0 && s.want_write) pollfds_.push_back(pollfd{s.fd, POLLOUT, 0});
    }
    for (const auto& s : recv_streams_) {
      idle_peer_done_[static_cast<std::size_t>(s.peer)] = 1;
      if (s.fd >= 0) pollfds_.push_back(pollfd{s.fd, POLLIN, 0});
    }
    const std::size_t stream_polls = pollfds_.size();
    polled_idle_peers_.clear();
    if (context_.peer_fds != nullptr) {
      for (int peer = 0; peer < context_.size; ++peer) {
        const int fd = context_.peer_fds[peer];
        if (fd < 0 || idle_peer_done_[static_cast<std::size_t>(peer)]) continue;
        pollfds_.push_back(pollfd{fd, POLLIN, 0});
        polled_idle_peers_.push_back(peer);
      }
    }
    int timeout_ms = net::poll_timeout_ms(deadline);
    if (context_.idle_check != nullptr && (timeout_ms < 0 || timeout_ms > 10)) timeout_ms = 10;
    if (context_.wait_warning.count() > 0 && warned_for_ != header_.sequence + 1) {
      // Wake for the warning too.
      const auto until_warning = std::chrono::ceil<std::chrono::milliseconds>(
          deadline - timeout_for_message + context_.wait_warning - now);
      const int warning_ms = static_cast<int>(std::max<long long>(1, until_warning.count()));
      if (timeout_ms < 0 || timeout_ms > warning_ms) timeout_ms = warning_ms;
    }
    const int rc = net::poll_fds(pollfds_, timeout_ms);
    if (rc < 0 && errno != EINTR) fail_io(-1, errno, "polling");
    if (rc == 0 && context_.idle_check != nullptr) (*context_.idle_check)();
    for (std::size_t i = stream_polls; rc > 0 && i < pollfds_.size(); ++i) {
      if (pollfds_[i].revents != 0) peek_idle_peer(polled_idle_peers_[i - stream_polls]);
    }
    spinning = false;
  }
}

}  // namespace ddp::comm
