#include "comm/ring/tcp_mesh.h"

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "net/fd_io.h"

namespace ddp::comm {

TcpMesh::TcpMesh(std::string group, int rank, int size, std::size_t chunk_bytes,
                 std::chrono::microseconds spin)
    : group_(std::move(group)), context_(group_, rank, size, chunk_bytes, spin) {
  context_.set_peer_fds(std::vector<int>(static_cast<std::size_t>(size), -1));
}

void TcpMesh::connect(Store& store, const MeshParams& params, net::Deadline deadline) {
  {
    // Under the lock: abort() may run on another thread once the group's failure handling is set
    // up, and reads the slots.
    std::lock_guard lock(mutex_);
    mesh_.open(store, params, pattern_peers(params.rank, params.size), deadline);
    std::vector<int> fds;
    fds.reserve(mesh_.sockets().size());
    for (const auto& socket : mesh_.sockets())
      fds.push_back(socket.valid() ? socket.fd() : -1);
    context_.set_peer_fds(std::move(fds));
  }
  context_.set_peer_connector([this](int peer, const Call& call, net::Deadline deadline) {
    connect_on_first_use(peer, call, deadline);
  });
}

void TcpMesh::connect_on_first_use(int peer, const Call& call, net::Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (aborted_) {
    throw CommError(
        CommErrorKind::kAborted,
        fmt::format("rank {}: group '{}' was aborted before {} could connect to rank {}",
                    context_.rank(), group_, call.description(), peer),
        group_, call.description(), call.header.sequence, peer);
  }
  // The wait runs unlocked: abort() must not wait for it. The slot is written under the lock.
  // While it waits it runs the group's cross-transport check and ends once the group is aborted
  // (abort() also shuts the listener, which wakes it).
  lock.unlock();
  const std::function<void()>* group_check = context_.idle_check();
  const std::function<void()> idle = [&] {
    if (aborted_.load()) {
      throw CommError(CommErrorKind::kAborted,
                      fmt::format("rank {}: group '{}' was aborted while {} waited for rank {} "
                                  "to connect",
                                  context_.rank(), group_, call.description(), peer),
                      group_, call.description(), call.header.sequence, peer);
    }
    if (group_check != nullptr) (*group_check)();
  };
  mesh_.connect_peer(peer, AcceptWait{.deadline = deadline,
                                      .timeout = call.timeout,
                                      .op = call.description(),
                                      .sequence = call.header.sequence,
                                      .idle = &idle});
  lock.lock();
  // Every peer that arrived meanwhile is usable too.
  const auto& all = mesh_.sockets();
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].valid() && context_.peer_fds()[r] < 0) {
      context_.set_peer_fd(static_cast<int>(r), all[r].fd());
      if (aborted_) net::shutdown_socket(all[r].fd(), net::ShutdownHow::kBoth);
    }
  }
}

void TcpMesh::abort(const std::string& /*reason*/) noexcept {
  std::lock_guard lock(mutex_);
  aborted_ = true;
  // Peers in the middle of a first connection to this rank fail now (their handshake is reset)
  // and this rank's own wait for one ends (see connect_on_first_use).
  mesh_.shutdown_listener();
  // The table of descriptors holds exactly the sockets the executor may use (a connection still
  // being made is shut once it is entered, above).
  for (const int fd : context_.peer_fds()) {
    if (fd >= 0) net::shutdown_socket(fd, net::ShutdownHow::kBoth);
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
