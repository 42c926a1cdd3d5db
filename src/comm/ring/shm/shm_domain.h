// ShmDomain: collectives among the ranks of one group that share a host, through one POSIX
// shared-memory segment instead of loopback TCP (internal to the ring backend).
//
//   auto domain = ShmDomain::create(store, "pg0/shm", rank, size, {}, deadline_after(30s));
//   OpHeader h{.kind = Collective::kAllreduce, .dtype = uint8_t(DType::kFloat32), .reduce_op = 0,
//              .sequence = seq++, .count = n};
//   domain->allreduce(send, recv, n, DType::kFloat32, ReduceOp::kSum, h, deadline_after(60s));
//
// Every rank of the domain must call the same collectives in the same order (like any group).
// Each call's OpHeader travels with the first synchronisation of the call and is compared on every
// rank, so ranks that issue different calls throw a CommError naming both calls and both ranks
// instead of exchanging wrong bytes. Algorithms and their memory traffic: docs/shared-memory.md.
//
// Threads: one ShmDomain is used by ONE thread at a time (the group's worker thread). It is not
// fork-safe: a child of a rank must not use its parent's domain.
//
// Errors: CommError (or its subclass ShmPeerError when a peer died or aborted) when a peer exits,
// a peer aborts, the deadline passes, or the calls of the ranks differ; once a call has failed the
// domain is poisoned and every later call rethrows that first error at once. create() throws
// CommError when the segment cannot be made or joined, TimeoutError when the store does not
// answer in time, and ConfigError for arguments out of range. Calls with bad arguments (a header
// that does not describe the call) throw ConfigError without touching the domain; the peers then
// wait for this rank until their deadline, so validate arguments before calling.
//
// The segment is memory that any process of the same user can write (through /proc). Every value
// a rank reads from it that could index, size or name something is checked where it is read (a
// rank number against the world, a pid, the layout); one out of range fails the call or create()
// with a CommError saying that the segment is damaged, never a crash or a read outside it
// (segment.h lists the fields and their checks).
//
// Assumes the ranks share a pid namespace (a dead peer is found by its pid, through a pidfd).
//
// Implemented in shm_domain_setup.cc (the segment: create, join, lifetime), shm_call_protocol.cc
// (the per-call synchronisation: events, arrivals, waits, header check, abort), shm_collectives.cc
// and shm_other_collectives.cc (the collectives over that protocol).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/ring/shm/shared_buffers.h"
#include "comm/ring/transport.h"
#include "comm/wire.h"
#include "ddp/comm/comm_error.h"
#include "ddp/comm/process_group.h"
#include "ddp/comm/types.h"
#include "ddp/store/store.h"
#include "net/socket.h"

