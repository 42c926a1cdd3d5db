#include "comm/ring/mesh.h"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "auth/hmac.h"
#include "comm/ring/mesh_handshake.h"
#include "ddp/comm_error.h"
#include "ddp/error.h"

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

std::vector<net::Socket> connect_full_mesh(Store& store, const MeshParams& p,
                                           net::Deadline deadline) {
  std::vector<net::Socket> peers(static_cast<std::size_t>(p.size));
  net::Socket listener = net::listen_tcp("", 0);
  listener.set_buffer_sizes(p.socket_buffer_bytes);
  const std::string address = fmt::format("{}:{}", p.advertise_host, listener.local_port());
  store.set(fmt::format("{}addr/{}", p.prefix, p.rank), address);

  HandshakeParams handshake{.group = p.group,
                            .size = p.size,
                            .rank = p.rank,
                            .secret = p.secret,
                            .session = {},
                            .log = p.log};
  if (!handshake.log) {
    handshake.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  }
  if (!p.secret.empty()) handshake.session = draw_group_session(store, p.prefix + "auth/session");

  // Lower ranks accept, higher ranks connect: rank r connects to every rank below it.
  for (int peer = 0; peer < p.rank; ++peer) {
    const std::string key = fmt::format("{}addr/{}", p.prefix, peer);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
    const std::string peer_address = store.get_string(key, std::max(left, milliseconds(1)));
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
    net::Socket socket;
    try {
      socket = net::connect_tcp(host, port, deadline);
    } catch (const Error& e) {
      throw CommError(CommErrorKind::kSetup,
                      fmt::format("rank {} of group '{}' cannot connect to rank {} at {}: {}",
                                  p.rank, p.group, peer, peer_address, e.what()),
                      p.group, "connect", 0, peer);
    }
    socket.set_buffer_sizes(p.socket_buffer_bytes);
    socket.set_no_delay(true);
    connect_handshake(socket, handshake, peer, deadline);
    peers[static_cast<std::size_t>(peer)] = std::move(socket);
  }
  // Garbage, bad hellos and failed authentications are refused there without ending the wait.
  auto accepted = accept_peers(listener, handshake, deadline, p.timeout);
  for (int peer = p.rank + 1; peer < p.size; ++peer) {
    peers[static_cast<std::size_t>(peer)] = std::move(accepted[static_cast<std::size_t>(peer)]);
  }
  return peers;
}

}  // namespace ddp::comm
