// The `ring` backend: ddp's own collective engine: TCP between hosts, shared memory inside one.
//
// Ranks find each other through a Store (each publishes host:port under a key prefixed with the
// group name), connect with a checked handshake (the peers the algorithms' patterns need at once,
// O(log N) of them, any other on the first call that needs it), and then run collectives on one
// worker thread per group: pipelined ring algorithms for large messages, log-step algorithms for
// small ones (docs/algorithms.md has the algorithms, their costs and the measured switch point).
//
//   auto store = std::make_shared<ddp::TcpStore>(host, port, {.is_server = rank == 0});
//   auto pg = ddp::make_ring_process_group(store, rank, world_size, {.group_name = "default"});
//
// make_ring_process_group blocks until its pattern peers have connected, or throws: ConfigError for
// bad arguments, CommError when a lower rank answers the handshake as a peer of another
// group/rank/protocol/secret, or when the peers do not show up before the timeout. A connection
// to this rank's port that fails the handshake (garbage, a bad hello, a wrong or missing secret)
// is refused and logged, and the wait goes on. Call it from one thread per rank.
//
// File descriptors: a group holds about two sockets per peer (collectives, point to point), a few
// listeners and eventfds, and a pidfd per other rank of its host. Before connecting,
// make_ring_process_group raises the soft RLIMIT_NOFILE to the hard limit if it is short of that
// (plus what the process has open and some headroom), and throws CommError (kSetup) at once,
// naming `ulimit -n` and the number needed, if even the hard limit is. Running out later (EMFILE
// while connecting or accepting) is a CommError that names the limit, within about a second.
//
// Timeout precedence (first that applies): CallOptions::timeout of the call; RingOptions::timeout
// when non-zero; the DDP_TIMEOUT environment variable (seconds, may be fractional) read here;
// kDefaultTimeout (300 s). The same timeout bounds the connection set-up.
//
// Transport (RingOptions::transport, else the DDP_TRANSPORT environment variable, else auto): at
// creation every rank publishes a host identity (host name, kernel boot id, network namespace).
// With `auto`, a group whose ranks all share a host runs allreduce, broadcast, reduce, allgather,
// reduce_scatter and barrier through one shared-memory segment (src/comm/shm); a group spanning
// hosts with several ranks on some host runs allreduce hierarchically (inside each host over
// shared memory, across hosts over TCP). `tcp` uses TCP for everything. Every rank must choose
// the same transport (a difference is a ConfigError at creation on every rank).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/comm/process_group.h"
#include "ddp/store/store.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

enum class Transport {
  kAuto,  // shared memory among the ranks of a host, TCP between hosts
  kTcp,   // TCP (loopback on one host) for everything
};

struct RingOptions {
  // 0 = DDP_TIMEOUT if set, else kDefaultTimeout. See the precedence above.
  std::chrono::milliseconds timeout{0};
  // Names the group in store keys and error messages; groups sharing a store need distinct names
  // (re-creating a group of the same name later is fine).
  std::string group_name = "default";
  // Address peers use to reach this rank. "" = DDP_ADVERTISE_ADDR if set, else this host's name.
  std::string advertise_host;
  // allreduce messages of at most this many bytes (2x this in a group of two) use recursive
  // doubling instead of the ring, and broadcasts a binomial tree instead of a chain (chosen by
  // measurement, see docs/algorithms.md). Must be equal on every rank.
  std::size_t small_message_bytes = 128 * 1024;
  // Bytes received per step before reducing them (a cache-sized scratch chunk per stream).
  std::size_t chunk_bytes = 256 * 1024;
  // SO_SNDBUF/SO_RCVBUF of every connection.
  int socket_buffer_bytes = 4 * 1024 * 1024;
  // How long a waiting thread polls without sleeping (lower latency, burns a core meanwhile).
  // 0 disables spinning; negative = automatic: 50 us when the group has no more ranks than this
  // host has cores, else 0.
  std::chrono::microseconds spin{-1};
  // How long the group's worker thread stays awake (yielding the core) after its last operation,
  // so that back-to-back calls need no thread wake-up. 0 = sleep at once. Not while callers wait
  // for their operations at once: then operations of up to 1 MiB run on the waiting thread and
  // the idle worker only polls the queue every 1 ms (docs/algorithms.md, "Lazy wake-up").
  std::chrono::microseconds worker_linger{200};
  // Unset = the DDP_TRANSPORT environment variable ("auto" or "tcp") if set, else kAuto. Must be
  // equal on every rank.
  std::optional<Transport> transport;
  // Bytes of one shared-memory chunk per rank (0 = the engine's default, 1 MiB); larger messages
  // stream through the segment chunk by chunk. Must be equal on the ranks of a host.
  std::size_t shm_slot_bytes = 0;
  // The job's shared secret ("" = none: trusted network only). When set, every connection of the
  // group opens with a mutual HMAC-SHA256 challenge-response bound to this group instance, both
  // ranks and fresh nonces, before it carries a byte of a collective (docs/security.md); a peer
  // that fails it is refused and logged while the group keeps waiting for the real one. Must be
  // equal on every rank. init_process_group passes the job's secret (DDP_SECRET). Needs a build
  // with OpenSSL (ConfigError otherwise).
  std::string secret;
  // Receives one line per refused connection (garbage, a bad hello, a failed authentication);
  // default: stderr. Called on the thread that creates the group.
  std::function<void(const std::string& line)> log;
};

std::shared_ptr<ProcessGroup> make_ring_process_group(std::shared_ptr<Store> store, int rank,
                                                      int size, RingOptions options = {});

// How a group made by make_ring_process_group moves data, for logs and tests: "tcp", "shm" (one
// host, shared memory), or "hierarchical(H hosts, ...)"; "" for groups of other backends.
std::string ring_transport_of(const ProcessGroup& group);

// How many TCP connections a group made by make_ring_process_group holds to its peers for its
// collectives (its own mesh and its cross-host step's): from creation on the peers its algorithms'
// usual patterns need (rank +- 2^k, the recursive-doubling partners: O(log size)), any other peer
// once a call first needs it (alltoall, gather, scatter). Point-to-point connections are not
// counted. -1 for groups of other backends. Call while none of the group's calls is in flight.
int ring_collective_connections_of(const ProcessGroup& group);

// How many TCP connections a group made by make_ring_process_group holds for its sends and
// receives: none at creation, then one per peer it has exchanged a message with (the higher rank
// of a pair connects when it first posts an operation naming the lower, or a receive from any
// source: then to every rank below). -1 for groups of other backends. Any thread, any time.
int ring_point_to_point_connections_of(const ProcessGroup& group);

// How many allreduces of a group made by make_ring_process_group reduced straight from the ranks'
// shared buffers (ProcessGroup::allocate_shared_buffer) instead of copying through the host's
// segment; -1 for groups of other backends. Any thread, any time.
long long ring_shared_buffer_allreduces_of(const ProcessGroup& group);
// The same for reduce-scatters whose input, and allgathers whose output, lay in such a buffer at
// the same offset on every rank (read, or written, straight in the peers' copies).
long long ring_shared_buffer_reduce_scatters_of(const ProcessGroup& group);
long long ring_shared_buffer_allgathers_of(const ProcessGroup& group);

}  // namespace ddp
#pragma GCC visibility pop
