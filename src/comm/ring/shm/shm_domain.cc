#include "comm/ring/shm/shm_domain.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <cstdio>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "comm/reduce_kernels.h"
#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/sync.h"
#include "ddp/error.h"

namespace ddp::comm::shm {
namespace {

std::string errno_text(int err) {
  return std::strerror(err);
}

}  // namespace

struct ShmDomain::Segment {
  SegmentHeader header;
  // RankControl x size follows at Layout::control_offset.
};

namespace {

RankControl* controls(ShmDomain::Segment* segment) {
  return controls_of(&segment->header);
}

// Unmaps a half-made segment, and closes rank 0's descriptor of it, when create() fails.
struct SegmentGuard {
  void* mapping = nullptr;
  std::size_t bytes = 0;
  int fd = -1;
  ~SegmentGuard() {
    if (fd >= 0) ::close(fd);
    if (mapping != nullptr) ::munmap(mapping, bytes);
  }
};

// Seals of the segment (its size is fixed once made); the peers check them.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// "/proc/<pid>/fd/<fd>" and nothing else: the only kind of path a peer opens from the store.
bool is_fd_path(const std::string& path) {
  const auto digits = [](std::string_view text) {
    return !text.empty() && text.size() <= 10 &&
           std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  std::string_view rest(path);
  if (!rest.starts_with("/proc/")) return false;
  rest.remove_prefix(6);
  const auto slash = rest.find("/fd/");
  return slash != std::string_view::npos && digits(rest.substr(0, slash)) &&
         digits(rest.substr(slash + 4));
}

// How messages name domain rank `r`: its rank in the enclosing group, with the domain's own
// number when that differs ("3 (local 1)"), so that errors of a multi-host job name the ranks
// users know.
std::string rank_number(const ShmOptions& options, int r) {
  if (options.ranks.empty()) return std::to_string(r);
  const int global = options.ranks[static_cast<std::size_t>(r)];
  return global == r ? std::to_string(r) : fmt::format("{} (local {})", global, r);
}

}  // namespace

ShmDomain::ShmDomain(int rank, int size, ShmOptions options)
    : rank_(rank), size_(size), options_(std::move(options)) {}

ShmDomain::~ShmDomain() {
  for (int fd : peer_pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

std::unique_ptr<ShmDomain> ShmDomain::create(Store& store, const std::string& key_prefix, int rank,
                                             int size, ShmOptions options, Deadline deadline) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError(fmt::format("ShmDomain: rank {} is not in a group of size {}", rank, size));
  }
  if (options.slot_bytes < 4096 || options.slot_bytes % kCacheLine != 0) {
    throw ConfigError(
        fmt::format("ShmDomain: slot_bytes {} must be a multiple of {} and at least 4096",
                    options.slot_bytes, kCacheLine));
  }
  if (options.small_bytes > options.slot_bytes || options.small_bytes % kCacheLine != 0) {
    throw ConfigError(fmt::format(
        "ShmDomain: small_bytes {} must be a multiple of {} and at most slot_bytes ({})",
        options.small_bytes, kCacheLine, options.slot_bytes));
  }
  if (!options.ranks.empty() && options.ranks.size() != static_cast<std::size_t>(size)) {
    throw ConfigError(fmt::format("ShmDomain: ShmOptions::ranks has {} entries for a group of {}",
                                  options.ranks.size(), size));
  }
  std::unique_ptr<ShmDomain> domain(new ShmDomain(rank, size, std::move(options)));
  const ShmOptions& opts = domain->options_;
  const Layout layout = layout_for(size, opts.slot_bytes, opts.small_bytes);
  const std::string name_key = key_prefix + "/name";
  auto fail = [&](const std::string& what) -> CommError {
    return CommError(fmt::format("shm group '{}' rank {}: cannot set up the shared-memory "
                                 "segment: {}",
                                 opts.group, rank_number(opts, rank), what),
                     opts.group, "shm setup", 0, -1);
  };
  auto remaining_ms = [&] {
    const auto left = deadline - net::Clock::now();
    return std::max(Milliseconds(1), std::chrono::duration_cast<Milliseconds>(left));
  };

  // The segment is anonymous memory (memfd_create): it has no name in /dev/shm at any moment,
  // so a rank killed at any point of this set-up leaks nothing; the memory goes with the last
  // descriptor or mapping. The peers open it through rank 0's descriptor, /proc/<pid>/fd/<fd>,
  // which rank 0 keeps open until every rank has joined.
  SegmentGuard guard;
  std::string fd_path;  // where the peers open the segment
  if (rank == 0) {
    std::random_device random;
    const std::string name =
        fmt::format("{}-{}-{:08x}{:08x}", opts.name_prefix, ::getpid(), random(), random());
    guard.fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (guard.fd < 0)
      throw fail(fmt::format("memfd_create({}) failed: {}", name, errno_text(errno)));
    // Reserve the memory now: too little memory fails here with ENOSPC/ENOMEM instead of
    // killing a rank with SIGBUS in the middle of a collective.
    const int err = ::posix_fallocate(guard.fd, 0, static_cast<off_t>(layout.total));
    if (err != 0) {
      throw fail(
          fmt::format("cannot reserve {} bytes of shared memory ({}); free memory "
                      "or lower ShmOptions::slot_bytes",
                      layout.total, errno_text(err)));
    }
    // Its size can no longer change: nobody can shrink it under a peer's mapping (SIGBUS), and
    // the peers check these seals to know they opened such a segment, not some other file.
    if (::fcntl(guard.fd, F_ADD_SEALS, kSeals) != 0) {
      throw fail(fmt::format("sealing the segment failed: {}", errno_text(errno)));
    }
    domain->segment_name_ = "memfd:" + name;
    fd_path = fmt::format("/proc/{}/fd/{}", ::getpid(), guard.fd);
  } else {
    try {
      fd_path = store.get_string(name_key, remaining_ms());
    } catch (const TimeoutError&) {
      throw TimeoutError(
          fmt::format("shm group '{}' rank {}: rank {} did not publish the segment "
                      "under '{}' before the deadline",
                      opts.group, rank_number(opts, rank), rank_number(opts, 0), name_key));
    }
    if (!is_fd_path(fd_path)) {
      throw fail(
          fmt::format("store key '{}' holds '{}', not rank 0's segment descriptor (a key "
                      "of an older ddp or of another program?)",
                      name_key, fd_path));
    }
    guard.fd = ::open(fd_path.c_str(), O_RDWR | O_CLOEXEC);
    if (guard.fd < 0) {
      const std::string creator = rank_number(opts, 0);
      throw fail(fmt::format(
          "cannot open rank {0}'s segment through {1}: {2} (rank {0} exited or gave up, or this "
          "process may not read its /proc entries: the ranks of a host must run as the same "
          "user in the same pid namespace)",
          creator, fd_path, errno_text(errno)));
    }
    const int seals = ::fcntl(guard.fd, F_GET_SEALS);
    if (seals < 0 || (seals & kSeals) != kSeals) {
      throw fail(fmt::format("{} is not a sealed shared-memory segment made by rank {}", fd_path,
                             rank_number(opts, 0)));
    }
    struct stat st {};
    if (::fstat(guard.fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != layout.total) {
      throw fail(
          fmt::format("segment {} has {} bytes, this rank expects {}: the ranks were "
                      "given different ShmOptions (slot_bytes, small_bytes) or sizes",
                      fd_path, static_cast<long long>(st.st_size), layout.total));
    }
    domain->segment_name_ = fd_path;
  }
  void* mapping = ::mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, guard.fd, 0);
  const int mmap_errno = errno;
  if (rank != 0) {
    ::close(guard.fd);  // the mapping keeps the memory; only rank 0's descriptor is shared
    guard.fd = -1;
  }
  if (mapping == MAP_FAILED) throw fail(fmt::format("mmap failed: {}", errno_text(mmap_errno)));
  guard.mapping = mapping;
  guard.bytes = layout.total;
  auto* segment = static_cast<Segment*>(mapping);
  SegmentHeader& header = segment->header;
  RankControl* control = controls(segment);

  if (rank == 0) {
    header.version = kSegmentVersion;
    header.size = size;
    header.slot_bytes = opts.slot_bytes;
    header.small_bytes = opts.small_bytes;
    header.total_bytes = layout.total;
    header.aborted_by = -1;
    control[0].pid = ::getpid();
    std::atomic_ref<std::uint64_t>(header.magic).store(kSegmentMagic, std::memory_order_release);
    store.set(name_key, fd_path);
  } else {
    if (std::atomic_ref<std::uint64_t>(header.magic).load(std::memory_order_acquire) !=
            kSegmentMagic ||
        header.version != kSegmentVersion || header.size != size ||
        header.slot_bytes != opts.slot_bytes || header.small_bytes != opts.small_bytes) {
      throw fail(
          fmt::format("segment {} was made for another group (size {}, slot_bytes {}, "
                      "small_bytes {}; this rank has size {}, {}, {})",
                      domain->segment_name_, header.size, header.slot_bytes, header.small_bytes,
                      size, opts.slot_bytes, opts.small_bytes));
    }
    atomic(control[rank].pid).store(::getpid(), std::memory_order_relaxed);
    atomic(header.joined).fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(&header.joined);
  }

  // Everyone waits until all have joined, so that every pid is known before the first call.
  for (;;) {
    const std::uint32_t joined = atomic(header.joined).load(std::memory_order_acquire);
    if (static_cast<int>(joined) >= size - 1) break;
    const auto now = net::Clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int r = 1; r < size; ++r) {
        if (atomic(control[r].pid).load(std::memory_order_relaxed) == 0) {
          missing += (missing.empty() ? "" : ", ") + rank_number(opts, r);
        }
      }
      throw TimeoutError(
          fmt::format("shm group '{}' rank {}: ranks {} did not join segment {} "
                      "before the deadline",
                      opts.group, rank_number(opts, rank), missing, domain->segment_name_));
    }
    futex_wait(&header.joined, joined,
               std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(10)));
  }
  // Every rank has the segment mapped: rank 0's descriptor has done its job (the peers need not
  // wait for this; a descriptor never outlives its process, so nothing can leak either way).
  if (rank == 0) {
    ::close(guard.fd);
    guard.fd = -1;
  }
  guard.mapping = nullptr;

  domain->mapping_ = mapping;
  domain->mapping_bytes_ = layout.total;
  domain->segment_ = segment;
  domain->data_ = static_cast<std::byte*>(mapping);
  // Spinning only pays when every rank has a core of its own.
  cpu_set_t cpus;
  const int cores = ::sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  domain->spin_ = size <= cores ? opts.spin : std::chrono::microseconds(0);
  domain->peer_pids_.assign(size, 0);
  domain->peer_pidfds_.assign(size, -1);
  for (int r = 0; r < size; ++r) {
    domain->peer_pids_[r] = atomic(control[r].pid).load(std::memory_order_relaxed);
    if (r != rank) domain->peer_pidfds_[r] = open_pidfd(domain->peer_pids_[r]);
  }
  return domain;
}

