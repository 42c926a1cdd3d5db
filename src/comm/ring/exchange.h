// Exchange: moves the bytes of one step of an algorithm over several connections at once
// (internal to the ring backend).
//
// An algorithm describes its step as streams: a send stream is a header plus a list of pieces
// (memory ranges) to write to one peer; a recv stream is a header to check plus pieces to fill
// from one peer, either by copying bytes straight into place or by receiving them into a small
// scratch chunk and reducing them into place (dst = a op incoming). A send piece may be "gated"
// by a recv piece: only the bytes of it that have been received/reduced so far are sent. That is
// how the ring pipelines: what arrives from the previous rank is reduced chunk by chunk and
// forwarded to the next while the rest is still on the wire, in both directions at once.
//
// run() drives every stream with non-blocking sendmsg/recvmsg, spinning briefly and then
// sleeping in poll() when nothing moves, until all are done or the deadline passes. It throws
// CommError (PeerClosedError when a connection closed or reset) naming the group, the operation,
// its sequence number and the peer. One thread at a time; reuse one Exchange per group so the
// piece vectors keep their capacity (no allocation on the hot path).
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "comm/wire.h"
#include "ddp/comm/comm_error.h"
#include "net/socket.h"

namespace ddp::comm {

// A connection closed or was reset by the peer (the group adds the peer's reason, if it left one).
class PeerClosedError : public CommError {
 public:
  PeerClosedError(const std::string& message, std::string group, std::string op,
                  std::uint64_t sequence, int peer)
      : CommError(CommErrorKind::kPeerGone, message, std::move(group), std::move(op), sequence,
                  peer) {}
};

// What the error messages need to know about the operation in progress.
struct ExchangeContext {
  const std::string* group = nullptr;
  int rank = 0;
  std::string_view op;  // describe(header) of this rank's call
  // Socket of every rank of the group (-1 for this rank): while a collective sleeps, the engine
  // peeks at connections it is not reading from, so that a peer that issued a different call
  // with the same sequence number (e.g. another root) is reported instead of awaited.
  const int* peer_fds = nullptr;
  int size = 0;
  // Called at least every 10 ms while the step sleeps (null: never); may throw CommError. The
  // ring backend uses it to notice a peer that runs a different call over shared memory.
  const std::function<void()>* idle_check = nullptr;
  // A step still waiting this long after its operation started logs one warning naming what it
  // waits for (0: never); `warn` gets the line (null: stderr).
  std::chrono::milliseconds wait_warning{0};
  const std::function<void(const std::string&)>* warn = nullptr;
};

class Exchange {
 public:
  // Starts a new step: forgets the streams of the previous one. `header` is sent on every send
  // stream and expected on every recv stream.
  void reset(const OpHeader& header, DType dtype, const ExchangeContext& context);

  // Streams. Pieces belong to the stream added last of their direction.
  void add_send_stream(int peer, int fd);
  void add_send_piece(const void* data, std::size_t len, int gate = -1);
  void add_recv_stream(int peer, int fd, std::byte* scratch = nullptr,
                       std::size_t scratch_bytes = 0);
  // Returns the piece's index, usable as a gate.
  int add_recv_copy(void* dst, std::size_t len);
  int add_recv_reduce(void* dst, const void* a, std::size_t len, ReduceOp op, int avg_divisor);

  // Runs until every stream is done. `spin`: busy-poll this long before sleeping in poll().
  void run(net::Deadline deadline, std::chrono::microseconds spin,
           std::chrono::milliseconds timeout_for_message);

 private:
  struct SendPiece {
    const std::byte* data;
    std::size_t len;
    int gate;
  };
  struct RecvPiece {
    std::byte* dst;
    const std::byte* a;  // reduce: the local operand; null: copy
    std::size_t len;
    std::size_t processed;  // bytes final in dst (gates read this)
    ReduceOp op;
    int avg_divisor;
  };
  struct SendStream {
    int peer;
    int fd;
    std::size_t header_done;
    std::size_t first, last, cur;
    std::size_t offset;  // bytes of pieces[cur] sent
    bool want_write;
  };
  struct RecvStream {
    int peer;
    int fd;
    std::byte* scratch;
    std::size_t scratch_bytes;
    OpHeader expected;
    OpHeader got;
    std::size_t header_done;
    std::size_t first, last, cur;
    std::size_t pending;  // reduce: bytes in scratch not yet reduced (a partial element)
  };

  bool try_send(SendStream& s);
  bool try_recv(RecvStream& s);
  void check_header(const RecvStream& s) const;
  [[noreturn]] void fail_mismatch(int peer, const OpHeader& expected, const OpHeader& got) const;
  void peek_idle_peer(int peer);
  [[noreturn]] void fail_io(int peer, int err, const char* what) const;
  [[noreturn]] void fail_timeout(std::chrono::milliseconds timeout) const;
  // "data from rank 1 (0 of 1024 bytes), ..."; `peer`: the first rank named.
  std::string waiting_for(int& peer) const;
  void warn_waiting(std::chrono::milliseconds waited, std::chrono::milliseconds left);
  bool done() const { return streams_done_ == send_streams_.size() + recv_streams_.size(); }

  OpHeader header_{};
  DType dtype_ = DType::kFloat32;
  std::size_t element_size_ = 4;
  ExchangeContext context_;
  std::uint64_t warned_for_ = 0;  // 1 + the sequence number of the operation last warned about
  std::vector<SendPiece> send_pieces_;
  std::vector<RecvPiece> recv_pieces_;
  std::vector<SendStream> send_streams_;
  std::vector<RecvStream> recv_streams_;
  std::size_t streams_done_ = 0;
  std::vector<pollfd> pollfds_;
  std::vector<int> polled_idle_peers_;
  std::vector<char> idle_peer_done_;  // per rank: peeked (or read from) in this step
};

}  // namespace ddp::comm
