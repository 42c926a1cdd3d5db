#include "comm/ring/tcp_mesh.h"

#include "net/fd_io.h"

namespace ddp::comm {

TcpMesh::TcpMesh(std::string group, int rank, int size, std::size_t chunk_bytes,
                 std::chrono::microseconds spin)
    : group_(std::move(group)),
      sockets_(static_cast<std::size_t>(size)),
      context_(group_, rank, size, chunk_bytes, spin) {}

void TcpMesh::connect(Store& store, const MeshParams& params, net::Deadline deadline) {
  sockets_ = connect_full_mesh(store, params, deadline);
  std::vector<int> fds;
  fds.reserve(sockets_.size());
  for (const auto& socket : sockets_)
    fds.push_back(socket.valid() ? socket.fd() : -1);
  context_.set_peer_fds(std::move(fds));
}

void TcpMesh::abort(const std::string& /*reason*/) noexcept {
  for (auto& socket : sockets_) {
    if (socket.valid()) net::shutdown_socket(socket.fd(), net::ShutdownHow::kBoth);
  }
}

int TcpMesh::peer_with_other_call(const OpHeader& mine, OpHeader& theirs) const {
  const auto& fds = context_.peer_fds();
  for (std::size_t peer = 0; peer < fds.size(); ++peer) {
    if (fds[peer] < 0) continue;
    OpHeader got;
    const ssize_t n = net::peek_nonblocking(fds[peer], &got, sizeof got);
    if (n == static_cast<ssize_t>(sizeof got) && got.magic == kHeaderMagic &&
        got.sequence == mine.sequence && !(got == mine)) {
      theirs = got;
      return static_cast<int>(peer);
    }
  }
  return -1;
}

}  // namespace ddp::comm
