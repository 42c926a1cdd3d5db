#include "store/fd_limit.h"

#include <algorithm>

#include "net/descriptors.h"

namespace ddp::store {

std::size_t raise_open_files_limit() {
  return net::raise_open_files_limit();
}

std::size_t automatic_max_connections(std::size_t open_files) {
  return std::clamp<std::size_t>(open_files / 2, 1, kMaxAutomaticConnections);
}

}  // namespace ddp::store
