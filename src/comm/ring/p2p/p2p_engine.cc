#include "comm/ring/p2p/p2p_engine.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <limits>
#include <list>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "comm/argument_checks.h"
#include "comm/ring/p2p/p2p_frame.h"
#include "ddp/comm_error.h"
#include "ddp/error.h"

namespace ddp::comm::p2p {
namespace {

using Clock = net::Clock;
using std::chrono::milliseconds;

constexpr std::size_t kFrameBytes = sizeof(P2pFrame);
constexpr int kMaxIov = 64;
// Bytes read from one peer before the loop turns to the others (fairness, lock hold time).
constexpr std::size_t kReadBudget = std::size_t{8} << 20;
// How long the destructor lets the kernel deliver what was written before closing.
constexpr auto kCloseLinger = std::chrono::seconds(2);

std::string error_text(int err) {
  char buf[256];
  return std::string(strerror_r(err, buf, sizeof buf));
}

// A Work whose wait() first drives its connection on the waiting thread for a moment.
class P2pWork final : public Work {
 public:
  P2pWork(std::string description, milliseconds timeout, std::chrono::microseconds spin,
          std::function<void()> help)
      : Work(std::move(description), timeout), spin_(spin), help_(std::move(help)) {}

 protected:
  void help_until_completed() override {
    if (spin_.count() <= 0) return;
    const auto until = Clock::now() + spin_;
    while (!is_completed() && Clock::now() < until) {
      help_();
      if (!is_completed()) std::this_thread::yield();
    }
  }

 private:
  std::chrono::microseconds spin_;
  std::function<void()> help_;
};

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
  int peer = 0;
  std::uint64_t number = 0;
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
};

struct Peer {
  int fd = -1;
  net::Socket socket;
  std::exception_ptr failed;  // set once: every operation with this peer fails with it
  bool closed = false;        // the peer closed cleanly (its messages already here still match)

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

std::string describe_send(DType dtype, std::uint64_t count, int tag, int peer,
                          std::uint64_t message) {
  return fmt::format("send({} x {}, tag {}) to rank {} #{}", to_string(dtype), count, tag, peer,
                     message);
}

std::string describe_recv(DType dtype, std::uint64_t count, int tag, int peer,
                          std::uint64_t number) {
  return fmt::format("recv({} x {}, tag {}) from rank {} #{}", to_string(dtype), count, tag, peer,
                     number);
}

// What an eager message takes of the sender's credit: its payload and its frame, so that empty
// messages too are bounded in number while they wait for a receive.
std::size_t eager_cost(std::size_t bytes) {
  return bytes + kFrameBytes;
}

bool valid_dtype(std::uint8_t d) {
  return d <= static_cast<std::uint8_t>(DType::kInt64);
}

}  // namespace

struct P2pEngine::State {
  EngineOptions options;
  std::vector<Peer> peers;
  std::mutex mutex;
  std::condition_variable idle_cv;
  int wake_fd = -1;
  bool stopping = false;
  std::exception_ptr poison;
  Clock::time_point next_check = Clock::time_point::max();
  std::vector<std::pair<std::shared_ptr<Work>, std::exception_ptr>> completions;
  std::vector<std::byte> discard = std::vector<std::byte>(std::size_t{64} << 10);

  ~State() {
    if (wake_fd >= 0) ::close(wake_fd);
  }