namespace ddp::comm::shm {

using Deadline = net::Deadline;

// A peer of the domain exited, was killed, or aborted its call (peer() names it).
class ShmPeerError : public CommError {
 public:
  using CommError::CommError;
};

struct ShmOptions {
  // How a rank waits for a peer: busy-wait (pause) for `spin`, then poll with sched_yield()
  // between checks until `yield` after the wait began, then sleep on a futex (woken by the
  // peer's FUTEX_WAKE, or every liveness_interval). Ranks are not pinned, so a peer is often
  // runnable on this very core: yielding hands it the core at once, where pause-spinning keeps
  // it off (measured on 2 loaded cores: 1 KiB allreduce, world 2, 2.3 µs with spin 0, 4.3 µs
  // with spin 2 µs, 100 µs with spin 50 µs; world 4, 5.4 µs with yield 100 µs, 15 µs with
  // futex only). `spin` is ignored when ranks outnumber the cores this process may use.
  std::chrono::microseconds spin{0};
  std::chrono::microseconds yield{100};
  // Bytes of one chunk of a large collective (per rank and per buffer; two buffers per rank for
  // double buffering). Larger messages stream through the segment chunk by chunk.
  std::size_t slot_bytes = std::size_t{1} << 20;
  // Allreduces up to this many bytes take the one-synchronisation path (every rank reduces all
  // inputs itself). Must not exceed slot_bytes.
  std::size_t small_bytes = 16 * 1024;
  // How often a sleeping rank wakes to check that its peers are alive and the deadline.
  std::chrono::milliseconds liveness_interval{10};
  // A call still waiting for a peer this long after its first wait logs one warning naming the
  // peer (0: never); `warn` gets the line (null: stderr).
  std::chrono::milliseconds wait_warning{0};
  std::function<void(const std::string&)> warn;
  // Name of the group, for error messages.
  std::string group = "shm";
  // The rank in the enclosing group of each rank of the domain (index: domain rank), when the
  // domain is part of a larger group (the ranks of one host in a multi-host job): messages then
  // name ranks as "rank 3 (local 1)" and CommError::peer() is the enclosing group's rank. Empty:
  // the domain's own numbers. Must have `size` entries when set.
  std::vector<int> ranks;
  // Prefix of the segment's memfd name, as /proc/<pid>/maps shows it (the full name adds the pid
  // and a random suffix). The segment never appears in /dev/shm.
  std::string name_prefix = "ddp-shm";
  // Called between naps (every liveness_interval) while a call waits; may throw CommError, which
  // fails the call like any error of the domain. The ring backend uses it to notice a peer that
  // runs a different call over TCP.
  std::function<void()> on_nap;
};

class ShmDomain final : public RingTransport {
 public:
  // Collective over the `size` local ranks: rank 0 creates the segment as anonymous memory
  // (memfd_create: it never has a name in /dev/shm) and publishes where the peers can open its
  // descriptor (/proc/<pid>/fd/<fd>) in `store` under `key_prefix`/name; the others open it and
  // announce themselves in the segment; once every rank has it mapped, rank 0 closes its
  // descriptor. No segment outlives the processes, whatever happens to them at any point (the
  // ranks must share a user and a pid namespace). Bounded by `deadline`.
  static std::unique_ptr<ShmDomain> create(Store& store, const std::string& key_prefix, int rank,
                                           int size, ShmOptions options, Deadline deadline);

  ~ShmDomain();
  ShmDomain(const ShmDomain&) = delete;
  ShmDomain& operator=(const ShmDomain&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ShmOptions& options() const { return options_; }
  // What the segment is called, for tests and logs: "memfd:<name>" on rank 0, the /proc path
  // this rank opened it through elsewhere.
  const std::string& segment_name() const { return segment_name_; }

  // Blocking collectives on raw buffers. `header` describes the call (kind, dtype, reduce op,
  // count, root, sequence) and must match the arguments; send may equal recv (in place) for
  // allreduce and reduce. Results are bit-identical on every rank: each element is reduced once,
  // in rank order, or by every rank in the same order.
  //
  // An in-place allreduce larger than small_bytes whose buffer lies in a shared buffer (see
  // shared_buffers()) at the same offset on every rank takes the zero-copy path: each rank reduces
  // its slice straight from every rank's copy and writes the result into all of them (two
  // synchronisations, no staging through the segment; the same bits as the copying path). Any
  // other call, and any call where one rank's buffer is not shared, copies through the segment.
  void allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                 const OpHeader& header, Deadline deadline);
  // In place over the concatenation of `segments` (ProcessGroup::allreduce_segments): the same
  // call as allreduce() of their total count, reading and writing the pieces where they lie.
  void allreduce_segments(std::span<const BufferSegment> segments, DType dtype, ReduceOp op,
                          const OpHeader& header, Deadline deadline);
  void broadcast(void* buf, std::size_t count, DType dtype, int root, const OpHeader& header,
                 Deadline deadline);
  // recv is written on `root` only (may be null elsewhere).
  void reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op, int root,
              const OpHeader& header, Deadline deadline);
  // recv holds size() * count_per_rank elements, rank r's contribution at r * count_per_rank.
  // When recv lies in a shared buffer at the same offset on every rank (and send does not
  // overlap recv, or is this rank's block of it), each rank writes its contribution straight
  // into every rank's copy (zero-copy; one more synchronisation ends the call).
  void allgather(const void* send, void* recv, std::size_t count_per_rank, DType dtype,
                 const OpHeader& header, Deadline deadline);
  // send holds size() * count_per_rank elements; rank r receives the reduction of block r.
  // recv must not overlap send. When send lies in a shared buffer at the same offset on every
  // rank, each rank reduces its block straight from every rank's copy into recv (zero-copy, in
  // rank order: the copying path's bits).
  void reduce_scatter(const void* send, void* recv, std::size_t count_per_rank, DType dtype,
                      ReduceOp op, const OpHeader& header, Deadline deadline);
  void barrier(const OpHeader& header, Deadline deadline);

