#include "rpc/handshake.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "ddp/error.h"

namespace ddp::rpc::transport {
namespace {

constexpr std::uint32_t kHelloMagic = 0x48505244;  // "DRPH"
constexpr std::uint8_t kHandshakeVersion = 1;
constexpr std::string_view kCallerRole = "ddp-rpc caller";
constexpr std::string_view kCalleeRole = "ddp-rpc callee";
constexpr std::size_t kMaxReasonBytes = 1024;

struct Hello {
  std::uint32_t magic = kHelloMagic;
  std::uint8_t version = kHandshakeVersion;
  std::uint8_t has_secret = 0;
  std::uint16_t reserved = 0;
  std::int32_t world_size = 0;
  std::int32_t caller_rank = 0;
  std::int32_t callee_rank = 0;
};
static_assert(sizeof(Hello) == 20);

void append(std::vector<std::uint8_t>& out, const void* data, std::size_t size) {
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  out.insert(out.end(), bytes, bytes + size);
}

void append_string(std::vector<std::uint8_t>& out, const std::string& text) {
  const auto size = static_cast<std::uint32_t>(text.size());
  append(out, &size, sizeof size);
  append(out, text.data(), text.size());
}

std::vector<std::uint8_t> transcript(const HandshakeSelf& self, int caller, int callee,
                                     const std::string& caller_name, const std::string& callee_name,
                                     const auth::Nonce& nc, const auth::Nonce& ns) {
  std::vector<std::uint8_t> t;
  append_string(t, self.session);
  const std::int32_t ints[3] = {self.world_size, caller, callee};
  append(t, ints, sizeof ints);
  append_string(t, caller_name);
  append_string(t, callee_name);
  append(t, nc.data(), nc.size());
  append(t, ns.data(), ns.size());
  return t;
}

auth::Mac mac_or_zero(const std::string& secret, std::string_view role,
                      const std::vector<std::uint8_t>& t) {
  if (secret.empty()) return auth::Mac{};
  return auth::auth_mac(secret, role, t);
}

// status (0 ok, 1 refused) + reason length + reason.
void send_status(net::Socket& socket, const std::string& reason, net::Deadline deadline) {
  std::vector<std::uint8_t> out;
  out.push_back(reason.empty() ? 0 : 1);
  const auto size = static_cast<std::uint16_t>(std::min(reason.size(), kMaxReasonBytes));
  append(out, &size, sizeof size);
  append(out, reason.data(), size);
  socket.send_all(out.data(), out.size(), deadline);
}

// The status the other side sent: "" when it accepted, else its reason.
std::string recv_status(net::Socket& socket, net::Deadline deadline) {
  std::uint8_t status = 0;
  std::uint16_t size = 0;
  socket.recv_all(&status, 1, deadline);
  socket.recv_all(&size, sizeof size, deadline);
  if (status > 1 || size > kMaxReasonBytes) {
    throw ProtocolError(
        fmt::format("rpc: {} answered the handshake with bytes that are not "
                    "ddp's RPC protocol",
                    socket.peer()));
  }
  std::string reason(size, '\0');
  socket.recv_all(reason.data(), size, deadline);
  if (status == 1 && reason.empty()) reason = "(no reason given)";
  return status == 0 ? std::string() : reason;
}

}  // namespace

void handshake_as_caller(net::Socket& socket, const HandshakeSelf& self, int callee_rank,
                         const std::string& callee_name, net::Deadline deadline) {
  Hello hello;
  hello.has_secret = self.secret.empty() ? 0 : 1;
  hello.world_size = self.world_size;
  hello.caller_rank = self.rank;
  hello.callee_rank = callee_rank;
  // Without a secret nothing is proven, and nothing needs randomness (or OpenSSL).
  const auth::Nonce nc = self.secret.empty() ? auth::Nonce{} : auth::random_nonce();
  std::vector<std::uint8_t> out;
  append(out, &hello, sizeof hello);
  append(out, nc.data(), nc.size());
  socket.send_all(out.data(), out.size(), deadline);

  const std::string who =
      fmt::format("worker '{}' (rank {}, {})", callee_name, callee_rank, socket.peer());
  if (std::string reason = recv_status(socket, deadline); !reason.empty()) {
    throw ProtocolError(fmt::format("rpc: {} refused the connection: {}", who, reason));
  }
  auth::Nonce ns;
  auth::Mac callee_mac;
  socket.recv_all(ns.data(), ns.size(), deadline);
  socket.recv_all(callee_mac.data(), callee_mac.size(), deadline);
  const auto t = transcript(self, self.rank, callee_rank, self.name, callee_name, nc, ns);
  if (!self.secret.empty() &&
      !auth::macs_equal(callee_mac, auth::auth_mac(self.secret, kCalleeRole, t))) {
    throw ProtocolError(
        fmt::format("rpc: {} does not know this job's secret (its proof does not "
                    "match): not a worker of this job",
                    who));
  }
  const auth::Mac caller_mac = mac_or_zero(self.secret, kCallerRole, t);
  socket.send_all(caller_mac.data(), caller_mac.size(), deadline);
  if (std::string reason = recv_status(socket, deadline); !reason.empty()) {
    throw ProtocolError(fmt::format("rpc: {} refused the connection: {}", who, reason));
  }
}

int handshake_as_callee(net::Socket& socket, const HandshakeSelf& self,
                        const std::function<std::string(int)>& name_of_rank,
                        net::Deadline deadline) {
  Hello hello;
  auth::Nonce nc;
  socket.recv_all(&hello, sizeof hello, deadline);
  if (hello.magic != kHelloMagic) {
    throw ProtocolError(
        fmt::format("rpc: a connection from {} did not open with ddp's RPC "
                    "handshake; closed",
                    socket.peer()));
  }
  socket.recv_all(nc.data(), nc.size(), deadline);
  auto refuse = [&](const std::string& why) {
    try {
      send_status(socket, why, deadline);
    } catch (const Error&) {
      // The caller is gone or slow: the refusal below is what counts.
    }
    return ProtocolError(fmt::format("rpc: refused a connection from {}: {}", socket.peer(), why));
  };
  if (hello.version != kHandshakeVersion) {
    throw refuse(
        fmt::format("handshake version {}, this worker speaks {}: run one ddp build on "
                    "every worker",
                    hello.version, kHandshakeVersion));
  }
  if (hello.world_size != self.world_size) {
    throw refuse(fmt::format("the caller's RPC world has {} workers, this one {}", hello.world_size,
                             self.world_size));
  }
  if (hello.callee_rank != self.rank) {
    throw refuse(fmt::format("the caller asked for rank {}, this is rank {} ('{}')",
                             hello.callee_rank, self.rank, self.name));
  }
  if (hello.caller_rank < 0 || hello.caller_rank >= self.world_size) {
    throw refuse(fmt::format("the caller's rank {} is outside the world of {}", hello.caller_rank,
                             self.world_size));
  }
  if ((hello.has_secret != 0) != !self.secret.empty()) {
    throw refuse(self.secret.empty()
                     ? "the caller has a job secret and this worker none: give every worker the "
                       "same DDP_SECRET or DDP_SECRET_FILE"
                     : "this worker has a job secret and the caller none: give every worker the "
                       "same DDP_SECRET or DDP_SECRET_FILE");
  }
  const auth::Nonce ns = self.secret.empty() ? auth::Nonce{} : auth::random_nonce();
  const std::string caller_name = name_of_rank(hello.caller_rank);
  const auto t = transcript(self, hello.caller_rank, self.rank, caller_name, self.name, nc, ns);
  const auth::Mac callee_mac = mac_or_zero(self.secret, kCalleeRole, t);
  send_status(socket, "", deadline);
  socket.send_all(ns.data(), ns.size(), deadline);
  socket.send_all(callee_mac.data(), callee_mac.size(), deadline);
  auth::Mac caller_mac;
  socket.recv_all(caller_mac.data(), caller_mac.size(), deadline);
  if (!self.secret.empty() &&
      !auth::macs_equal(caller_mac, auth::auth_mac(self.secret, kCallerRole, t))) {
    throw refuse("the caller's proof does not match this job's secret");
  }
  send_status(socket, "", deadline);
  return hello.caller_rank;
}

}  // namespace ddp::rpc::transport