  // ---- helpers, all with `mutex` held ----

  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  bool all_idle() const {
    return std::all_of(peers.begin(), peers.end(), [](const Peer& p) { return p.idle(); });
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
  void drain(std::unique_lock<std::mutex>& lock) {
    while (!completions.empty()) {
      auto done = std::move(completions);
      completions.clear();
      lock.unlock();
      for (auto& [work, error] : done)
        work->complete(error);
      done.clear();  // drop the references outside the lock too
      lock.lock();
    }
    if (all_idle()) idle_cv.notify_all();
  }

  int peer_index(const Peer& p) const { return static_cast<int>(&p - peers.data()); }

  std::exception_ptr comm_error(const std::string& message, const std::string& op,
                                std::uint64_t sequence, int peer) const {
    return std::make_exception_ptr(CommError(message, options.group, op, sequence, peer));
  }

  // Fails the operations pending with `p`.
  void fail_pending(Peer& p, const std::exception_ptr& error) {
    for (auto& [number, op] : p.sends)
      completions.emplace_back(op->work, error);
    for (auto& [number, op] : p.recvs)
      completions.emplace_back(op->work, error);
    p.sends.clear();
    p.recvs.clear();
    p.posted.clear();
    p.awaiting_data.clear();
    p.out.clear();
    p.in_recv.reset();
    p.in_left = 0;
  }

  // Fails every operation with `p`, now and later, and stops using its connection (the peer sees
  // it close and fails too).
  void fail_peer(Peer& p, std::exception_ptr error) {
    if (p.failed) return;
    p.failed = error;
    fail_pending(p, error);
    p.unexpected.clear();
    if (p.fd >= 0) ::shutdown(p.fd, SHUT_RDWR);
  }

  std::string first_pending(const Peer& p) const {
    if (!p.recvs.empty()) {
      const auto& r = *p.recvs.begin()->second;
      return describe_recv(r.dtype, r.count, r.tag, r.peer, r.number);
    }
    if (!p.sends.empty()) return p.sends.begin()->second->work->description();
    return "point-to-point";
  }

  std::exception_ptr closed_error(const Peer& p, const std::string& detail) const {
    const int peer = peer_index(p);
    const std::string reason = options.reason_of ? options.reason_of(peer) : std::string();
    const std::string op = first_pending(p);
    const std::string others = p.recvs.empty() ? std::string() : unmatched(p);
    return comm_error(
        fmt::format("rank {}: rank {} closed the point-to-point connection of group '{}'{} during "
                    "{}{}{}",
                    options.rank, peer, options.group, detail, op,
                    reason.empty() ? fmt::format(" (rank {} left no reason: it died, failed, timed "
                                                 "out or destroyed its group)",
                                                 peer)
                                   : fmt::format("; rank {} reported: {}", peer, reason),
                    others.empty() ? std::string()
                                   : fmt::format("; rank {} had sent {}, which no receive took (a "
                                                 "different tag?)",
                                                 peer, others)),
        op, 0, peer);
  }

  // The connection to `p` closed or broke: mid-frame or with operations pending, that is their
  // failure. Complete messages already here can still be received.
  void on_closed(Peer& p, const std::string& detail) {
    if (p.in_header_done != 0 || p.in_left != 0 || !detail.empty()) {
      return fail_peer(p, closed_error(p, detail));
    }
    p.closed = true;
    if (!p.idle()) fail_pending(p, closed_error(p, detail));
    for (auto it = p.unexpected.begin(); it != p.unexpected.end();) {
      it = it->complete && it->header.type == FrameType::kEager ? std::next(it)
                                                                : p.unexpected.erase(it);
    }
  }

  void fail_protocol(Peer& p, const std::string& what) {
    const int peer = peer_index(p);
    fail_peer(p, comm_error(fmt::format("rank {}: rank {} sent a malformed point-to-point frame in "
                                        "group '{}' ({}); is it running the same ddp version?",
                                        options.rank, peer, options.group, what),
                            "point-to-point", 0, peer));
  }

  void queue_frame(Peer& p, const P2pFrame& frame) { p.out.push_back(OutItem{frame}); }

  // An eager message of `message_bytes` was delivered (or dropped): its cost is free again.
  void return_credit(Peer& p, std::size_t message_bytes) {
    const std::size_t bytes = eager_cost(message_bytes);
    if (p.failed || p.closed) return;
    if (!p.out.empty() && p.out.back().header.type == FrameType::kCredit &&
        p.out.back().done == 0) {
      p.out.back().header.count += bytes;
      return;
    }
    P2pFrame f;
    f.type = FrameType::kCredit;
    f.count = bytes;
    queue_frame(p, f);
  }

  // `op` met message `m` with another count or dtype: fails it here and tells the sender.
  void reject(Peer& p, const P2pFrame& m, const std::shared_ptr<RecvOp>& op) {
    const int peer = peer_index(p);
    const std::string mine = describe_recv(op->dtype, op->count, op->tag, peer, op->number);
    const std::string theirs =
        describe_send(static_cast<DType>(m.dtype), m.count, m.tag, options.rank, m.message);
    finish_recv(
        p, op,
        comm_error(fmt::format("point-to-point mismatch in group '{}': rank {} called {} but rank "
                               "{} sent {}; a send and the receive it matches (same peer and tag, "
                               "in posting order) must agree on count and dtype",
                               options.group, options.rank, mine, peer, theirs),
                   mine, op->number, peer));
    P2pFrame f;
    f.type = FrameType::kReject;
    f.dtype = static_cast<std::uint8_t>(op->dtype);
    f.tag = op->tag;
    f.aux = static_cast<std::uint32_t>(op->number);
    f.message = m.message;
    f.count = op->count;
    queue_frame(p, f);
    // Deque elements stay where they are while others come and go: the payload may point inside.
    OutItem& item = p.out.back();
    item.own_payload = m;
    item.payload = reinterpret_cast<const std::byte*>(&item.own_payload);
    item.bytes = kFrameBytes;
  }

  // Message `m` of ours met receive `r` of the peer with another count or dtype.
  void on_reject(Peer& p, const P2pFrame& r, const P2pFrame& m) {
    const int peer = peer_index(p);
    auto it = p.sends.find(r.message);
    const auto describe = [](const P2pFrame& f, bool as_send, int rank, std::uint64_t number) {
      if (!valid_dtype(f.dtype)) return std::string(as_send ? "a send" : "a receive");
      return as_send ? describe_send(static_cast<DType>(f.dtype), f.count, f.tag, rank, number)
                     : describe_recv(static_cast<DType>(f.dtype), f.count, f.tag, rank, number);
    };
    const std::string mine =
        it != p.sends.end() ? it->second->work->description() : describe(m, true, peer, r.message);
    const std::string theirs = describe(r, false, options.rank, r.aux);
    auto error = comm_error(
        fmt::format("point-to-point mismatch in group '{}': rank {} called {} but rank {} "
                    "received it with {}; a send and the receive it matches (same peer and tag, "
                    "in posting order) must agree on count and dtype",
                    options.group, options.rank, mine, peer, theirs),
        mine, r.message, peer);
    if (it != p.sends.end()) {
      finish_send(p, it->second, error);
    } else {
      // A small send completed before the receiver saw it: the operations with this peer, pending
      // and later, report it.
      fail_peer(p, error);
    }
  }

  bool agrees(const P2pFrame& m, const RecvOp& op) const {
    return m.count == op.count && m.dtype == static_cast<std::uint8_t>(op.dtype);
  }

  void ask_for_payload(Peer& p, const P2pFrame& m, const std::shared_ptr<RecvOp>& op) {
    p.awaiting_data[m.message] = op;
    P2pFrame f = m;
    f.type = FrameType::kClearToSend;
    queue_frame(p, f);
  }

  // A receive posted (user thread): takes the earliest unexpected message with its tag, if any.
  void match_posted(Peer& p, const std::shared_ptr<RecvOp>& op) {
    for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
      if (it->claimed || it->rejected || it->header.tag != op->tag) continue;
      const bool eager = it->header.type == FrameType::kEager;
      const std::size_t bytes = it->payload.size();
      if (!agrees(it->header, *op)) {
        reject(p, it->header, op);
        if (!eager) {
          p.unexpected.erase(it);
        } else if (it->complete) {
          return_credit(p, bytes);
          p.unexpected.erase(it);
        } else {
          it->rejected = true;
        }
        return;
      }
      if (!eager) {
        ask_for_payload(p, it->header, op);
        p.unexpected.erase(it);
      } else if (it->complete) {
        if (bytes > 0) std::memcpy(op->data, it->payload.data(), bytes);
        return_credit(p, bytes);
        p.unexpected.erase(it);
        finish_recv(p, op, nullptr);
      } else {
        it->claimed = op;
      }
      return;
    }
    if (p.closed) {
      const int peer = peer_index(p);
      finish_recv(
          p, op,
          comm_error(fmt::format("rank {}: {} in group '{}' cannot match: rank {} closed "
                                 "its point-to-point connection (it destroyed its group "
                                 "or exited) without sending it",
                                 options.rank, op->work->description(), options.group, peer),
                     op->work->description(), op->number, peer));
      return;
    }
    p.posted.push_back(op);
  }

