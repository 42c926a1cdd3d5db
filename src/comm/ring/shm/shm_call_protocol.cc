// ShmDomain's per-call synchronisation protocol: publishing events, arriving, waiting for peers
// (spin, yield, futex naps with liveness and deadline checks), comparing the call headers, and
// aborting; the errors and warnings that name the peer.
#include "comm/ring/shm/shm_domain.h"

#include <poll.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_domain_internal.h"
#include "comm/ring/shm/sync.h"

namespace ddp::comm::shm {

void ShmDomain::fail(CommErrorKind kind, const std::string& what, int peer, bool peer_error) const {
  const std::string op = describe(header_);
  const std::string message = fmt::format("shm group '{}' rank {}: {} failed: {}", options_.group,
                                          rank_number(options_, rank_), op, what);
  const int blamed = group_rank(peer);
  if (peer_error) throw ShmPeerError(kind, message, options_.group, op, header_.sequence, blamed);
  throw CommError(kind, message, options_.group, op, header_.sequence, blamed);
}

// Once per call: a wait this long is no scheduling delay but a rank that is behind or stuck.
void ShmDomain::warn_waiting(int peer, net::Clock::time_point now) {
  wait_warned_ = true;
  const std::string line = fmt::format(
      "ddp: warning: shm group '{}' rank {} has waited {} s in {} for rank {} (alive, but it has "
      "not reached this step of the call); it fails in {} s unless that changes (is a rank "
      "behind or stuck? SIGUSR1 dumps the flight recorder, docs/observability.md)",
      options_.group, rank_number(options_, rank_),
      std::chrono::duration_cast<std::chrono::seconds>(now - call_start_).count(),
      describe(header_), rank_number(options_, peer),
      std::chrono::duration_cast<std::chrono::seconds>(deadline_ - now).count());
  if (options_.warn) {
    options_.warn(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

int ShmDomain::group_rank(int r) const {
  return r < 0 || options_.ranks.empty() ? r : options_.ranks[static_cast<std::size_t>(r)];
}

void ShmDomain::fail_damaged(const std::string& what) const {
  fail(CommErrorKind::kTransport,
       fmt::format("the shared segment of group '{}' is damaged: {} (another process wrote into "
                   "it?)",
                   options_.group, what),
       -1);
}

// aborted_by is shared memory any process of the user can write: it is a rank's index only once
// checked against the world (a stray value would index the controls far outside the mapping).
// This rank is never the one that set it while it waits: it sets it only when its own call
// failed, and a failed domain waits no more.
int ShmDomain::aborted_peer() const {
  const int by = atomic(segment_->header.aborted_by).load(std::memory_order_acquire);
  if (by == -1) return -1;
  if (by < 0 || by >= size_) {
    fail_damaged(fmt::format("aborted_by = {} names no rank of this world of {}", by, size_));
  }
  if (by == rank_) {
    if (error_) return -1;
    fail_damaged(fmt::format("aborted_by = {} names this rank, which did not abort", by));
  }
  return by;
}

void ShmDomain::fail_aborted(int by) const {
  const RankControl& c = controls(segment_)[by];
  // At most the field's bytes, whether or not the peer wrote its terminator; control bytes (a
  // terminal's escape sequences) are shown as '?', so the reason cannot rewrite the log around it.
  std::string reason(c.abort_reason, strnlen(c.abort_reason, sizeof c.abort_reason));
  for (char& ch : reason) {
    const auto byte = static_cast<unsigned char>(ch);
    if ((byte < 0x20 && ch != '\n' && ch != '\t') || byte == 0x7f) ch = '?';
  }
  if (reason.empty()) reason = "(no reason given)";
  fail(CommErrorKind::kAborted,
       fmt::format("rank {} aborted the group: {}", rank_number(options_, by), reason), by, true);
}

int ShmDomain::dead_peer() const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    bool alive = true;
    if (peer_pidfds_[r] >= 0) {
      pollfd p{peer_pidfds_[r], POLLIN, 0};
      alive = !(::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0);
    } else {
      alive = pid_alive(peer_pids_[r]);
    }
    if (!alive) return r;
  }
  return -1;
}

void ShmDomain::fail_dead(int peer) const {
  fail(CommErrorKind::kPeerGone,
       fmt::format("rank {} (pid {}) exited or was killed", rank_number(options_, peer),
                   peer_pids_[peer]),
       peer, true);
}

void ShmDomain::publish() {
  RankControl& me = controls(segment_)[rank_];
  ++events_;
  // seq_cst on both sides (this store, the sleeper's increment and re-check) so that either the
  // sleeper sees the new value or the publisher sees the sleeper.
  atomic(me.events).store(events_, std::memory_order_seq_cst);
  if (atomic(me.sleepers).load(std::memory_order_seq_cst) != 0) futex_wake_all(&me.events);
}

// Waits until `word` reaches `target`: spins for spin_ (zero when there are more ranks than
// cores, where a spinning rank only delays the peer it waits for), then sleeps on the futex in
// naps of liveness_interval, checking between naps that no peer died or aborted and that the
// deadline has not passed. `blame()` names the rank we are waiting for, for the error.
template <typename Blame>
void ShmDomain::wait_word(std::uint32_t& word, std::uint32_t& sleepers_word, std::uint32_t target,
                          Blame&& blame) {
  auto value = atomic(word);
  if (reached(value.load(std::memory_order_acquire), target)) return;
  const auto start = net::Clock::now();
  if (call_start_ == net::Clock::time_point{}) call_start_ = start;
  if (spin_.count() > 0) {
    for (int i = 1;; ++i) {
      if (reached(value.load(std::memory_order_acquire), target)) return;
      cpu_relax();
      if (i % 64 == 0) {
        if (net::Clock::now() - start >= spin_) break;
        // The peer may be waiting for this very core (ranks are not pinned): let it run.
        ::sched_yield();
      }
    }
  }
  while (net::Clock::now() - start < options_.yield) {
    if (reached(value.load(std::memory_order_acquire), target)) return;
    ::sched_yield();
  }
  auto sleepers = atomic(sleepers_word);
  for (;;) {
    // Look at the peers before the condition: a peer that finished the call (so the condition
    // holds) may exit at once, and must not be blamed for it.
    const int aborted = aborted_peer();
    const int dead = dead_peer();
    if (reached(value.load(std::memory_order_acquire), target)) return;
    if (aborted >= 0) fail_aborted(aborted);
    if (dead >= 0) fail_dead(dead);
    if (options_.on_nap) options_.on_nap();
    const auto now = net::Clock::now();
    if (now >= deadline_) {
      const int peer = blame();
      fail(CommErrorKind::kTimeout,
           fmt::format(
               "timed out after {} ms waiting for rank {} (it is alive but did not "
               "reach this step of the call: stopped, or busy elsewhere?)",
               std::chrono::round<std::chrono::milliseconds>(deadline_ - call_start_).count(),
               rank_number(options_, peer)),
           peer);
    }
    if (options_.wait_warning.count() > 0 && !wait_warned_ &&
        now - call_start_ >= options_.wait_warning) {
      warn_waiting(blame(), now);
    }
    const auto nap =
        std::min<std::chrono::nanoseconds>(deadline_ - now, options_.liveness_interval);
    // seq_cst pairs with publish(): either we see the new value or the publisher sees us.
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seen = value.load(std::memory_order_seq_cst);
    if (!reached(seen, target)) futex_wait(&word, seen, nap);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(value.load(std::memory_order_acquire), target)) return;
  }
}

void ShmDomain::wait_for(int peer, std::uint32_t target) {
  RankControl& c = controls(segment_)[peer];
  wait_word(c.events, c.sleepers, target, [peer] { return peer; });
}

// Every rank counts itself in once per call, at its first event; the last one wakes the rest, so
// that a call's first synchronisation costs at most one futex wake-up per rank. No rank can count
// itself into call c+1 before all have counted into call c, so the count is exact.
void ShmDomain::arrive() {
  SegmentHeader& h = segment_->header;
  const std::uint32_t target = static_cast<std::uint32_t>((calls_ + 1) * size_);
  const std::uint32_t now = atomic(h.arrivals).fetch_add(1, std::memory_order_seq_cst) + 1;
  if (now == target && atomic(h.arrival_sleepers).load(std::memory_order_seq_cst) != 0) {
    futex_wake_all(&h.arrivals);
  }
}

void ShmDomain::wait_all_arrived() {
  SegmentHeader& h = segment_->header;
  const std::uint32_t target = static_cast<std::uint32_t>((calls_ + 1) * size_);
  wait_word(h.arrivals, h.arrival_sleepers, target, [this] {
    for (int r = 0; r < size_; ++r) {
      if (!reached(atomic(controls(segment_)[r].events).load(std::memory_order_acquire), events_)) {
        return r;
      }
    }
    return -1;
  });
}

void ShmDomain::wait_all(std::uint32_t target) {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) wait_for(r, target);
  }
}