std::byte* ShmDomain::input_slot(int rank, int parity) const {
  const Layout l = layout_for(size_, options_.slot_bytes, options_.small_bytes);
  return data_ + l.inputs_offset +
         (static_cast<std::size_t>(parity) * size_ + rank) * options_.slot_bytes;
}

std::byte* ShmDomain::result_slot(int parity) const {
  const Layout l = layout_for(size_, options_.slot_bytes, options_.small_bytes);
  return data_ + l.results_offset + static_cast<std::size_t>(parity) * options_.slot_bytes;
}

std::byte* ShmDomain::small_slot(int rank, int parity) const {
  const Layout l = layout_for(size_, options_.slot_bytes, options_.small_bytes);
  return data_ + l.small_offset +
         (static_cast<std::size_t>(parity) * size_ + rank) * options_.small_bytes;
}

// ---- synchronisation -------------------------------------------------------------------------

void ShmDomain::fail(const std::string& what, int peer, bool peer_error) const {
  const std::string op = describe(header_);
  const std::string message = fmt::format("shm group '{}' rank {}: {} failed: {}", options_.group,
                                          rank_number(options_, rank_), op, what);
  const int blamed = group_rank(peer);
  if (peer_error) throw ShmPeerError(message, options_.group, op, header_.sequence, blamed);
  throw CommError(message, options_.group, op, header_.sequence, blamed);
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

int ShmDomain::aborted_peer() const {
  const int by = atomic(segment_->header.aborted_by).load(std::memory_order_acquire);
  return by == rank_ ? -1 : by;
}

void ShmDomain::fail_aborted(int by) const {
  const RankControl& c = controls(segment_)[by];
  std::string reason(c.abort_reason, strnlen(c.abort_reason, sizeof c.abort_reason));
  fail(fmt::format("rank {} aborted the group: {}", rank_number(options_, by), reason), by, true);
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
  fail(fmt::format("rank {} (pid {}) exited or was killed", rank_number(options_, peer),
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
      fail(fmt::format(
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
        return r;
      }
    }
  }
  return -1;
}

void ShmDomain::abort(const std::string& reason) noexcept {
  if (error_) return;
  error_.emplace(reason, options_.group, "abort", header_.sequence, group_rank(rank_));
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
      // Worded like the TCP engine's mismatch (comm/exchange.cc), so users see one message.
      fail(fmt::format("collective mismatch in group '{}': rank {} called {} but rank {} called "
                       "{}; every rank must issue the same collectives in the same order with "
                       "the same count, dtype, op and root",
                       options_.group, rank_number(options_, rank_), mine_text,
                       rank_number(options_, r), theirs_text),
           r);
    }
  }
}