  // The payload of the frame being read is all here.
  void payload_done(Peer& p) {
    if (p.in_reject) {
      p.in_reject = false;
      p.in_dst = nullptr;
      p.in_left = 0;
      return on_reject(p, p.in_reject_header, p.rejected_message);
    }
    if (p.in_recv) {
      finish_recv(p, p.in_recv, nullptr);
      p.in_recv.reset();
    }
    if (p.in_to_unexpected) {
      auto it = p.in_unexpected;
      it->complete = true;
      if (it->claimed) {
        if (!it->payload.empty()) {
          std::memcpy(it->claimed->data, it->payload.data(), it->payload.size());
        }
        finish_recv(p, it->claimed, nullptr);
        return_credit(p, it->payload.size());
        p.unexpected.erase(it);
      } else if (it->rejected) {
        return_credit(p, it->payload.size());
        p.unexpected.erase(it);
      }
    } else if (p.in_eager) {
      return_credit(p, p.in_bytes);
    }
    p.in_to_unexpected = false;
    p.in_eager = false;
    p.in_discard = false;
    p.in_dst = nullptr;
    p.in_left = 0;
  }

  void start_payload(Peer& p, std::byte* dst, std::size_t bytes, bool eager) {
    p.in_dst = dst;
    p.in_left = bytes;
    p.in_bytes = bytes;
    p.in_eager = eager;
    p.in_discard = dst == nullptr;
    if (bytes == 0) payload_done(p);
  }

