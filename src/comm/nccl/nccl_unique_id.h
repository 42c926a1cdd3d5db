// Sharing a communicator's NCCL unique id through the rendezvous store (internal).
//
// NCCL's ranks meet through a 128-byte id that one rank creates (ncclGetUniqueId: it names that
// rank's bootstrap socket) and every other rank must receive before ncclCommInitRank. As the ring
// backend shares its addresses, rank 0 publishes the id under the communicator's key and the
// others wait for that key, bounded by the group's deadline. Nothing here calls NCCL: the id
// comes from a generator, so tests exchange fake ids through a real store without a GPU.
//
// Every communicator has keys of its own: next_setup_prefix counts the ranks that set up a
// communicator of this group name, so re-creating a group of the same name (or a second world
// group in one job) never reads an old id. Rank 0's failure to create an id is published too, so
// the others fail at once naming it instead of waiting for the deadline.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "ddp/store/store.h"
#include "net/socket.h"

namespace ddp::comm::nccl {

inline constexpr std::size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueIdBytes = std::array<std::uint8_t, kUniqueIdBytes>;
// Creates an id (ncclGetUniqueId); throws on failure. Called on rank 0 only.
using UniqueIdGenerator = std::function<UniqueIdBytes()>;

// "nccl/<group>/<k>/": the keys of the k-th communicator set up under this group name (every rank
// of it gets the same k as long as the ranks of one set-up all join before the next one starts,
// which holds since setting up a group is collective).
std::string next_setup_prefix(Store& store, const std::string& group, int size);

// Rank 0: generate, publish under `prefix` + "unique_id", return. Others: wait for it until
// `deadline`. Throws CommError naming the group: kTimeout when rank 0 did not publish in time,
// kSetup when rank 0 published its failure (with its text) or the value is malformed; rank 0
// rethrows its generator's exception after publishing it.
UniqueIdBytes exchange_unique_id(Store& store, const std::string& prefix, const std::string& group,
                                 int rank, const UniqueIdGenerator& generate,
                                 net::Deadline deadline);

}  // namespace ddp::comm::nccl
