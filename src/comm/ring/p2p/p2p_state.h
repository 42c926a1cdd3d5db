// The state of a P2pEngine (internal to src/comm/ring/p2p): the operations and frames of each
// peer's connection, and the engine's shared State, whose work is split by concern:
//   p2p_engine.cc    the API: posting sends and receives, abort, start and shutdown
//   p2p_matching.cc  the protocol: matching messages to receives, eager credit, rejections
//   p2p_progress.cc  moving bytes (reading, writing), deadlines, failures, the progress thread
// Every State member function is called with State::mutex held unless it says otherwise.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "comm/ring/p2p/p2p_engine.h"
#include "comm/ring/p2p/p2p_frame.h"
#include "ddp/comm/comm_error.h"

namespace ddp::comm::p2p {

using Clock = net::Clock;
using std::chrono::milliseconds;

inline constexpr std::size_t kFrameBytes = sizeof(P2pFrame);
inline constexpr int kMaxIov = 64;
// Bytes read from one peer before the loop turns to the others (fairness, lock hold time).
inline constexpr std::size_t kReadBudget = std::size_t{8} << 20;
// How long the destructor lets the kernel deliver what was written before closing.
inline constexpr auto kCloseLinger = std::chrono::seconds(2);

inline std::string error_text(int err) {
  char buf[256];
  return std::string(strerror_r(err, buf, sizeof buf));
}

struct SendOp {
  std::shared_ptr<Work> work;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  P2pFrame header;
  int peer = 0;
  bool cleared = false;  // kRequest: the receiver asked for the payload
  Clock::time_point deadline;
  milliseconds timeout{0};
};

struct RecvOp {
  std::shared_ptr<Work> work;
  std::byte* data = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  int tag = 0;
  int peer = 0;  // a receive from any source: -1 until a message binds it to its sender
  std::uint64_t number = 0;
  // Posting order across peers: a message that both a receive from its sender and a receive from
  // any source could take goes to the one posted first (MPI's rule).
  std::uint64_t order = 0;
  int* source = nullptr;  // a receive from any source: where the sender's rank goes once bound
  Clock::time_point deadline;
  milliseconds timeout{0};
  std::size_t bytes() const { return count * dtype_size(dtype); }
};

// A frame waiting to be written (a message's header and payload, or a control frame).
struct OutItem {
  P2pFrame header;
  const std::byte* payload = nullptr;
  std::size_t bytes = 0;
  std::size_t done = 0;               // of kFrameBytes + bytes
  std::shared_ptr<SendOp> completes;  // the send this item finishes
  P2pFrame own_payload{};             // kReject: the payload (the rejected message's frame)
};

// A message that arrived before a receive took it.
struct Unexpected {
  P2pFrame header;
  std::vector<std::byte> payload;   // kEager
  bool complete = false;            // the eager payload is all here (kRequest: always)
  std::shared_ptr<RecvOp> claimed;  // taken before its payload was complete
  bool rejected = false;            // taken by a receive that did not agree: drop when complete
  std::uint64_t arrival = 0;        // arrival order across peers (a receive from any source)
};

struct Peer {
  int fd = -1;                     // -1 until the connection is made (p2p_connector.h)
  bool connect_requested = false;  // this rank asked its connector for it
  net::Socket socket;
  std::exception_ptr failed;  // set once: every operation with this peer fails with it
  bool closed = false;        // the peer closed cleanly (its messages already here still match)
  // Writing failed (EPIPE, ECONNRESET: the peer has closed its end): nothing more is written, but
  // what it sent before is still read, up to the end of the stream.
  bool write_broken = false;

  // Sending.
  std::deque<OutItem> out;
  std::size_t credit = kEagerWindowBytes;
  std::uint64_t next_message = 0;
  std::map<std::uint64_t, std::shared_ptr<SendOp>> sends;  // incomplete, by message number

  // Receiving.
  std::uint64_t next_recv = 0;
  std::map<std::uint64_t, std::shared_ptr<RecvOp>> recvs;          // incomplete, by receive number
  std::deque<std::shared_ptr<RecvOp>> posted;                      // unmatched, in posting order
  std::list<Unexpected> unexpected;                                // in arrival order
  std::map<std::uint64_t, std::shared_ptr<RecvOp>> awaiting_data;  // cleared, by message