  // A frame header was read (progress thread).
  void on_frame(Peer& p) {
    const P2pFrame m = p.in;
    if (m.magic != kFrameMagic) {
      return fail_protocol(p, fmt::format("magic {:#x}", m.magic));
    }
    switch (m.type) {
      case FrameType::kEager:
      case FrameType::kRequest: {
        if (!valid_dtype(m.dtype) || m.count > std::numeric_limits<std::size_t>::max() / 8) {
          return fail_protocol(p, fmt::format("dtype {} count {}", m.dtype, m.count));
        }
        const bool eager = m.type == FrameType::kEager;
        const std::size_t bytes = m.count * dtype_size(static_cast<DType>(m.dtype));
        if (eager && bytes > kEagerMaxBytes) {
          return fail_protocol(p, fmt::format("eager message of {} bytes", bytes));
        }
        auto it = std::find_if(p.posted.begin(), p.posted.end(),
                               [&](const auto& op) { return op->tag == m.tag; });
        if (it != p.posted.end()) {
          auto op = *it;
          p.posted.erase(it);
          if (!agrees(m, *op)) {
            reject(p, m, op);
            if (eager) start_payload(p, nullptr, bytes, true);
          } else if (eager) {
            p.in_recv = op;
            start_payload(p, op->data, bytes, true);
          } else {
            ask_for_payload(p, m, op);
          }
          return;
        }
        p.unexpected.push_back(Unexpected{m, {}, !eager, nullptr, false});
        if (eager) {
          auto last = std::prev(p.unexpected.end());
          last->payload.resize(bytes);
          p.in_to_unexpected = true;
          p.in_unexpected = last;
          start_payload(p, last->payload.data(), bytes, true);
        }
        return;
      }
      case FrameType::kClearToSend: {
        auto it = p.sends.find(m.message);
        if (it == p.sends.end() || it->second->cleared ||
            it->second->header.type != FrameType::kRequest) {
          return fail_protocol(p, fmt::format("clear-to-send for unknown message {}", m.message));
        }
        it->second->cleared = true;
        OutItem item{it->second->header, it->second->data, it->second->bytes, 0, it->second};
        item.header.type = FrameType::kData;
        p.out.push_back(std::move(item));
        return;
      }
      case FrameType::kData: {
        auto it = p.awaiting_data.find(m.message);
        if (it == p.awaiting_data.end() || !agrees(m, *it->second)) {
          return fail_protocol(p, fmt::format("data of unknown message {}", m.message));
        }
        auto op = it->second;
        p.awaiting_data.erase(it);
        p.in_recv = op;
        start_payload(p, op->data, op->bytes(), false);
        return;
      }
      case FrameType::kCredit:
        p.credit += m.count;
        return;
      case FrameType::kReject:
        p.in_reject = true;
        p.in_reject_header = m;
        return start_payload(p, reinterpret_cast<std::byte*>(&p.rejected_message), kFrameBytes,
                             false);
    }
    fail_protocol(p, fmt::format("frame type {}", static_cast<int>(m.type)));
  }

