#include "comm/ring/mesh.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdio>
#include <exception>
#include <thread>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "net/fd_io.h"

namespace ddp::comm {

using std::chrono::milliseconds;

namespace {

// With a secret: the group instance's id bound into every handshake MAC, equal on every rank (the
// first rank to get here draws it into `key`, the others read it).
std::string draw_group_session(Store& store, const std::string& key) {
  const auto nonce = auth::random_nonce();
  std::string mine;
  for (const auto byte : nonce)
    mine += fmt::format("{:02x}", byte);
  return store.compare_set(key, "", mine);
}

}  // namespace

std::vector<int> pattern_peers(int rank, int size) {
  std::vector<int> peers;
  if (size <= 1) return peers;
  // Rings, chains and binomial trees of any root: rank +- 2^k.
  for (int step = 1; step < size; step *= 2) {
    peers.push_back((rank + step) % size);
    peers.push_back((rank - step % size + size) % size);
  }
  // Recursive doubling (tcp_algorithms.cc): the extra ranks fold onto their neighbour, then
  // virtual rank v exchanges with v ^ 2^j.
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(size)));
  const int rem = size - p;
  int v = rank - rem;
  if (rank < 2 * rem) {
    peers.push_back(rank % 2 == 0 ? rank + 1 : rank - 1);
    v = rank % 2 == 0 ? -1 : rank / 2;
  }
  if (v >= 0) {
    for (int bit = 1; bit < p; bit *= 2) {
      const int partner_v = v ^ bit;
      peers.push_back(partner_v < rem ? 2 * partner_v + 1 : partner_v + rem);
    }
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::erase(peers, rank);
  return peers;
}

PeerMesh::~PeerMesh() = default;