template <typename Fn>
void ShmDomain::guarded(const OpHeader& header, Deadline deadline, Fn&& body) {
  if (error_) {
    if (error_is_peer_) {
      throw ShmPeerError(error_->what(), error_->group(), error_->op(), error_->sequence(),
                         error_->peer());
    }
    throw CommError(*error_);
  }
  header_ = header;
  deadline_ = deadline;
  call_start_ = {};  // set by the first wait of the call (a clock read saved per small call)
  wait_warned_ = false;
  try {
    body();
  } catch (const ShmPeerError& e) {
    error_ = e;
    error_is_peer_ = true;
    abort_domain(e.what());
    throw;
  } catch (const CommError& e) {
    error_ = e;
    abort_domain(e.what());
    throw;
  }
  ++calls_;
}

// A chunked collective, for each chunk i (elements [first, first + len), buffers of parity i%2):
//
//   copy_in(i)  write this rank's input slot            -> event A_i (A_0: also arrive())
//   wait for A_i of every rank (chunk 0: all arrived; compare the call headers)
//   compute(i)  read peers' input slots, write own output -> event B_i
//   copy_in(i+1)                                         -> event A_{i+1}
//   wait for B_i of every rank
//   copy_out(i) read the result slot
//
// Buffer reuse is safe with two parities: a rank overwrites its input slot of parity p (chunk
// i+2) only after it saw every B_i, and peers read that slot before publishing B_i; a rank
// writes its slice of the result slot p (chunk i+2) only after it saw every A_{i+2}, which each
// peer publishes after its copy_out(i). Two events per chunk; copy_in(i+1) overlaps the wait for
// B_i. A call with count 0 only publishes A_0, which checks the headers.
template <typename CopyIn, typename Compute, typename CopyOut>
void ShmDomain::run_chunked(std::size_t count, std::size_t chunk_elems, CopyIn&& copy_in,
                            Compute&& compute, CopyOut&& copy_out) {
  const std::size_t chunks = (count + chunk_elems - 1) / chunk_elems;
  auto len_of = [&](std::size_t i) { return std::min(chunk_elems, count - i * chunk_elems); };
  const int parity = static_cast<int>(calls_ & 1);
  controls(segment_)[rank_].headers[parity] = header_;
  if (count > 0) copy_in(std::size_t{0}, len_of(0), 0);
  publish();
  arrive();
  if (count == 0) {  // nothing to move; the headers still have to agree
    announce_and_check();
    return;
  }
  const std::uint32_t base = events_ - 1;
  for (std::size_t i = 0; i < chunks; ++i) {
    const std::size_t first = i * chunk_elems;
    const std::size_t len = len_of(i);
    const int p = static_cast<int>(i & 1);
    const auto a_i = static_cast<std::uint32_t>(base + 2 * i + 1);
    if (i == 0) {
      announce_and_check();
    } else {
      wait_all(a_i);
    }
    compute(first, len, p);
    publish();
    if (i + 1 < chunks) {
      copy_in(first + chunk_elems, len_of(i + 1), 1 - p);
      publish();
    }
    wait_all(a_i + 1);
    copy_out(first, len, p);
  }
}