  // Reads what `p` has for us, up to kReadBudget bytes (progress thread).
  void read_from(Peer& p) {
    std::size_t budget = kReadBudget;
    while (!p.failed && !p.closed && budget > 0) {
      ssize_t n;
      if (p.in_left > 0) {
        std::byte* dst = p.in_discard ? discard.data() : p.in_dst;
        const std::size_t len = p.in_discard ? std::min(p.in_left, discard.size()) : p.in_left;
        n = ::recv(p.fd, dst, len, MSG_DONTWAIT);
        if (n > 0) {
          if (!p.in_discard) p.in_dst += n;
          p.in_left -= static_cast<std::size_t>(n);
          budget -= std::min(budget, static_cast<std::size_t>(n));
          if (p.in_left == 0) payload_done(p);
          continue;
        }
      } else {
        auto* dst = reinterpret_cast<std::byte*>(&p.in) + p.in_header_done;
        n = ::recv(p.fd, dst, kFrameBytes - p.in_header_done, MSG_DONTWAIT);
        if (n > 0) {
          p.in_header_done += static_cast<std::size_t>(n);
          if (p.in_header_done == kFrameBytes) {
            p.in_header_done = 0;
            on_frame(p);
          }
          continue;
        }
      }
      if (n == 0) return on_closed(p, "");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return on_closed(p, fmt::format(" ({})", error_text(errno)));
    }
  }