void PeerMesh::open(Store& store, const MeshParams& p, const std::vector<int>& eager,
                    net::Deadline deadline) {
  store_ = &store;
  params_ = p;
  sockets_ = std::vector<net::Socket>(static_cast<std::size_t>(p.size));
  taken_.assign(static_cast<std::size_t>(p.size), 0);
  listener_ = net::listen_tcp("", 0);
  listener_.set_buffer_sizes(p.socket_buffer_bytes);
  const std::string address = fmt::format("{}:{}", p.advertise_host, listener_.local_port());
  store.set(fmt::format("{}addr/{}", p.prefix, p.rank), address);

  handshake_ = HandshakeParams{.group = p.group,
                               .size = p.size,
                               .rank = p.rank,
                               .secret = p.secret,
                               .session = {},
                               .log = p.log,
                               .on_knock = p.on_knock};
  if (!handshake_.log) {
    handshake_.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  if (!p.secret.empty()) handshake_.session = draw_group_session(store, p.prefix + "auth/session");
  acceptor_ = std::make_unique<MeshAcceptor>(handshake_);

  // Lower ranks accept, higher ranks connect. The peers above are accepted on a thread of their
  // own while this one connects to those below: a rank that accepted only once its own
  // connections were made would hold up every rank above it, a chain as long as the world (each
  // link a handshake and a wake-up of an oversubscribed process). The two threads write distinct
  // slots of sockets_ (the acceptor refuses ranks at or below this one).
  std::vector<int> below, above;
  for (const int peer : eager) {
    if (peer < p.rank) below.push_back(peer);
    if (peer > p.rank) above.push_back(peer);
  }
  struct Stopped {};
  std::atomic<bool> stop{false};
  const std::function<void()> stop_check = [&stop] {
    if (stop.load()) throw Stopped{};
  };
  std::exception_ptr accept_error;
  std::thread accepting;
  if (!above.empty()) {
    accepting = std::thread([&] {
      try {
        // Garbage, bad hellos and failed authentications are refused there without ending the
        // wait.
        acceptor_->accept_until(listener_, sockets_, above,
                                {.deadline = deadline, .timeout = p.timeout, .idle = &stop_check});
      } catch (const Stopped&) {
        // This thread failed to connect: its error is the one to report.
      } catch (...) {
        accept_error = std::current_exception();
      }
    });
  }
  try {
    for (const int peer : below)
      connect_to_lower(peer, deadline);
  } catch (...) {
    stop = true;
    if (accepting.joinable()) accepting.join();
    throw;
  }
  if (accepting.joinable()) accepting.join();
  if (accept_error) std::rethrow_exception(accept_error);
  stop_listening_once_complete();
}

void PeerMesh::connect_to_lower(int peer, net::Deadline deadline) {
  net::Socket socket = dial(peer, deadline);
  socket.set_buffer_sizes(params_.socket_buffer_bytes);
  socket.set_no_delay(true);
  connect_handshake(socket, handshake_, peer, deadline);
  sockets_[static_cast<std::size_t>(peer)] = std::move(socket);
}

net::Socket PeerMesh::knock(int peer, net::Deadline deadline) {
  net::Socket socket;
  try {
    socket = dial(peer, deadline);
    send_knock(socket, handshake_, peer, deadline);
    socket.set_nonblocking(true);
  } catch (const CommError& e) {
    throw CommError(CommErrorKind::kPeerGone,
                    fmt::format("{} (asking it to open the point-to-point connection)", e.what()),
                    params_.group, "connect", 0, peer);
  } catch (const Error& e) {
    throw CommError(CommErrorKind::kPeerGone,
                    fmt::format("rank {} of group '{}' cannot ask rank {} to connect: {}",
                                params_.rank, params_.group, peer, e.what()),
                    params_.group, "connect", 0, peer);
  }
  return socket;
}

net::Socket PeerMesh::dial(int peer, net::Deadline deadline) {
  const auto& p = params_;
  const std::string key = fmt::format("{}addr/{}", p.prefix, peer);
  const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
  const std::string peer_address = store_->get_string(key, std::max(left, milliseconds(1)));
  const auto colon = peer_address.rfind(':');
  if (colon == std::string::npos) {
    throw CommError(CommErrorKind::kSetup,
                    fmt::format("rank {} of group '{}': store key '{}' holds '{}', not "
                                "host:port",
                                p.rank, p.group, key, peer_address),
                    p.group, "connect", 0, peer);
  }
  const std::string host = peer_address.substr(0, colon);
  const auto port = static_cast<std::uint16_t>(std::stoi(peer_address.substr(colon + 1)));
  if (p.refused_for.count() > 0) deadline = std::min(deadline, net::deadline_after(p.refused_for));
  net::Socket socket;
  try {
    socket = net::connect_tcp(host, port, deadline);
  } catch (const Error& e) {
    throw CommError(CommErrorKind::kSetup,
                    fmt::format("rank {} of group '{}' cannot connect to rank {} at {}: {}", p.rank,
                                p.group, peer, peer_address, e.what()),
                    p.group, "connect", 0, peer);
  }
  return socket;
}

void PeerMesh::connect_peer(int peer, const AcceptWait& wait) {
  const auto slot = static_cast<std::size_t>(peer);
  if (sockets_[slot].valid() || taken_[slot] != 0) return;
  if (peer < params_.rank) {
    try {
      connect_to_lower(peer, wait.deadline);
    } catch (const CommError& e) {
      // Name the operation that needed the connection (a refused connection is a peer that
      // died, or never had its listener).
      throw CommError(e.kind() == CommErrorKind::kSetup ? CommErrorKind::kPeerGone : e.kind(),
                      fmt::format("{} (connecting on first use, for {})", e.what(), wait.op),
                      params_.group, wait.op, wait.sequence, peer);
    } catch (const TimeoutError& e) {
      throw CommError(
          CommErrorKind::kTimeout,
          fmt::format("rank {} timed out after {} ms in {} in group '{}' connecting "
                      "to rank {} on first use: {}",
                      params_.rank, wait.timeout.count(), wait.op, params_.group, peer, e.what()),
          params_.group, wait.op, wait.sequence, peer);
    }
    return;
  }
  acceptor_->accept_until(listener_, sockets_, {peer}, wait);
  stop_listening_once_complete();
}

void PeerMesh::accept_from_above(AcceptWait wait) {
  std::vector<int> wanted;
  for (int r = params_.rank + 1; r < params_.size; ++r) {
    const auto slot = static_cast<std::size_t>(r);
    if (!sockets_[slot].valid() && taken_[slot] == 0) wanted.push_back(r);
  }
  wait.taken = &taken_;
  wait.until_woken = true;
  try {
    acceptor_->accept_until(listener_, sockets_, wanted, wait);
  } catch (const CommError& e) {
    if (e.kind() != CommErrorKind::kTimeout) throw;  // the deadline only ends this wait
  }
}

net::Socket PeerMesh::take(int peer) {
  const auto slot = static_cast<std::size_t>(peer);
  taken_[slot] = 1;
  return std::move(sockets_[slot]);
}

void PeerMesh::shutdown_listener() noexcept {
  // Only the fd is touched: the socket object is not replaced while the mesh lives.
  if (listener_.valid()) net::shutdown_socket(listener_.fd(), net::ShutdownHow::kBoth);
}

void PeerMesh::stop_listening_once_complete() noexcept {
  // A mesh whose ranks below may knock (point to point) keeps listening for them.
  if (params_.on_knock) return;
  for (int r = params_.rank + 1; r < params_.size; ++r) {
    const auto slot = static_cast<std::size_t>(r);
    if (!sockets_[slot].valid() && taken_[slot] == 0) return;
  }
  // Every rank that connects to this one has: nothing legitimate reaches the port any more, and a
  // stranger's connection would only sit unanswered in its queue. Shut, not closed: abort() may
  // shut it again from another thread, and the fd must stay this listener's meanwhile.
  shutdown_listener();
}

int PeerMesh::connected() const {
  return static_cast<int>(std::count_if(sockets_.begin(), sockets_.end(),
                                        [](const net::Socket& s) { return s.valid(); }));
}

}  // namespace ddp::comm