int ShmDomain::peer_with_other_call(const OpHeader& mine, OpHeader& theirs) const {
  RankControl* control = controls(segment_);
  auto read = [&](int r, int parity) {
    OpHeader h;
    std::atomic_thread_fence(std::memory_order_acquire);
    std::memcpy(&h, &control[r].headers[parity], sizeof h);
    return h;
  };
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    for (int parity = 0; parity < 2; ++parity) {
      const OpHeader first = read(r, parity);
      if (first.magic != kHeaderMagic || first.sequence != mine.sequence || first == mine) {
        continue;
      }
      ::sched_yield();
      if (read(r, parity) == first) {
        theirs = first;
        return group_rank(r);
      }
    }
  }
  return -1;
}

void ShmDomain::abort(const std::string& reason) noexcept {
  if (error_) return;
  error_.emplace(CommErrorKind::kAborted, reason, options_.group, "abort", header_.sequence,
                 group_rank(rank_));
  abort_domain(reason);
}

void ShmDomain::abort_domain(const std::string& reason) noexcept {
  if (segment_ == nullptr) return;
  RankControl* control = controls(segment_);
  std::int32_t expected = -1;
  // Write the reason before claiming the flag, so a peer that sees the flag reads a whole reason.
  const std::size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
  std::memcpy(control[rank_].abort_reason, reason.data(), n);
  control[rank_].abort_reason[n] = '\0';
  atomic(segment_->header.aborted_by)
      .compare_exchange_strong(expected, rank_, std::memory_order_acq_rel);
  for (int r = 0; r < size_; ++r)
    futex_wake_all(&control[r].events);
}

// The first synchronisation of a call: this rank's header (written before the event, so the
// release of publish() covers it) is compared with every peer's once all have arrived.
void ShmDomain::announce_and_check() {
  RankControl* control = controls(segment_);
  const int parity = static_cast<int>(calls_ & 1);
  wait_all_arrived();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const OpHeader& theirs = control[r].headers[parity];
    if (!(theirs == header_)) {
      std::string mine_text = describe(header_);
      std::string theirs_text = describe(theirs);
      if (mine_text == theirs_text) {
        mine_text += fmt::format(" [algorithm {}]", to_string(header_.algorithm));
        theirs_text += fmt::format(" [algorithm {}]", to_string(theirs.algorithm));
      }
      // Worded like the TCP engine's mismatch (comm/ring/exchange.cc), so users see one message.
      fail(CommErrorKind::kMismatch,
           fmt::format("collective mismatch in group '{}': rank {} called {} but rank {} called "
                       "{}; every rank must issue the same collectives in the same order with "
                       "the same count, dtype, op and root",
                       options_.group, rank_number(options_, rank_), mine_text,
                       rank_number(options_, r), theirs_text),
           r);
    }
  }
}

}  // namespace ddp::comm::shm
