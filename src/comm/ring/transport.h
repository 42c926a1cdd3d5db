// RingTransport: what a ring group asks of each transport it runs calls over, besides running
// them (internal): the TCP mesh (tcp_mesh.h) and the host's shared-memory domain
// (shm/shm_domain.h). With it the group's cross-transport mismatch check and its failure handling
// are written once for both (ring_group.cc).
#pragma once

#include <string>

#include "comm/wire.h"

namespace ddp::comm {

class RingTransport {
 public:
  // For a rank that is not in a call of this transport (it runs another transport's step with the
  // same sequence number): the first peer, in the numbering of the group the transport serves,
  // whose call with `mine`'s sequence number is another call, with that call's header in
  // `theirs`; -1 when none is seen. Looks without taking anything the transport's calls read.
  virtual int peer_with_other_call(const OpHeader& mine, OpHeader& theirs) const = 0;
  // The group failed with `reason`: peers waiting on this rank through this transport fail now
  // instead of at their deadlines. Never throws.
  virtual void abort(const std::string& reason) noexcept = 0;

 protected:
  ~RingTransport() = default;
};

}  // namespace ddp::comm