  // The buffers this domain's ranks have mapped into each other (made by the ring group,
  // collectively); thread-safe.
  SharedBufferRegistry& shared_buffers() { return *shared_buffers_; }
  const std::shared_ptr<SharedBufferRegistry>& shared_buffer_registry() const {
    return shared_buffers_;
  }
  // How many allreduces took the zero-copy path so far (any thread).
  std::uint64_t shared_buffer_allreduces() const {
    return shared_buffer_allreduces_.load(std::memory_order_relaxed);
  }
  // The same for reduce-scatters and allgathers.
  std::uint64_t shared_buffer_reduce_scatters() const {
    return shared_buffer_reduce_scatters_.load(std::memory_order_relaxed);
  }
  std::uint64_t shared_buffer_allgathers() const {
    return shared_buffer_allgathers_.load(std::memory_order_relaxed);
  }

  // RingTransport: a local peer whose current call has mine.sequence but another header (by its
  // rank in the group, ShmOptions::ranks), or -1. Reads each header twice, so a header being
  // written is not mistaken for a different call.
  int peer_with_other_call(const OpHeader& mine, OpHeader& theirs) const override;

  // True once a call failed; every later call throws the same error.
  bool poisoned() const { return static_cast<bool>(error_); }

  // Poisons the domain from outside a call (the owner failed for another reason, e.g. a TCP
  // peer): sets the shared abort flag with `reason`, so local peers waiting in a call fail now
  // with "rank R aborted the group: <reason>" instead of at their deadline. Later calls throw
  // CommError(reason). Does nothing when the domain is already poisoned. Same thread rules as the
  // calls.
  void abort(const std::string& reason) noexcept override;

  struct Segment;  // the layout of the shared mapping (shm_domain_internal.h)

 private:
  ShmDomain(int rank, int size, ShmOptions options);

  // One chunked collective; the three steps are called with (first element, elements, buffer
  // parity) of each chunk (see shm_collectives_internal.h).
  template <typename CopyIn, typename Compute, typename CopyOut>
  void run_chunked(std::size_t count, std::size_t chunk_elems, CopyIn&& copy_in, Compute&& compute,
                   CopyOut&& copy_out);
  // The same, where `instead` may run the whole call once every rank has arrived: when it returns
  // true, the rank publishes one event, waits for every rank's, and the call is done.
  template <typename CopyIn, typename Compute, typename CopyOut, typename Instead>
  void run_chunked_or(std::size_t count, std::size_t chunk_elems, CopyIn&& copy_in,
                      Compute&& compute, CopyOut&& copy_out, Instead&& instead);
  class Pieces;  // a contiguous buffer or several segments (shm_collectives.cc)
  // `shared`: the shared buffer an in-place allreduce's data lies in (at `shared_offset`), or null.
  void run_allreduce(const Pieces& in, const Pieces& out, std::size_t count, DType dtype,
                     ReduceOp op, const OpHeader& header, Deadline deadline,
                     const SharedBufferMapping* shared = nullptr, std::size_t shared_offset = 0);
  // Publishes, with this call's header, the shared buffer this rank's data lies in (at `offset`)
  // or none (null), before the call's first event.
  void name_shared_buffer(const SharedBufferMapping* shared, std::size_t offset);
  // Whether every rank named `shared` at `offset` (once all arrived).
  bool all_named(const SharedBufferMapping& shared, std::size_t offset) const;
  // The zero-copy paths, when every rank names `shared` at `offset` (after all arrived).
  bool try_zero_copy_allreduce(const SharedBufferMapping& shared, std::size_t offset,
                               std::size_t count, DType dtype, ReduceOp op);
  bool try_zero_copy_reduce_scatter(const SharedBufferMapping& shared, std::size_t offset,
                                    std::byte* recv, std::size_t count_per_rank, DType dtype,
                                    ReduceOp op);
  bool try_zero_copy_allgather(const SharedBufferMapping& shared, std::size_t offset,
                               const std::byte* send, std::size_t count_per_rank, DType dtype);
  void run_small_allreduce(const Pieces& in, const Pieces& out, std::size_t count, DType dtype,
                           ReduceOp op);