// Slice of a chunk of `len` elements that `rank` reduces: equal parts rounded up to a cache line,
// so that no two ranks write the same line; the last ranks may get less or nothing.
static std::pair<std::size_t, std::size_t> slice_of(std::size_t len, int rank, int size,
                                                    std::size_t element_size) {
  const std::size_t per_line = std::max<std::size_t>(1, kCacheLine / element_size);
  const std::size_t part = round_up((len + size - 1) / size, per_line);
  const std::size_t begin = std::min(len, part * rank);
  const std::size_t end = std::min(len, begin + part);
  return {begin, end - begin};
}

// Reduces `inputs(r) + offset` over every rank r in rank order into dst (bytes, count elements);
// the average divides once, at the last step.
template <typename InputOf>
static void reduce_in_rank_order(std::byte* dst, InputOf&& input_of, std::size_t count, DType dtype,
                                 ReduceOp op, int size) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (count == 0) return;
  if (size == 1) {
    if (dst != input_of(0)) std::memmove(dst, input_of(0), bytes);
    return;
  }
  const int divisor = op == ReduceOp::kAvg ? size : 0;
  reduce(dst, input_of(0), input_of(1), count, dtype, op, size == 2 ? divisor : 0);
  for (int r = 2; r < size; ++r) {
    reduce(dst, dst, input_of(r), count, dtype, op, r == size - 1 ? divisor : 0);
  }
}