  // Writes what is queued for `p` until the socket would block.
  void write_to(Peer& p) {
    if (p.closed) {
      p.out.clear();  // only control frames can be left for a peer that has gone
      return;
    }
    while (!p.out.empty() && !p.failed) {
      iovec iov[kMaxIov];
      int n_iov = 0;
      for (auto it = p.out.begin(); it != p.out.end() && n_iov + 2 <= kMaxIov; ++it) {
        if (it->done < kFrameBytes) {
          iov[n_iov++] = {reinterpret_cast<char*>(&it->header) + it->done, kFrameBytes - it->done};
        }
        const std::size_t off = it->done > kFrameBytes ? it->done - kFrameBytes : 0;
        if (it->bytes > off) {
          iov[n_iov++] = {const_cast<std::byte*>(it->payload) + off, it->bytes - off};
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(n_iov);
      const ssize_t n = ::sendmsg(p.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        return on_closed(p, fmt::format(" ({})", error_text(errno)));
      }
      auto left = static_cast<std::size_t>(n);
      while (left > 0 && !p.out.empty()) {
        OutItem& item = p.out.front();
        const std::size_t take = std::min(left, kFrameBytes + item.bytes - item.done);
        item.done += take;
        left -= take;
        if (item.done == kFrameBytes + item.bytes) {
          auto op = std::move(item.completes);
          p.out.pop_front();
          if (op) finish_send(p, op, nullptr);
        }
      }
    }
  }

  // Fails the channels whose operations passed their deadline; returns the next deadline.
  void check_deadlines() {
    const auto now = Clock::now();
    Clock::time_point next = Clock::time_point::max();
    for (auto& p : peers) {
      std::exception_ptr timed_out;
      for (auto& [number, op] : p.sends) {
        if (op->deadline <= now) {
          timed_out = timeout_error(p, *op);
          break;
        }
        next = std::min(next, op->deadline);
      }
      for (auto& [number, op] : p.recvs) {
        if (timed_out) break;
        if (op->deadline <= now) {
          timed_out = timeout_error(p, *op);
          break;
        }
        next = std::min(next, op->deadline);
      }
      if (timed_out) fail_peer(p, timed_out);
    }
    next_check = next;
  }

  std::exception_ptr timeout_error(const Peer& p, const SendOp& op) const {
    const int peer = peer_index(p);
    const std::string what = op.header.type == FrameType::kRequest && !op.cleared
                                 ? fmt::format(
                                       "rank {} posted no matching receive (same tag, in "
                                       "posting order)",
                                       peer)
                                 : fmt::format("rank {} did not read it", peer);
    const std::string desc = op.work->description();
    return comm_error(fmt::format("rank {} timed out after {} ms in {} in group '{}': {}",
                                  options.rank, op.timeout.count(), desc, options.group, what),
                      desc, op.header.message, peer);
  }

  // The messages from `p` that arrived and that no receive took, e.g. "send(float32 x 4, tag 1)
  // to rank 0 #3", or "" (for errors of receives that wait for another tag).
  std::string unmatched(const Peer& p) const {
    std::string others;
    for (const auto& u : p.unexpected) {
      if (u.claimed || u.rejected) continue;
      if (others.size() > 400) {
        others += ", …";
        break;
      }
      others += fmt::format("{}{}", others.empty() ? "" : ", ",
                            describe_send(static_cast<DType>(u.header.dtype), u.header.count,
                                          u.header.tag, options.rank, u.header.message));
    }
    return others;
  }

  std::exception_ptr timeout_error(const Peer& p, const RecvOp& op) const {
    const int peer = peer_index(p);
    const std::string others = unmatched(p);
    const std::string desc = op.work->description();
    const std::string what =
        others.empty() ? fmt::format("rank {} sent no message with tag {} for it", peer, op.tag)
                       : fmt::format(
                             "rank {} sent no message with tag {} for it, but sent {}, which no "
                             "receive took (a different tag?)",
                             peer, op.tag, others);
    return comm_error(fmt::format("rank {} timed out after {} ms in {} in group '{}': {}",
                                  options.rank, op.timeout.count(), desc, options.group, what),
                      desc, op.number, peer);
  }

  void note_deadline(Clock::time_point deadline) {
    if (deadline < next_check) {
      next_check = deadline;
      wake();
    }
  }

  // One attempt to move `peer`'s bytes on the calling thread (a waiter, see P2pWork); gives way
  // when the progress thread or a poster holds the lock.
  void help(int peer) {
    std::unique_lock lock(mutex, std::try_to_lock);
    if (!lock.owns_lock() || stopping) return;
    Peer& p = peers[static_cast<std::size_t>(peer)];
    if (p.fd < 0 || p.failed || p.closed) return;
    if (!p.out.empty()) write_to(p);
    read_from(p);
    if (!p.out.empty()) write_to(p);  // e.g. a rejection, before its receive fails
    if (!p.out.empty()) wake();       // what it could not write is the progress thread's
    drain(lock);
  }

  std::shared_ptr<Work> make_work(std::string description, milliseconds timeout, int peer,
                                  const std::shared_ptr<State>& self) {
    std::weak_ptr<State> weak = self;
    return std::make_shared<P2pWork>(std::move(description), timeout, options.spin, [weak, peer] {
      if (auto s = weak.lock()) s->help(peer);
    });
  }

  // ---- the progress thread ----

  void run() {
    std::unique_lock lock(mutex);
    std::vector<pollfd> fds;
    std::vector<int> who;
    while (!stopping) {
      for (auto& p : peers) {
        if (p.fd >= 0 && !p.failed && !p.out.empty()) write_to(p);
      }
      if (Clock::now() >= next_check) check_deadlines();
      drain(lock);
      if (stopping) break;
      fds.clear();
      who.clear();
      fds.push_back({wake_fd, POLLIN, 0});
      who.push_back(-1);
      for (auto& p : peers) {
        if (p.fd < 0 || p.failed || p.closed) continue;
        fds.push_back({p.fd, static_cast<short>(POLLIN | (p.out.empty() ? 0 : POLLOUT)), 0});
        who.push_back(peer_index(p));
      }
      const auto now = Clock::now();
      int timeout_ms = 1000;
      if (next_check != Clock::time_point::max()) {
        const auto left =
            std::chrono::duration_cast<milliseconds>(next_check - now) + milliseconds(1);
        timeout_ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1000));
      }
      lock.unlock();
      const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
      lock.lock();
      if (ready <= 0) continue;
      if (fds[0].revents & POLLIN) {
        std::uint64_t value;
        [[maybe_unused]] const ssize_t n = ::read(wake_fd, &value, sizeof value);
      }
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        Peer& p = peers[static_cast<std::size_t>(who[i])];
        if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_from(p);
        if ((fds[i].revents & POLLOUT) && !p.failed) write_to(p);
      }
    }
    // Control frames still queued (a rejection, credit) go out before the connections close:
    // they are small, the sockets take them.
    for (auto& p : peers) {
      if (p.fd >= 0 && !p.failed && !p.out.empty()) write_to(p);
    }
    // Stopped with operations pending (only when the group was dropped from a callback on this
    // thread): they fail rather than never complete.
    if (!all_idle()) {
      const auto error =
          comm_error(fmt::format("rank {}: group '{}' was destroyed with this operation pending",
                                 options.rank, options.group),
                     "point-to-point", 0, -1);
      for (auto& p : peers)
        fail_pending(p, error);
      drain(lock);
    }
  }
};

