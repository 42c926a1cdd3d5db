// P2pEngine: matching messages to receives, eager credit and rejections (see p2p_state.h).
#include "comm/ring/p2p/p2p_state.h"

namespace ddp::comm::p2p {

void P2pEngine::State::return_credit(Peer& p, std::size_t message_bytes) {
  const std::size_t bytes = eager_cost(message_bytes);
  if (p.failed || p.closed || p.write_broken) return;
  if (!p.out.empty() && p.out.back().header.type == FrameType::kCredit && p.out.back().done == 0) {
    p.out.back().header.count += bytes;
    return;
  }
  P2pFrame f;
  f.type = FrameType::kCredit;
  f.count = bytes;
  queue_frame(p, f);
}

void P2pEngine::State::reject(Peer& p, const P2pFrame& m, const std::shared_ptr<RecvOp>& op) {
  const int peer = peer_index(p);
  // A receive from any source keeps its own name ("from any rank"): the one its caller knows.
  const std::string mine = op->work->description();
  const std::string theirs =
      describe_send(static_cast<DType>(m.dtype), m.count, m.tag, options.rank, m.message);
  finish_recv(
      p, op,
      comm_error(CommErrorKind::kMismatch,
                 fmt::format("point-to-point mismatch in group '{}': rank {} called {} but rank "
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

void P2pEngine::State::on_reject(Peer& p, const P2pFrame& r, const P2pFrame& m) {
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
      CommErrorKind::kMismatch,
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

void P2pEngine::State::ask_for_payload(Peer& p, const P2pFrame& m,
                                       const std::shared_ptr<RecvOp>& op) {
  p.awaiting_data[m.message] = op;
  P2pFrame f = m;
  f.type = FrameType::kClearToSend;
  queue_frame(p, f);
}

std::list<Unexpected>::iterator P2pEngine::State::find_unexpected(Peer& p, int tag) {
  return std::find_if(p.unexpected.begin(), p.unexpected.end(), [&](const Unexpected& u) {
    return !u.claimed && !u.rejected && u.header.tag == tag;
  });
}

void P2pEngine::State::take_unexpected(Peer& p, std::list<Unexpected>::iterator it,
                                       const std::shared_ptr<RecvOp>& op) {
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
}

void P2pEngine::State::match_posted(Peer& p, const std::shared_ptr<RecvOp>& op) {
  if (auto it = find_unexpected(p, op->tag); it != p.unexpected.end()) {
    return take_unexpected(p, it, op);
  }
  if (p.closed) {
    const int peer = peer_index(p);
    finish_recv(p, op,
                comm_error(CommErrorKind::kPeerGone,
                           fmt::format("rank {}: {} in group '{}' cannot match: rank {} closed "
                                       "its point-to-point connection (it destroyed its group "
                                       "or exited) without sending it",
                                       options.rank, op->work->description(), options.group, peer),
                           op->work->description(), op->number, peer));
    return;
  }
  p.posted.push_back(op);
}

void P2pEngine::State::bind_any(Peer& p, const std::shared_ptr<RecvOp>& op) {
  op->peer = peer_index(p);
  op->number = p.next_recv++;
  *op->source = op->peer;
  p.recvs[op->number] = op;
}

bool P2pEngine::State::any_peer_left() const {
  for (const Peer& p : peers) {
    if (peer_index(p) != options.rank && !p.failed && !p.closed) return true;
  }
  return false;
}

void P2pEngine::State::fail_any_if_no_peer_left(const std::exception_ptr& error) {
  if (any_posted.empty() || any_peer_left()) return;
  for (auto& op : any_posted)
    completions.emplace_back(op->work, error);
  any_posted.clear();
}

void P2pEngine::State::match_posted_any(const std::shared_ptr<RecvOp>& op) {
  // The earliest arrival among each peer's earliest matching message (messages from one peer
  // arrive in order, so each peer's first match is its earliest).
  Peer* from = nullptr;
  std::list<Unexpected>::iterator earliest;
  for (Peer& p : peers) {
    if (p.failed) continue;
    auto it = find_unexpected(p, op->tag);
    if (it != p.unexpected.end() && (from == nullptr || it->arrival < earliest->arrival)) {
      from = &p;
      earliest = it;
    }
  }
  if (from != nullptr) {
    bind_any(*from, op);
    return take_unexpected(*from, earliest, op);
  }
  if (!any_peer_left()) {
    completions.emplace_back(
        op->work,
        comm_error(CommErrorKind::kPeerGone,
                   fmt::format("rank {}: {} in group '{}' cannot match: every other rank closed "
                               "its point-to-point connection or failed without sending it",
                               options.rank, op->work->description(), options.group),
                   op->work->description(), op->number, -1));
    return;
  }
  any_posted.push_back(op);
}

void P2pEngine::State::payload_done(Peer& p) {
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

void P2pEngine::State::start_payload(Peer& p, std::byte* dst, std::size_t bytes, bool eager) {
  p.in_dst = dst;
  p.in_left = bytes;
  p.in_bytes = bytes;
  p.in_eager = eager;
  p.in_discard = dst == nullptr;
  if (bytes == 0) payload_done(p);
}

void P2pEngine::State::on_frame(Peer& p) {
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
      auto any = std::find_if(any_posted.begin(), any_posted.end(),
                              [&](const auto& op) { return op->tag == m.tag; });
      std::shared_ptr<RecvOp> op;
      if (any != any_posted.end() && (it == p.posted.end() || (*any)->order < (*it)->order)) {
        op = *any;
        any_posted.erase(any);
        bind_any(p, op);
      } else if (it != p.posted.end()) {
        op = *it;
        p.posted.erase(it);
      }
      if (op) {
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
      p.unexpected.push_back(Unexpected{m, {}, !eager, nullptr, false, next_arrival++});
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
      if (p.write_broken) return;  // its send already failed: the payload cannot go
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

}  // namespace ddp::comm::p2p