  // The frame being read.
  P2pFrame in{};
  std::size_t in_header_done = 0;
  std::byte* in_dst = nullptr;
  std::size_t in_left = 0;  // payload bytes still to read
  std::size_t in_bytes = 0;
  bool in_discard = false;
  bool in_eager = false;  // return the credit once delivered
  std::shared_ptr<RecvOp> in_recv;
  bool in_to_unexpected = false;
  std::list<Unexpected>::iterator in_unexpected;
  bool in_reject = false;  // the payload is the rejected message's frame
  P2pFrame in_reject_header{};
  P2pFrame rejected_message{};

  bool idle() const { return sends.empty() && recvs.empty(); }
};

inline std::string describe_send(DType dtype, std::uint64_t count, int tag, int peer,
                                 std::uint64_t message) {
  return fmt::format("send({} x {}, tag {}) to rank {} #{}", to_string(dtype), count, tag, peer,
                     message);
}

inline std::string describe_recv(DType dtype, std::uint64_t count, int tag, int peer,
                                 std::uint64_t number) {
  return fmt::format("recv({} x {}, tag {}) from rank {} #{}", to_string(dtype), count, tag, peer,
                     number);
}

inline std::string describe_recv_any(DType dtype, std::uint64_t count, int tag,
                                     std::uint64_t number) {
  return fmt::format("recv({} x {}, tag {}) from any rank #{}", to_string(dtype), count, tag,
                     number);
}

// What an eager message takes of the sender's credit: its payload and its frame, so that empty
// messages too are bounded in number while they wait for a receive.
inline std::size_t eager_cost(std::size_t bytes) {
  return bytes + kFrameBytes;
}

inline bool valid_dtype(std::uint8_t d) {
  return d <= static_cast<std::uint8_t>(DType::kInt64);
}

struct P2pEngine::State {
  EngineOptions options;
  std::vector<Peer> peers;
  P2pConnector* connector = nullptr;  // the engine's (it outlives every call into State)
  bool connected_to_all = false;      // a receive from any source asked for every connection
  std::mutex mutex;
  std::condition_variable idle_cv;
  int wake_fd = -1;
  bool stopping = false;
  std::exception_ptr poison;
  Clock::time_point next_check = Clock::time_point::max();
  std::vector<std::pair<std::shared_ptr<Work>, std::exception_ptr>> completions;
  std::vector<std::byte> discard = std::vector<std::byte>(std::size_t{64} << 10);
  // Receives from any source that no message has bound to a sender yet, in posting order.
  std::deque<std::shared_ptr<RecvOp>> any_posted;
  std::uint64_t next_any = 0;         // numbers receives from any source (for their names)
  std::uint64_t next_post_order = 0;  // RecvOp::order
  std::uint64_t next_arrival = 0;     // Unexpected::arrival

  ~State() {
    if (wake_fd >= 0) ::close(wake_fd);
  }

  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  bool all_idle() const {
    return any_posted.empty() &&
           std::all_of(peers.begin(), peers.end(), [](const Peer& p) { return p.idle(); });
  }

  // An operation completes once: a send rejected while its payload is still being written is not
  // completed again when the writing ends.
  // `op` by value: it may be the very entry the erase destroys.
  void finish_send(Peer& p, std::shared_ptr<SendOp> op, std::exception_ptr error) {
    if (p.sends.erase(op->header.message) != 0) completions.emplace_back(op->work, error);
  }

  void finish_recv(Peer& p, std::shared_ptr<RecvOp> op, std::exception_ptr error) {
    if (p.recvs.erase(op->number) != 0) completions.emplace_back(op->work, error);
  }

  // Completes the collected Works outside the lock (their callbacks may post new operations).
  void drain(std::unique_lock<std::mutex>& lock);
  int peer_index(const Peer& p) const { return static_cast<int>(&p - peers.data()); }

  std::exception_ptr comm_error(CommErrorKind kind, const std::string& message,
                                const std::string& op, std::uint64_t sequence, int peer) const {
    return std::make_exception_ptr(CommError(kind, message, options.group, op, sequence, peer));
  }