// ---- collectives -----------------------------------------------------------------------------

namespace {

void check_header(const OpHeader& header, Collective kind, std::size_t count, DType dtype, int root,
                  int size) {
  if (header.kind != kind || header.count != count ||
      (kind != Collective::kBarrier && header.dtype != static_cast<std::uint8_t>(dtype))) {
    throw ConfigError(fmt::format("ShmDomain: the header {} does not describe the call {}({} x {})",
                                  describe(header), to_string(kind), to_string(dtype), count));
  }
  const bool rooted = kind == Collective::kBroadcast || kind == Collective::kReduce;
  if (root >= size || (rooted && root < 0)) {
    throw ConfigError(
        fmt::format("ShmDomain: root {} is not a rank of a group of size {}", root, size));
  }
}

void check_buffer(const void* p, std::size_t count, const char* what) {
  if (p == nullptr && count != 0) {
    throw ConfigError(fmt::format("ShmDomain: {} is null for {} elements", what, count));
  }
}

}  // namespace

// A buffer as the allreduce sees it: one contiguous range, or the segments of allreduce_segments
// one after the other. for_each(first, n, fn) calls fn(piece, at, len) for each contiguous piece
// of elements [first, first + n): `piece` points at element first + at, `len` elements long.
class ShmDomain::Pieces {
 public:
  // One contiguous range: no allocation (this is on the path of every allreduce).
  Pieces(const void* data, std::size_t count, std::size_t element_bytes)
      : element_bytes_(element_bytes),
        single_{const_cast<void*>(data), count},
        single_end_(count),
        segments_(&single_, 1),
        ends_(&single_end_, 1) {}
  Pieces(std::span<const BufferSegment> segments, std::size_t element_bytes)
      : element_bytes_(element_bytes), segments_(segments) {
    owned_ends_.reserve(segments.size());
    std::size_t end = 0;
    for (const auto& segment : segments) {
      end += segment.count;
      owned_ends_.push_back(end);
    }
    ends_ = owned_ends_;
  }
  Pieces(const Pieces&) = delete;
  Pieces& operator=(const Pieces&) = delete;

  template <typename Fn>
  void for_each(std::size_t first, std::size_t n, Fn&& fn) const {
    if (n == 0) return;
    // The first segment that ends after `first` (empty segments are passed over).
    auto k = static_cast<std::size_t>(std::upper_bound(ends_.begin(), ends_.end(), first) -
                                      ends_.begin());
    std::size_t at = 0;
    while (at < n) {
      const std::size_t begin = ends_[k] - segments_[k].count;
      const std::size_t offset = first + at - begin;
      const std::size_t len = std::min(n - at, segments_[k].count - offset);
      if (len > 0) {
        fn(static_cast<std::byte*>(segments_[k].data) + offset * element_bytes_, at, len);
      }
      at += len;
      ++k;
    }
  }

 private:
  std::size_t element_bytes_;
  BufferSegment single_{};
  std::size_t single_end_ = 0;
  std::vector<std::size_t> owned_ends_;
  std::span<const BufferSegment> segments_;
  std::span<const std::size_t> ends_;  // element index after each segment
};