P2pEngine::P2pEngine(std::vector<net::Socket> peers, EngineOptions options)
    : state_(std::make_shared<State>()) {
  state_->options = std::move(options);
  state_->peers.resize(peers.size());
  for (std::size_t i = 0; i < peers.size(); ++i) {
    state_->peers[i].fd = peers[i].valid() ? peers[i].fd() : -1;
    state_->peers[i].socket = std::move(peers[i]);
  }
  state_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (state_->wake_fd < 0) {
    throw Error(fmt::format("eventfd failed for the point-to-point engine of group '{}': {}",
                            state_->options.group, error_text(errno)));
  }
  thread_ = std::thread([s = state_] { s->run(); });
}

P2pEngine::~P2pEngine() {
  State& s = *state_;
  if (thread_.get_id() == std::this_thread::get_id()) {
    // Dropped from a Work callback on the progress thread: it cannot wait for itself. It stops
    // after the callback returns, and the state (and the connections) go with its reference.
    std::lock_guard lock(s.mutex);
    s.stopping = true;
    thread_.detach();
    return;
  }
  {
    // Every operation has a deadline, so this wait is bounded.
    std::unique_lock lock(s.mutex);
    s.idle_cv.wait(lock, [&] { return s.all_idle(); });
    s.stopping = true;
    s.wake();
  }
  thread_.join();
  // Let the kernel deliver what was written (a close with unread input would reset the
  // connection and could drop it), then close.
  for (auto& p : s.peers) {
    if (p.fd >= 0) ::shutdown(p.fd, SHUT_WR);
  }
  const auto until = Clock::now() + kCloseLinger;
  for (auto& p : s.peers) {
    if (p.fd < 0 || p.failed) continue;
    for (;;) {
      while (::recv(p.fd, s.discard.data(), s.discard.size(), MSG_DONTWAIT) > 0) {
      }
      int unsent = 0;
      if (::ioctl(p.fd, SIOCOUTQ, &unsent) != 0 || unsent == 0 || Clock::now() >= until) break;
      ::usleep(1000);
    }
  }
}