  template <typename Fn>
  void guarded(const OpHeader& header, Deadline deadline, Fn&& body);

  void announce_and_check();
  void publish();
  void arrive();
  void wait_all_arrived();
  void wait_all(std::uint32_t target);
  void wait_for(int peer, std::uint32_t target);
  template <typename Blame>
  void wait_word(std::uint32_t& word, std::uint32_t& sleepers, std::uint32_t target, Blame&& blame);
  int dead_peer() const;  // a peer that exited, or -1
  // The peer that aborted the domain, or -1; throws CommError when aborted_by names no peer.
  int aborted_peer() const;
  [[noreturn]] void fail_dead(int peer) const;
  [[noreturn]] void fail_aborted(int peer) const;
  // A field of the segment holds what no rank of this domain can have written there.
  [[noreturn]] void fail_damaged(const std::string& what) const;
  // `peer` is a domain rank (or -1); the CommError carries its group_rank().
  [[noreturn]] void fail(CommErrorKind kind, const std::string& what, int peer,
                         bool peer_error = false) const;
  void warn_waiting(int peer, net::Clock::time_point now);
  int group_rank(int r) const;  // options_.ranks[r], or r without a mapping
  void abort_domain(const std::string& reason) noexcept;

  std::byte* input_slot(int rank, int parity) const;
  std::byte* result_slot(int parity) const;
  std::byte* small_slot(int rank, int parity) const;

  int rank_;
  int size_;
  ShmOptions options_;
  std::string segment_name_;
  void* mapping_ = nullptr;
  std::size_t mapping_bytes_ = 0;
  Segment* segment_ = nullptr;
  std::byte* data_ = nullptr;
  std::vector<int> peer_pidfds_;  // -1 for this rank or when pidfd_open is unavailable
  std::vector<int> peer_pids_;
  std::chrono::microseconds spin_{0};  // options_.spin, or 0 when ranks outnumber cores

  // State of the call in progress.
  OpHeader header_{};
  std::string op_text_;
  Deadline deadline_{};
  net::Clock::time_point call_start_{};  // first wait of the call, for "timed out after N ms"
  bool wait_warned_ = false;             // this call logged its wait_warning
  std::uint32_t events_ = 0;  // events this rank has published (mirrors its shared counter)
  std::uint64_t calls_ = 0;   // calls made (their parity picks the header and small buffers)

  std::shared_ptr<SharedBufferRegistry> shared_buffers_ = std::make_shared<SharedBufferRegistry>();
  std::atomic<std::uint64_t> shared_buffer_allreduces_{0};
  std::atomic<std::uint64_t> shared_buffer_reduce_scatters_{0};
  std::atomic<std::uint64_t> shared_buffer_allgathers_{0};
  std::vector<std::byte> zero_copy_scratch_;

  std::optional<CommError> error_;
  bool error_is_peer_ = false;
};

}  // namespace ddp::comm::shm
