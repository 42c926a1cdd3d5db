// ShmDomain's set-up and lifetime: creating (rank 0) or joining (the others) the shared segment,
// checking it, learning every peer's pid; unmapping it at the end; where the slots lie in it.
#include "comm/ring/shm/shm_domain.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_domain_internal.h"
#include "comm/ring/shm/sync.h"
#include "ddp/error.h"
#include "net/descriptors.h"

namespace ddp::comm::shm {
namespace {

// strerror's text; for EMFILE and ENFILE, the limit and what to do.
std::string errno_text(int err) {
  return net::system_error_text(err);
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
    return CommError(CommErrorKind::kSetup,
                     fmt::format("shm group '{}' rank {}: cannot set up the shared-memory "
                                 "segment: {}",
                                 opts.group, rank_number(opts, rank), what),
                     opts.group, "shm setup", 0, -1);
  };
  auto damaged = [&](const std::string& what) -> CommError {
    return fail(
        fmt::format("the shared segment of group '{}' is damaged: {} (another process "
                    "wrote into it?)",
                    opts.group, what));
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
      const int err = errno;
      const std::string creator = rank_number(opts, 0);
      if (net::is_out_of_descriptors(err)) {
        throw fail(fmt::format("cannot open rank {}'s segment through {}: {}", creator, fd_path,
                               errno_text(err)));
      }
      throw fail(fmt::format(
          "cannot open rank {0}'s segment through {1}: {2} (rank {0} exited or gave up, or this "
          "process may not read its /proc entries: the ranks of a host must run as the same "
          "user in the same pid namespace)",
          creator, fd_path, errno_text(err)));
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
        header.slot_bytes != opts.slot_bytes || header.small_bytes != opts.small_bytes ||
        header.total_bytes != layout.total) {
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
    if (joined > static_cast<std::uint32_t>(size - 1)) {
      throw damaged(
          fmt::format("joined = {} counts more ranks than the {} that join it", joined, size - 1));
    }
    if (static_cast<int>(joined) == size - 1) break;
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
    const int pid = atomic(control[r].pid).load(std::memory_order_relaxed);
    // Every rank wrote its pid before it counted itself in `joined`; anything else is no pid (0,
    // or a negative number that kill() would take for a process group).
    if (pid <= 0) {
      throw damaged(fmt::format("rank {}'s pid = {} is no process id", rank_number(opts, r), pid));
    }
    domain->peer_pids_[r] = pid;
    if (r != rank) {
      domain->peer_pidfds_[r] = open_pidfd(pid);
      // Without a pidfd a peer's death is still seen (pid_alive), but a process out of
      // descriptors is about to fail elsewhere: say why here.
      const int err = errno;
      if (domain->peer_pidfds_[r] < 0 && net::is_out_of_descriptors(err)) {
        throw fail(fmt::format("pidfd_open of rank {} (pid {}) failed: {}", rank_number(opts, r),
                               pid, errno_text(err)));
      }
    }
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

}  // namespace ddp::comm::shm
