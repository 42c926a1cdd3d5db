// The acceptor side of the mesh handshake: MeshAcceptor, which runs every pending handshake of a
// listener in one poll loop and refuses the connections that fail it, and accept_peers.
#include "comm/ring/mesh_handshake.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "comm/ring/mesh_handshake_internal.h"
#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "net/descriptors.h"
#include "net/fd_io.h"

namespace ddp::comm {
namespace {

// Handshakes in progress at once; beyond this the oldest is dropped (a flood of idle connections
// must not exhaust the descriptors, and a real peer finishes in microseconds).
constexpr std::size_t kMaxPendingHandshakes = 256;
constexpr int kRefusalsLoggedInFull = 20;
// How long accepting may keep failing for want of descriptors, with no handshake left to drop for
// room, before the wait fails naming it: long enough for a file the program closes soon, short
// beside any timeout (a process at its limit rarely gets below it on its own).
constexpr auto kOutOfDescriptorsGrace = std::chrono::seconds(1);

// One connection whose handshake is in progress on the acceptor.
struct Pending {
  enum class Stage { kHello, kName, kProof };
  net::Socket socket;
  Stage stage = Stage::kHello;
  std::vector<std::uint8_t> buf;  // bytes of the current stage received so far
  std::size_t need = sizeof(Hello);
  Hello hello;
  auth::Nonce connector_nonce{};
  auth::Nonce acceptor_nonce{};
};

// Outcome of feeding a pending handshake what its socket has.
struct Step {
  enum class Kind { kWaiting, kRefused, kAccepted, kKnocked } kind = Kind::kWaiting;
  std::string reason;  // kRefused
  int rank = -1;       // kAccepted, kKnocked
};

Step refused(std::string reason) {
  return {Step::Kind::kRefused, std::move(reason), -1};
}

}  // namespace

struct MeshAcceptor::Impl {
  explicit Impl(HandshakeParams params) : params_(std::move(params)) {}

