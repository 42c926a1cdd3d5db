// The handshake that opens every RPC connection (internal; agent.h). The caller (the side that
// connected) and the callee each prove they belong to this RPC instance, and, when the job has a
// secret, that they know it:
//
//   caller -> callee   Hello{"DRPH", version, has secret, world, caller rank, callee rank} + Nc
//   callee -> caller   status + reason (refused: why) + Ns + HMAC(secret, "ddp-rpc callee" || T)
//   caller -> callee   HMAC(secret, "ddp-rpc caller" || T)
//   callee -> caller   status + reason
//
// T = session || world || caller rank || callee rank || caller name || callee name || Nc || Ns:
// the session is a random id rank 0 drew for this RPC instance and published in the store, the
// names are the workers' (from the store), Nc and Ns 32 fresh random bytes. Each side accepts the
// other only after checking its MAC in constant time, so a stranger, a worker of another job or
// instance, and a replayed handshake are refused; without a secret the MACs are zero and only
// the instance, world and ranks are checked. Nothing is encrypted (docs/security.md).
//
// Every read and write is bounded by the deadline; every length is checked before it is used.
#pragma once

#include <functional>
#include <string>

#include "net/socket.h"

namespace ddp::rpc::transport {

struct HandshakeSelf {
  std::string session;
  int world_size = 0;
  int rank = 0;
  std::string name;
  std::string secret;  // "" = no authentication
};

// Throws ProtocolError (the callee refused, saying why, or answered with bytes that are not the
// protocol), TimeoutError at the deadline, Error when the connection fails.
void handshake_as_caller(net::Socket& socket, const HandshakeSelf& self, int callee_rank,
                         const std::string& callee_name, net::Deadline deadline);

// Returns the caller's rank. `name_of_rank` gives a worker's name. Throws as above after telling
// the caller why it was refused, where it still listens.
int handshake_as_callee(net::Socket& socket, const HandshakeSelf& self,
                        const std::function<std::string(int)>& name_of_rank,
                        net::Deadline deadline);

}  // namespace ddp::rpc::transport