void ShmDomain::run_small_allreduce(const Pieces& in, const Pieces& out, std::size_t count,
                                    DType dtype, ReduceOp op) {
  const int parity = static_cast<int>(calls_ & 1);
  const std::size_t esize = dtype_size(dtype);
  controls(segment_)[rank_].headers[parity] = header_;
  std::byte* mine = small_slot(rank_, parity);
  in.for_each(0, count, [&](const std::byte* piece, std::size_t at, std::size_t len) {
    std::memcpy(mine + at * esize, piece, len * esize);
  });
  publish();
  arrive();
  announce_and_check();
  out.for_each(0, count, [&](std::byte* piece, std::size_t at, std::size_t len) {
    reduce_in_rank_order(
        piece, [&](int r) { return small_slot(r, parity) + at * esize; }, len, dtype, op, size_);
  });
}

void ShmDomain::allreduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kAllreduce, count, dtype, -1, size_);
  check_buffer(send, count, "send");
  check_buffer(recv, count, "recv");
  const std::size_t esize = dtype_size(dtype);
  run_allreduce(Pieces(send, count, esize), Pieces(recv, count, esize), count, dtype, op, header,
                deadline);
}

void ShmDomain::allreduce_segments(std::span<const BufferSegment> segments, DType dtype,
                                   ReduceOp op, const OpHeader& header, Deadline deadline) {
  std::size_t count = 0;
  for (const auto& segment : segments) {
    check_buffer(segment.data, segment.count, "a segment");
    count += segment.count;
  }
  check_header(header, Collective::kAllreduce, count, dtype, -1, size_);
  const Pieces buffer(segments, dtype_size(dtype));
  run_allreduce(buffer, buffer, count, dtype, op, header, deadline);
}

void ShmDomain::run_allreduce(const Pieces& in, const Pieces& out, std::size_t count, DType dtype,
                              ReduceOp op, const OpHeader& header, Deadline deadline) {
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    if (count * esize <= options_.small_bytes && count > 0) {
      run_small_allreduce(in, out, count, dtype, op);
      return;
    }
    // Nobody else reads this rank's slice of its input, so it stays where it is (saves 1/N of
    // the copy-in) and the reduction reads it from there.
    auto copy_in_but_own_slice = [&](std::size_t first, std::size_t len, int p) {
      const auto [begin, n] = slice_of(len, rank_, size_, esize);
      std::byte* slot = input_slot(rank_, p);
      auto copy_at = [&](std::size_t from) {
        return [&, from](const std::byte* piece, std::size_t at, std::size_t m) {
          std::memcpy(slot + (from + at) * esize, piece, m * esize);
        };
      };
      in.for_each(first, begin, copy_at(0));
      in.for_each(first + begin + n, len - begin - n, copy_at(begin + n));
    };
    auto reduce_own_slice = [&](std::size_t first, std::size_t len, int p) {
      // Plain variables, not a structured binding: the lambda below captures them (clang < 16
      // cannot capture bindings).
      const auto slice = slice_of(len, rank_, size_, esize);
      const std::size_t begin = slice.first, n = slice.second;
      in.for_each(first + begin, n, [&](const std::byte* piece, std::size_t at, std::size_t m) {
        const std::size_t offset = (begin + at) * esize;
        reduce_in_rank_order(
            result_slot(p) + offset,
            [&](int r) { return r == rank_ ? piece : input_slot(r, p) + offset; }, m, dtype, op,
            size_);
      });
    };
    run_chunked(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) { copy_in_but_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) { reduce_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) {
          const std::byte* result = result_slot(p);
          out.for_each(first, len, [&](std::byte* piece, std::size_t at, std::size_t m) {
            std::memcpy(piece, result + at * esize, m * esize);
          });
        });
  });
}

