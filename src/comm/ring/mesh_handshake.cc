// The mesh handshake's connector side (connect_handshake, send_knock), the MAC both sides send,
// and the hello's bytes and checks that the acceptor side (mesh_acceptor.cc) shares.
#include "comm/ring/mesh_handshake.h"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "comm/ring/mesh_handshake_internal.h"
#include "comm/wire.h"
#include "ddp/comm/comm_error.h"
#include "ddp/error.h"

namespace ddp::comm {
namespace {

constexpr std::string_view kAcceptorRole = "ddp-ring acceptor";
constexpr std::string_view kConnectorRole = "ddp-ring connector";

std::uint32_t expected_magic(const HandshakeParams& params) {
  return params.secret.empty() ? kHandshakeMagic : kAuthHandshakeMagic;
}

Hello make_hello(const HandshakeParams& params, int to) {
  Hello hello;
  hello.magic = expected_magic(params);
  hello.version = kProtocolVersion;
  hello.size = params.size;
  hello.from_rank = params.rank;
  hello.to_rank = to;
  hello.name_length = static_cast<std::uint32_t>(params.group.size());
  return hello;
}

void append_u32(std::vector<std::uint8_t>& out, std::uint32_t value) {
  std::uint8_t bytes[4];
  for (int i = 0; i < 4; ++i)
    bytes[i] = static_cast<std::uint8_t>(value >> (8 * i));
  append(out, bytes, 4);
}

}  // namespace

std::string check_magic_and_version(const HandshakeParams& params, const Hello& hello) {
  const bool auth = !params.secret.empty();
  if (hello.magic == kHandshakeMagic && auth) {
    return "the peer has no secret but this rank has one; give every rank the same DDP_SECRET or "
           "DDP_SECRET_FILE";
  }
  if (hello.magic == kAuthHandshakeMagic && !auth) {
    return "the peer authenticates with a secret but this rank has none; give every rank the same "
           "DDP_SECRET or DDP_SECRET_FILE";
  }
  if (hello.magic != expected_magic(params)) {
    return fmt::format(
        "the peer does not speak the ddp ring protocol (magic {:#x}, expected {:#x}); is another "
        "program using this port?",
        hello.magic, expected_magic(params));
  }
  if (hello.version != kProtocolVersion) {
    return fmt::format(
        "protocol version {} but this rank speaks version {}; run the same ddp build on every "
        "rank",
        hello.version, kProtocolVersion);
  }
  if (hello.name_length > kMaxGroupNameBytes) {
    return fmt::format("group name of {} bytes (at most {})", hello.name_length,
                       kMaxGroupNameBytes);
  }
  return {};
}

std::string check_group(const HandshakeParams& params, const Hello& hello,
                        const std::string& name) {
  if (name != params.group) {
    return fmt::format("the peer belongs to group '{}', this rank to group '{}'", name,
                       params.group);
  }
  if (hello.size != params.size) {
    return fmt::format("the peer's group has {} ranks, this rank's has {}", hello.size,
                       params.size);
  }
  if (hello.to_rank != params.rank) {
    return fmt::format(
        "rank {} wanted to reach rank {} but reached rank {} (stale address in the store?)",
        hello.from_rank, hello.to_rank, params.rank);
  }
  return {};
}

void append(std::vector<std::uint8_t>& out, const void* data, std::size_t len) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  out.insert(out.end(), p, p + len);
}

std::vector<std::uint8_t> hello_bytes(const HandshakeParams& params, int to) {
  const Hello hello = make_hello(params, to);
  std::vector<std::uint8_t> out;
  append(out, &hello, sizeof hello);
  append(out, params.group.data(), params.group.size());
  return out;
}

std::vector<std::uint8_t> handshake_mac(const HandshakeParams& params, bool acceptor_side,
                                        int connector, int acceptor,
                                        const std::uint8_t* connector_nonce,
                                        const std::uint8_t* acceptor_nonce) {
  std::vector<std::uint8_t> transcript;
  append_u32(transcript, static_cast<std::uint32_t>(params.session.size()));
  append(transcript, params.session.data(), params.session.size());
  append_u32(transcript, static_cast<std::uint32_t>(params.group.size()));
  append(transcript, params.group.data(), params.group.size());
  append_u32(transcript, static_cast<std::uint32_t>(params.size));
  append_u32(transcript, static_cast<std::uint32_t>(connector));
  append_u32(transcript, static_cast<std::uint32_t>(acceptor));
  append(transcript, connector_nonce, kNonceBytes);
  append(transcript, acceptor_nonce, kNonceBytes);
  const auto mac =
      auth::auth_mac(params.secret, acceptor_side ? kAcceptorRole : kConnectorRole, transcript);
  return {mac.begin(), mac.end()};
}

void send_knock(net::Socket& socket, const HandshakeParams& params, int peer,
                net::Deadline deadline) {
  std::vector<std::uint8_t> hello = hello_bytes(params, peer);
  if (!params.secret.empty()) {  // the acceptor reads a connector's nonce with the name
    const auto nonce = auth::random_nonce();
    append(hello, nonce.data(), nonce.size());
  }
  socket.send_all(hello.data(), hello.size(), deadline);
}

void connect_handshake(net::Socket& socket, const HandshakeParams& params, int peer,
                       net::Deadline deadline) {
  const bool auth = !params.secret.empty();
  auto fail = [&](const std::string& what) {
    return CommError(CommErrorKind::kSetup,
                     fmt::format("rank {} of group '{}': handshake with rank {} at {} failed: {}",
                                 params.rank, params.group, peer, socket.peer(), what),
                     params.group, "connect", 0, peer);
  };
  try {
    std::vector<std::uint8_t> hello = hello_bytes(params, peer);
    auth::Nonce connector_nonce{};
    if (auth) {
      connector_nonce = auth::random_nonce();
      append(hello, connector_nonce.data(), kNonceBytes);
    }
    socket.send_all(hello.data(), hello.size(), deadline);

    Hello got;
    socket.recv_all(&got, sizeof got, deadline);
    if (auto problem = check_magic_and_version(params, got); !problem.empty()) throw fail(problem);
    std::string name(got.name_length, '\0');
    socket.recv_all(name.data(), name.size(), deadline);
    if (auto problem = check_group(params, got, name); !problem.empty()) throw fail(problem);
    if (got.from_rank != peer) {
      throw fail(fmt::format("expected rank {} but rank {} answered", peer, got.from_rank));
    }
    if (!auth) return;

    std::uint8_t answer[kNonceBytes + kMacBytes];
    socket.recv_all(answer, sizeof answer, deadline);
    const auto expected = handshake_mac(params, /*acceptor_side=*/true, params.rank, peer,
                                        connector_nonce.data(), answer);
    if (!auth::macs_equal(std::span<const std::uint8_t>(answer + kNonceBytes, kMacBytes),
                          expected)) {
      throw fail(fmt::format(
          "rank {} could not prove it knows the job's secret: it has another DDP_SECRET, or the "
          "address in the store is not rank {} of this job",
          peer, peer));
    }
    const auto proof = handshake_mac(params, /*acceptor_side=*/false, params.rank, peer,
                                     connector_nonce.data(), answer);
    socket.send_all(proof.data(), proof.size(), deadline);
  } catch (const CommError&) {
    throw;
  } catch (const TimeoutError& e) {
    throw fail(e.what());
  } catch (const Error& e) {
    throw fail(
        fmt::format("{}; the peer closed the connection during the handshake, so it "
                    "refused this rank (its log says why: another secret, group, world "
                    "size or ddp version)",
                    e.what()));
  }
}

}  // namespace ddp::comm