  void accept_until(net::Socket& listener, std::vector<net::Socket>& peers,
                    const std::vector<int>& wanted, const AcceptWait& wait) {
    auto missing = [&] {
      return static_cast<int>(std::count_if(wanted.begin(), wanted.end(), [&](int r) {
        return !peers[static_cast<std::size_t>(r)].valid();
      }));
    };
    peers_ = &peers;
    taken_ = wait.taken;
    short_of_descriptors_since_.reset();  // each wait has its own grace
    std::vector<pollfd> fds;
    constexpr auto kIdleEvery = std::chrono::milliseconds(10);
    auto last_idle = net::Clock::now();
    bool accepted_any = false;
    while ((missing() > 0 || wait.until_woken) && !(wait.return_on_first && accepted_any)) {
      const auto now = net::Clock::now();
      if (now >= wait.deadline) fail_timeout(wanted, wait);
      fds.clear();
      fds.push_back(pollfd{listener.fd(), POLLIN, 0});
      for (const auto& p : pending_)
        fds.push_back(pollfd{p.socket.fd(), POLLIN, 0});
      if (wait.wake_fd >= 0) fds.push_back(pollfd{wait.wake_fd, POLLIN, 0});
      int timeout_ms = net::poll_timeout_ms(wait.deadline);
      if (wait.idle != nullptr && (timeout_ms < 0 || timeout_ms > 10)) timeout_ms = 10;
      const int rc = net::poll_fds(fds, timeout_ms);
      // At least every 10 ms, also while connections keep the poll busy (a shut listener is
      // readable for ever).
      if (wait.idle != nullptr && (rc == 0 || net::Clock::now() - last_idle >= kIdleEvery)) {
        last_idle = net::Clock::now();
        (*wait.idle)();
      }
      if (rc < 0) {
        if (errno == EINTR) continue;
        throw CommError(CommErrorKind::kSetup,
                        fmt::format("rank {} of group '{}': poll failed while accepting peers: {}",
                                    params_.rank, params_.group, std::strerror(errno)),
                        params_.group, "connect", 0, -1);
      }
      // Advance the handshakes first (indices of fds follow pending_), then accept new ones.
      for (std::size_t i = pending_.size(); i-- > 0;) {
        if (fds[i + 1].revents == 0) continue;
        const Step step = advance(pending_[i]);
        if (step.kind == Step::Kind::kWaiting) continue;
        if (step.kind == Step::Kind::kRefused) {
          refuse(pending_[i], step.reason);
        } else if (step.kind == Step::Kind::kKnocked) {
          pending_[i].socket.close();
          params_.on_knock(step.rank);
        } else {
          net::Socket& socket = pending_[i].socket;
          socket.set_nonblocking(false);
          socket.set_no_delay(true);
          (*peers_)[static_cast<std::size_t>(step.rank)] = std::move(socket);
          accepted_any = true;
        }
        pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (fds[0].revents != 0) accept_new(listener, wanted, wait);
      if (wait.wake_fd >= 0 && fds.back().revents != 0) break;
    }
    if (unlogged_ > 0) {
      params_.log(fmt::format(
          "ddp: rank {} of group '{}' refused a connection {} ({} more refused since the last such "
          "line; {} in all so far)",
          params_.rank, params_.group, last_refusal_, unlogged_ - 1, refused_));
      unlogged_ = 0;
    }
  }

  void accept_new(net::Socket& listener, const std::vector<int>& wanted, const AcceptWait& wait) {
    net::Socket socket;
    try {
      socket = net::accept_tcp(listener, net::Clock::now());
    } catch (const TimeoutError&) {
      return;  // the connection went away before we took it
    } catch (const net::OutOfDescriptorsError& e) {
      out_of_descriptors(e.what(), wanted, wait);
      return;
    } catch (const Error& e) {
      // Out of memory or the like: make room rather than spin on a readable listener.
      if (!pending_.empty()) {
        refuse(pending_.front(), fmt::format("dropped to make room ({})", e.what()));
        pending_.erase(pending_.begin());
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      return;
    }
    short_of_descriptors_since_.reset();
    socket.set_nonblocking(true);
    if (pending_.size() >= kMaxPendingHandshakes) {
      refuse(pending_.front(),
             fmt::format("more than {} handshakes in progress; dropped the oldest",
                         kMaxPendingHandshakes));
      pending_.erase(pending_.begin());
    }
    Pending p;
    p.socket = std::move(socket);
    pending_.push_back(std::move(p));
  }

  // A connection waits but this process has no descriptor for it. A flood of idle connections can
  // use them up: dropping the oldest handshake makes room. Otherwise the process is at its limit,
  // and retrying until the deadline would only end in a timeout that blames the peers: the wait
  // fails once this has lasted kOutOfDescriptorsGrace, naming the limit. Either way it is logged
  // (once) and remembered for the timeout's message.
  void out_of_descriptors(const std::string& what, const std::vector<int>& wanted,
                          const AcceptWait& wait) {
    const auto now = net::Clock::now();
    if (descriptor_error_.empty()) {
      params_.log(fmt::format("ddp: rank {} of group '{}' cannot accept a connection: {}",
                              params_.rank, params_.group, what));
    }
    descriptor_error_ = what;
    if (!short_of_descriptors_since_) short_of_descriptors_since_ = now;
    if (!pending_.empty()) {
      refuse(pending_.front(), fmt::format("dropped to make room ({})", what));
      pending_.erase(pending_.begin());
      return;
    }
    if (now - *short_of_descriptors_since_ >= kOutOfDescriptorsGrace) {
      const std::string missing = missing_ranks(wanted);
      throw CommError(
          CommErrorKind::kSetup,
          fmt::format("rank {} of group '{}' cannot accept {}: {}", params_.rank, params_.group,
                      missing.empty() ? std::string("connections")
                                      : fmt::format("the connections of ranks {}", missing),
                      what),
          params_.group, wait.op.empty() ? std::string("connect") : wait.op, wait.sequence, -1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }

  // "1, 3": the ranks of `wanted` not connected yet.
  std::string missing_ranks(const std::vector<int>& wanted) const {
    std::string missing;
    for (const int peer : wanted) {
      if (!(*peers_)[static_cast<std::size_t>(peer)].valid()) {
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", peer);
      }
    }
    return missing;
  }

  // Reads what the socket has for the current stage and moves on when the stage is complete.
  Step advance(Pending& p) {
    for (;;) {
      if (p.buf.size() < p.need) {
        const std::size_t have = p.buf.size();
        p.buf.resize(p.need);
        std::ptrdiff_t n = 0;
        try {
          n = p.socket.recv_some(p.buf.data() + have, p.need - have);
        } catch (const Error& e) {
          return refused(fmt::format("connection failed during the handshake: {}", e.what()));
        }
        if (n < 0) {
          p.buf.resize(have);
          return refused(
              fmt::format("connection closed during the handshake ({} of {} bytes of "
                          "the {})",
                          have, p.need, stage_name(p.stage)));
        }
        p.buf.resize(have + static_cast<std::size_t>(n));
        if (p.buf.size() < p.need) return {};
      }
      // On to the next stage: its bytes may already be waiting.
      Step step = complete_stage(p);
      if (step.kind != Step::Kind::kWaiting) return step;
    }
  }

  static const char* stage_name(Pending::Stage stage) {
    switch (stage) {
      case Pending::Stage::kHello:
        return "hello";
      case Pending::Stage::kName:
        return "group name";
      case Pending::Stage::kProof:
        return "authentication";
    }
    return "?";
  }

  Step complete_stage(Pending& p) {
    const bool auth = !params_.secret.empty();
    switch (p.stage) {
      case Pending::Stage::kHello: {
        std::memcpy(&p.hello, p.buf.data(), sizeof p.hello);
        if (auto problem = check_magic_and_version(params_, p.hello); !problem.empty()) {
          return refused(problem);
        }
        p.stage = Pending::Stage::kName;
        p.need = p.hello.name_length + (auth ? kNonceBytes : 0);
        p.buf.clear();
        return {};
      }
      case Pending::Stage::kName: {
        const std::string name(p.buf.begin(), p.buf.begin() + p.hello.name_length);
        if (auto problem = check_group(params_, p.hello, name); !problem.empty()) {
          return refused(problem);
        }
        const int from = p.hello.from_rank;
        if (params_.on_knock && from >= 0 && from < params_.rank) {
          return {Step::Kind::kKnocked, {}, from};
        }
        if (from <= params_.rank || from >= params_.size) {
          return refused(fmt::format("rank {} cannot connect to rank {} (only ranks {} to {} do)",
                                     from, params_.rank, params_.rank + 1, params_.size - 1));
        }
        if (connected(from)) return refused(fmt::format("duplicate connection from rank {}", from));
        std::vector<std::uint8_t> reply = hello_bytes(params_, from);
        if (auth) {
          std::memcpy(p.connector_nonce.data(), p.buf.data() + p.hello.name_length, kNonceBytes);
          p.acceptor_nonce = auth::random_nonce();
          const auto mac = handshake_mac(params_, /*acceptor_side=*/true, from, params_.rank,
                                         p.connector_nonce.data(), p.acceptor_nonce.data());
          append(reply, p.acceptor_nonce.data(), kNonceBytes);
          append(reply, mac.data(), mac.size());
        }
        // A fresh socket's send buffer takes these few bytes at once; a peer that lets it fill
        // up is not a rank of this group.
        std::ptrdiff_t sent = 0;
        try {
          sent = p.socket.send_some(reply.data(), reply.size());
        } catch (const Error& e) {
          return refused(fmt::format("cannot answer its hello: {}", e.what()));
        }
        if (static_cast<std::size_t>(sent) != reply.size()) {
          return refused("it does not read the answer to its hello");
        }
        if (!auth) return {Step::Kind::kAccepted, {}, from};
        p.stage = Pending::Stage::kProof;
        p.need = kMacBytes;
        p.buf.clear();
        return {};
      }
      case Pending::Stage::kProof: {
        const int from = p.hello.from_rank;
        const auto expected = handshake_mac(params_, /*acceptor_side=*/false, from, params_.rank,
                                            p.connector_nonce.data(), p.acceptor_nonce.data());
        if (!auth::macs_equal(p.buf, expected)) {
          return refused(fmt::format(
              "authentication failed: it claimed to be rank {} but does not know the job's "
              "secret (a stranger, a replayed handshake, or a rank with another DDP_SECRET)",
              from));
        }
        if (connected(from)) return refused(fmt::format("duplicate connection from rank {}", from));
        return {Step::Kind::kAccepted, {}, from};
      }
    }
    return refused("internal error: unknown handshake stage");
  }

  bool connected(int rank) const {
    const auto r = static_cast<std::size_t>(rank);
    return (*peers_)[r].valid() || (taken_ != nullptr && (*taken_)[r] != 0);
  }

  void refuse(Pending& p, const std::string& reason) {
    ++refused_;
    last_refusal_ = fmt::format("from {}: {}", p.socket.peer(), reason);
    // Whoever can reach the port must not be able to flood the job's log: the first refusals in
    // full, then at most one line a second, counting the ones left out.
    const auto now = std::chrono::steady_clock::now();
    if (refused_ <= kRefusalsLoggedInFull || now - last_log_ >= std::chrono::seconds(1)) {
      const std::string left_out =
          unlogged_ > 0 ? fmt::format(" ({} more refused since the last such line)", unlogged_)
                        : std::string();
      params_.log(fmt::format("ddp: rank {} of group '{}' refused a connection {}{}", params_.rank,
                              params_.group, last_refusal_, left_out));
      last_log_ = now;
      unlogged_ = 0;
    } else {
      ++unlogged_;
    }
    p.socket.close();
  }

  [[noreturn]] void fail_timeout(const std::vector<int>& wanted, const AcceptWait& wait) {
    const std::string missing = missing_ranks(wanted);
    int first = -1;
    for (const int peer : wanted) {
      if (!(*peers_)[static_cast<std::size_t>(peer)].valid()) {
        first = peer;
        break;
      }
    }
    std::string refusals;
    if (refused_ > 0) {
      refusals = fmt::format(" ({} connection(s) refused, the last {})", refused_, last_refusal_);
    }
    if (!descriptor_error_.empty()) {
      // The peers may well have connected: this rank could not take their connections.
      throw CommError(
          CommErrorKind::kTimeout,
          fmt::format("rank {} of group '{}' timed out after {} ms waiting for ranks {} to "
                      "connect{}; it ran out of descriptors accepting them: {}{}",
                      params_.rank, params_.group, wait.timeout.count(), missing,
                      wait.op.empty() ? std::string() : fmt::format(" (for {})", wait.op),
                      descriptor_error_, refusals),
          params_.group, wait.op.empty() ? std::string("connect") : wait.op, wait.sequence, -1);
    }
    if (wait.op.empty()) {
      throw CommError(
          CommErrorKind::kTimeout,
          fmt::format("rank {} of group '{}' timed out after {} ms waiting for ranks {} "
                      "to connect; did every rank create the group?{}",
                      params_.rank, params_.group, wait.timeout.count(), missing, refusals),
          params_.group, "connect", 0, wanted.size() == 1 ? first : -1);
    }
    // A connection made on first use: the peer reached this operation's matched call first and
    // would have connected by now, so it died before connecting, is stuck, or issued another
    // call.
    throw CommError(
        CommErrorKind::kTimeout,
        fmt::format("rank {} timed out after {} ms in {} in group '{}' waiting for rank(s) {} to "
                    "open their first connection to it; the peer died before connecting, is "
                    "stuck, or did not issue this collective{}",
                    params_.rank, wait.timeout.count(), wait.op, params_.group, missing, refusals),
        params_.group, wait.op, wait.sequence, first);
  }

  const HandshakeParams params_;
  std::vector<net::Socket>* peers_ = nullptr;  // of the accept_until() in progress
  const std::vector<char>* taken_ = nullptr;   // of the accept_until() in progress
  std::vector<Pending> pending_;               // kept across calls: a handshake may span two waits
  int refused_ = 0;
  std::string last_refusal_;
  // The last accept that failed for want of descriptors ("" = none), and since when accepting has
  // failed so without a success in between.
  std::string descriptor_error_;
  std::optional<net::Clock::time_point> short_of_descriptors_since_;
  std::chrono::steady_clock::time_point last_log_{};
  int unlogged_ = 0;
};

MeshAcceptor::MeshAcceptor(HandshakeParams params)
    : impl_(std::make_unique<Impl>(std::move(params))) {}
MeshAcceptor::~MeshAcceptor() = default;

void MeshAcceptor::accept_until(net::Socket& listener, std::vector<net::Socket>& peers,
                                const std::vector<int>& wanted, const AcceptWait& wait) {
  impl_->accept_until(listener, peers, wanted, wait);
}

std::vector<net::Socket> accept_peers(net::Socket& listener, const HandshakeParams& params,
                                      net::Deadline deadline, std::chrono::milliseconds timeout) {
  std::vector<net::Socket> peers(static_cast<std::size_t>(params.size));
  std::vector<int> wanted;
  for (int r = params.rank + 1; r < params.size; ++r)
    wanted.push_back(r);
  MeshAcceptor(params).accept_until(listener, peers, wanted,
                                    {.deadline = deadline, .timeout = timeout});
  return peers;
}

}  // namespace ddp::comm