  // Fails the operations pending with `p`.
  void fail_pending(Peer& p, const std::exception_ptr& error);
  // Fails every operation with `p`, now and later, and stops using its connection (the peer sees
  // it close and fails too).
  void fail_peer(Peer& p, std::exception_ptr error);
  std::string first_pending(const Peer& p) const;
  // `named`: the operation to name, "" for the first pending one.
  std::exception_ptr closed_error(const Peer& p, const std::string& detail,
                                  const std::string& named = "") const;
  // The stream from `p` ended (EOF, or a reset after the last complete frame): mid-frame or with
  // operations pending, that is their failure. Complete messages already here can still be
  // received.
  void on_closed(Peer& p, const std::string& detail);
  // Writing to `p` failed because it closed its end (EPIPE, ECONNRESET): fails the sends (they
  // need the peer to read) and writes nothing more, but keeps reading, so that the messages it
  // sent before it closed still reach their receives; the end of the stream (on_closed) fails
  // the receives they do not satisfy.
  void on_write_broken(Peer& p, const std::string& detail);
  void fail_protocol(Peer& p, const std::string& what);
  void queue_frame(Peer& p, const P2pFrame& frame) { p.out.push_back(OutItem{frame}); }
  // An operation with `p` was posted: asks the connector for the connection (once).
  void need_connection(Peer& p);
  // A receive from any source was posted: asks for every connection (once). It may match a
  // message from any peer, and only a connection shows that a peer has left (which fails it
  // before its deadline when every peer has).
  void need_every_connection();
  // Why an operation with `p`, which is not connected, is still waiting (for a timeout's message).
  std::string unconnected_reason(const Peer& p) const;

  // An eager message of `message_bytes` was delivered (or dropped): its cost is free again.
  void return_credit(Peer& p, std::size_t message_bytes);
  // `op` met message `m` with another count or dtype: fails it here and tells the sender.
  void reject(Peer& p, const P2pFrame& m, const std::shared_ptr<RecvOp>& op);
  // Message `m` of ours met receive `r` of the peer with another count or dtype.
  void on_reject(Peer& p, const P2pFrame& r, const P2pFrame& m);
  bool agrees(const P2pFrame& m, const RecvOp& op) const {
    return m.count == op.count && m.dtype == static_cast<std::uint8_t>(op.dtype);
  }

  void ask_for_payload(Peer& p, const P2pFrame& m, const std::shared_ptr<RecvOp>& op);
  // A receive posted (user thread): takes the earliest unexpected message with its tag, if any.
  void match_posted(Peer& p, const std::shared_ptr<RecvOp>& op);
  // The earliest message from `p` with `tag` that no receive took, or p.unexpected.end().
  std::list<Unexpected>::iterator find_unexpected(Peer& p, int tag);
  // `op` (bound to `p`) takes the unexpected message `it`.
  void take_unexpected(Peer& p, std::list<Unexpected>::iterator it,
                       const std::shared_ptr<RecvOp>& op);
  // A receive from any source posted (user thread): takes the earliest message with its tag that
  // arrived from any peer and no receive took, else waits in any_posted.
  void match_posted_any(const std::shared_ptr<RecvOp>& op);
  // Makes `op`, a receive from any source, a receive from `p` (a message of `p` chose it).
  void bind_any(Peer& p, const std::shared_ptr<RecvOp>& op);
  // Whether some peer may still send to this rank (not failed, not closed).
  bool any_peer_left() const;
  // Fails the unbound receives from any source with `error` when no peer is left to send.
  void fail_any_if_no_peer_left(const std::exception_ptr& error);
  // The payload of the frame being read is all here.
  void payload_done(Peer& p);
  void start_payload(Peer& p, std::byte* dst, std::size_t bytes, bool eager);
  // A frame header was read (progress thread).
  void on_frame(Peer& p);
  // Reads what `p` has for us, up to kReadBudget bytes (progress thread).
  void read_from(Peer& p);
  // Writes what is queued for `p` until the socket would block.
  void write_to(Peer& p);
  // Fails the channels whose operations passed their deadline; returns the next deadline.
  void check_deadlines();
  std::exception_ptr timeout_error(const Peer& p, const SendOp& op) const;
  // The messages from `p` that arrived and that no receive took, e.g. "send(float32 x 4, tag 1)
  // to rank 0 #3", or "" (for errors of receives that wait for another tag).
  std::string unmatched(const Peer& p) const;
  std::exception_ptr timeout_error(const Peer& p, const RecvOp& op) const;
  std::exception_ptr any_timeout_error(const RecvOp& op) const;
  void note_deadline(Clock::time_point deadline);
  // One attempt to move `peer`'s bytes on the calling thread (a waiter, see P2pWork); gives way
  // when the progress thread or a poster holds the lock.
  void help(int peer);
  std::shared_ptr<Work> make_work(std::string description, milliseconds timeout, int peer,
                                  const std::shared_ptr<State>& self);
  void run();
};

}  // namespace ddp::comm::p2p
