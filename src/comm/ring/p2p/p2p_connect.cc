#include "comm/ring/p2p/p2p_connect.h"

#include <algorithm>

#include <fmt/format.h>

#include "ddp/comm_error.h"
#include "ddp/error.h"

namespace ddp::comm::p2p {

std::vector<net::Socket> connect_p2p_peers(Store& store, const HandshakeParams& params,
                                           const ConnectOptions& options, net::Deadline deadline) {
  using std::chrono::milliseconds;
  std::vector<net::Socket> peers(static_cast<std::size_t>(params.size));
  if (params.size == 1) return peers;
  net::Socket listener = net::listen_tcp("", 0);
  listener.set_buffer_sizes(options.socket_buffer_bytes);
  store.set(fmt::format("{}addr/{}", options.key_prefix, params.rank),
            fmt::format("{}:{}", options.advertise_host, listener.local_port()));
  for (int peer = 0; peer < params.rank; ++peer) {
    const std::string key = fmt::format("{}addr/{}", options.key_prefix, peer);
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - net::Clock::now());
    const std::string address = store.get_string(key, std::max(left, milliseconds(1)));
    const auto colon = address.rfind(':');
    if (colon == std::string::npos) {
      throw CommError(fmt::format("rank {} of group '{}': store key '{}' holds '{}', not host:port",
                                  params.rank, params.group, key, address),
                      params.group, "connect", 0, peer);
    }
    net::Socket socket;
    try {
      socket = net::connect_tcp(address.substr(0, colon),
                                static_cast<std::uint16_t>(std::stoi(address.substr(colon + 1))),
                                deadline);
    } catch (const Error& e) {
      throw CommError(fmt::format("rank {} of group '{}' cannot connect to rank {} at {}: {}",
                                  params.rank, params.group, peer, address, e.what()),
                      params.group, "connect", 0, peer);
    }
    socket.set_buffer_sizes(options.socket_buffer_bytes);
    socket.set_no_delay(true);
    connect_handshake(socket, params, peer, deadline);
    peers[static_cast<std::size_t>(peer)] = std::move(socket);
  }
  auto accepted = accept_peers(listener, params, deadline, options.timeout);
  for (int peer = params.rank + 1; peer < params.size; ++peer) {
    peers[static_cast<std::size_t>(peer)] = std::move(accepted[static_cast<std::size_t>(peer)]);
  }
  for (auto& socket : peers) {
    if (!socket.valid()) continue;
    socket.set_buffer_sizes(options.socket_buffer_bytes);
    socket.set_nonblocking(true);
  }
  return peers;
}

}  // namespace ddp::comm::p2p