void ShmDomain::reduce(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op,
                       int root, const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kReduce, count, dtype, root, size_);
  check_buffer(send, count, "send");
  if (rank_ == root) check_buffer(recv, count, "recv");
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    // Nobody else reads this rank's slice of its input, so it stays in `send` (saves 1/N of the
    // copy-in) and the reduction reads it from there.
    auto copy_in_but_own_slice = [&](std::size_t first, std::size_t len, int p) {
      const auto [begin, n] = slice_of(len, rank_, size_, esize);
      std::byte* slot = input_slot(rank_, p);
      std::memcpy(slot, in + first * esize, begin * esize);
      std::memcpy(slot + (begin + n) * esize, in + (first + begin + n) * esize,
                  (len - begin - n) * esize);
    };
    auto reduce_own_slice = [&](std::size_t first, std::size_t len, int p) {
      // Plain variables, not a structured binding: the lambda below captures them (clang < 16
      // cannot capture bindings).
      const auto slice = slice_of(len, rank_, size_, esize);
      const std::size_t begin = slice.first, n = slice.second;
      const std::size_t offset = begin * esize;
      reduce_in_rank_order(
          result_slot(p) + offset,
          [&](int r) {
            return r == rank_ ? in + (first + begin) * esize : input_slot(r, p) + offset;
          },
          n, dtype, op, size_);
    };
    run_chunked(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) { copy_in_but_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) { reduce_own_slice(first, len, p); },
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ == root) std::memcpy(out + first * esize, result_slot(p), len * esize);
        });
  });
}

void ShmDomain::broadcast(void* buf, std::size_t count, DType dtype, int root,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kBroadcast, count, dtype, root, size_);
  check_buffer(buf, count, "buf");
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    auto* data = static_cast<std::byte*>(buf);
    run_chunked(
        count, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ == root) std::memcpy(input_slot(rank_, p), data + first * esize, len * esize);
        },
        [&](std::size_t first, std::size_t len, int p) {
          if (rank_ != root) std::memcpy(data + first * esize, input_slot(root, p), len * esize);
        },
        [](std::size_t, std::size_t, int) {});
  });
}

void ShmDomain::allgather(const void* send, void* recv, std::size_t count_per_rank, DType dtype,
                          const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kAllgather, count_per_rank, dtype, -1, size_);
  check_buffer(send, count_per_rank, "send");
  check_buffer(recv, count_per_rank, "recv");
  const std::size_t esize = dtype_size(dtype);
  guarded(header, deadline, [&] {
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    run_chunked(
        count_per_rank, options_.slot_bytes / esize,
        [&](std::size_t first, std::size_t len, int p) {
          std::memcpy(input_slot(rank_, p), in + first * esize, len * esize);
        },
        [&](std::size_t first, std::size_t len, int p) {
          for (int r = 0; r < size_; ++r) {
            std::memmove(out + (r * count_per_rank + first) * esize, input_slot(r, p), len * esize);
          }
        },
        [](std::size_t, std::size_t, int) {});
  });
}

void ShmDomain::reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, ReduceOp op, const OpHeader& header,
                               Deadline deadline) {
  check_header(header, Collective::kReduceScatter, count_per_rank, dtype, -1, size_);
  check_buffer(send, count_per_rank, "send");
  check_buffer(recv, count_per_rank, "recv");
  const std::size_t esize = dtype_size(dtype);
  // A chunk carries `len` elements of each of the size_ blocks, so it is 1/size_ as long.
  const std::size_t chunk =
      std::max<std::size_t>(1, options_.slot_bytes / (esize * static_cast<std::size_t>(size_)));
  guarded(header, deadline, [&] {
    const auto* in = static_cast<const std::byte*>(send);
    auto* out = static_cast<std::byte*>(recv);
    run_chunked(
        count_per_rank, chunk,
        [&](std::size_t first, std::size_t len, int p) {
          std::byte* slot = input_slot(rank_, p);
          for (int block = 0; block < size_; ++block) {
            std::memcpy(slot + block * len * esize, in + (block * count_per_rank + first) * esize,
                        len * esize);
          }
        },
        [&](std::size_t first, std::size_t len, int p) {
          const std::size_t offset = rank_ * len * esize;
          reduce_in_rank_order(
              out + first * esize, [&](int r) { return input_slot(r, p) + offset; }, len, dtype, op,
              size_);
        },
        [](std::size_t, std::size_t, int) {});
  });
}

void ShmDomain::barrier(const OpHeader& header, Deadline deadline) {
  check_header(header, Collective::kBarrier, header.count, DType::kFloat32, -1, size_);
  guarded(header, deadline, [&] {
    const int parity = static_cast<int>(calls_ & 1);
    controls(segment_)[rank_].headers[parity] = header_;
    publish();
    arrive();
    announce_and_check();
  });
}

}  // namespace ddp::comm::shm