std::shared_ptr<Work> P2pEngine::send(const void* buf, std::size_t count, DType dtype, int dst,
                                      int tag, CallOptions options) {
  check_enums("send", dtype, std::nullopt);
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  State& s = *state_;
  auto op = std::make_shared<SendOp>();
  op->timeout = options.timeout.count() > 0 ? options.timeout : s.options.timeout;
  op->deadline = net::deadline_after(op->timeout);
  op->data = static_cast<const std::byte*>(buf);
  op->bytes = count * dtype_size(dtype);
  op->peer = dst;
  std::unique_lock lock(s.mutex);
  Peer& p = s.peers[static_cast<std::size_t>(dst)];
  op->header.dtype = static_cast<std::uint8_t>(dtype);
  op->header.tag = tag;
  op->header.count = count;
  op->header.message = p.next_message++;
  op->work = s.make_work(describe_send(dtype, count, tag, dst, op->header.message), op->timeout,
                         dst, state_);
  auto work = op->work;
  std::exception_ptr error = s.poison ? s.poison : p.failed;
  if (!error && p.closed) {
    error = s.comm_error(fmt::format("rank {}: {} in group '{}': rank {} closed its "
                                     "point-to-point connection (it destroyed its group or "
                                     "exited)",
                                     s.options.rank, work->description(), s.options.group, dst),
                         work->description(), op->header.message, dst);
  }
  if (error) {
    lock.unlock();
    work->complete(error);
    return work;
  }
  p.sends[op->header.message] = op;
  if (op->bytes <= kEagerMaxBytes && eager_cost(op->bytes) <= p.credit) {
    p.credit -= eager_cost(op->bytes);
    op->header.type = FrameType::kEager;
    p.out.push_back(OutItem{op->header, op->data, op->bytes, 0, op});
  } else {
    op->header.type = FrameType::kRequest;
    p.out.push_back(OutItem{op->header, nullptr, 0, 0, nullptr});
  }
  // Write at once when the connection is free: no hand-off to the progress thread.
  if (p.out.size() == 1) s.write_to(p);
  if (!p.out.empty()) s.wake();
  s.note_deadline(op->deadline);
  s.drain(lock);
  return work;
}

std::shared_ptr<Work> P2pEngine::recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                                      CallOptions options) {
  check_enums("recv", dtype, std::nullopt);
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("CallOptions::timeout is negative ({} ms)", options.timeout.count()));
  }
  State& s = *state_;
  auto op = std::make_shared<RecvOp>();
  op->timeout = options.timeout.count() > 0 ? options.timeout : s.options.timeout;
  op->deadline = net::deadline_after(op->timeout);
  op->data = static_cast<std::byte*>(buf);
  op->count = count;
  op->dtype = dtype;
  op->tag = tag;
  op->peer = src;
  std::unique_lock lock(s.mutex);
  Peer& p = s.peers[static_cast<std::size_t>(src)];
  op->number = p.next_recv++;
  op->work =
      s.make_work(describe_recv(dtype, count, tag, src, op->number), op->timeout, src, state_);
  auto work = op->work;
  if (std::exception_ptr error = s.poison ? s.poison : p.failed) {
    lock.unlock();
    work->complete(error);
    return work;
  }
  p.recvs[op->number] = op;
  s.match_posted(p, op);
  if (!p.out.empty()) {
    if (p.out.size() == 1) s.write_to(p);
    if (!p.out.empty()) s.wake();
  }
  if (p.recvs.count(op->number) != 0) s.note_deadline(op->deadline);
  s.drain(lock);
  return work;
}

void P2pEngine::abort(std::exception_ptr error) {
  State& s = *state_;
  std::unique_lock lock(s.mutex);
  if (!s.poison) s.poison = error;
  for (auto& p : s.peers)
    s.fail_peer(p, s.poison);
  s.wake();
  s.drain(lock);
}

}  // namespace ddp::comm::p2p
