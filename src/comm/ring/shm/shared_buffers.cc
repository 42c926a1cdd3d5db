// Shared buffers: making this rank's copy, mapping a peer's, and the registry the zero-copy
// allreduce looks buffers up in.
#include "comm/ring/shm/shared_buffers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "net/descriptors.h"

namespace ddp::comm::shm {
namespace {

// Its size can no longer change: nobody can shrink a copy under a peer's mapping (SIGBUS), and
// the peers check these seals to know they opened such a copy, not some other file.
constexpr int kCopySeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
constexpr std::size_t kCopyPage = 4096;

}  // namespace

std::size_t shared_mapping_bytes(std::size_t bytes) {
  return (bytes + kCopyPage - 1) / kCopyPage * kCopyPage;
}

SharedBufferMapping::~SharedBufferMapping() {
  for (std::byte* base : bases) {
    if (base != nullptr) ::munmap(base, mapped_bytes);
  }
}

void SharedBufferRegistry::add(const std::shared_ptr<SharedBufferMapping>& mapping, int rank) {
  std::lock_guard lock(mutex_);
  mapping->id = ++last_id_;
  by_base_[mapping->bases.at(static_cast<std::size_t>(rank))] = mapping;
}

void SharedBufferRegistry::remove(const SharedBufferMapping* mapping) {
  std::lock_guard lock(mutex_);
  for (auto it = by_base_.begin(); it != by_base_.end(); ++it) {
    if (it->second.get() == mapping) {
      by_base_.erase(it);
      return;
    }
  }
}

std::shared_ptr<const SharedBufferMapping> SharedBufferRegistry::find(const void* data,
                                                                      std::size_t bytes, int rank,
                                                                      std::size_t& offset) const {
  const auto* p = static_cast<const std::byte*>(data);
  std::lock_guard lock(mutex_);
  auto it = by_base_.upper_bound(p);
  if (it == by_base_.begin()) return nullptr;
  --it;
  const auto& mapping = it->second;
  const std::byte* base = mapping->bases[static_cast<std::size_t>(rank)];
  if (p < base || static_cast<std::size_t>(p - base) + bytes > mapping->bytes) return nullptr;
  offset = static_cast<std::size_t>(p - base);
  return mapping;
}

std::size_t SharedBufferRegistry::size() const {
  std::lock_guard lock(mutex_);
  return by_base_.size();
}

OwnSharedMemory::~OwnSharedMemory() {
  close_descriptor();
  if (mapping_ != nullptr) ::munmap(mapping_, mapped_bytes_);
}

std::string OwnSharedMemory::create(std::size_t bytes, const std::string& name_prefix) {
  mapped_bytes_ = shared_mapping_bytes(bytes);
  std::random_device random;
  const std::string name =
      fmt::format("{}-buffer-{}-{:08x}{:08x}", name_prefix, ::getpid(), random(), random());
  fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) {
    return fmt::format("memfd_create failed: {}", net::system_error_text(errno));
  }
  // Reserve the memory now: too little fails here instead of with a SIGBUS in a collective.
  if (const int err = ::posix_fallocate(fd_, 0, static_cast<off_t>(mapped_bytes_)); err != 0) {
    return fmt::format(
        "cannot reserve {} bytes of shared memory: {} (the machine's or the memory cgroup's "
        "memory is short; a memfd does not live in /dev/shm, whose size does not matter)",
        mapped_bytes_, std::strerror(err));
  }
  if (::fcntl(fd_, F_ADD_SEALS, kCopySeals) != 0) {
    return fmt::format("sealing the buffer failed: {}", std::strerror(errno));
  }
  void* mapping =
      ::mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, 0);
  if (mapping == MAP_FAILED) {
    return fmt::format("mmap of {} bytes failed: {} (the address-space limit, ulimit -v?)",
                       mapped_bytes_, std::strerror(errno));
  }
  mapping_ = mapping;
  return {};
}

std::byte* OwnSharedMemory::release_mapping() {
  auto* mapping = static_cast<std::byte*>(mapping_);
  mapping_ = nullptr;
  return mapping;
}

void OwnSharedMemory::close_descriptor() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::byte* map_peer_copy(int pid, int fd, std::size_t mapped_bytes, std::string& error) {
  const std::string path = fmt::format("/proc/{}/fd/{}", pid, fd);
  const int opened = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) {
    const int err = errno;
    error = fmt::format(
        "cannot open {}: {}", path,
        net::is_out_of_descriptors(err)
            ? net::out_of_descriptors_text(err)
            : fmt::format("{} (the ranks of a host must run as the same user in the same pid "
                          "namespace)",
                          std::strerror(err)));
    return nullptr;
  }
  struct stat st {};
  const int seals = ::fcntl(opened, F_GET_SEALS);
  if (seals < 0 || (seals & kCopySeals) != kCopySeals || ::fstat(opened, &st) != 0 ||
      static_cast<std::size_t>(st.st_size) != mapped_bytes) {
    ::close(opened);
    error = fmt::format("{} is not a sealed shared buffer of {} bytes", path, mapped_bytes);
    return nullptr;
  }
  // Not populated: a rank touches only its slice of a peer's copy, so its resident memory grows
  // by 1/N of each peer's buffer rather than all of it.
  void* mapping = ::mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
  const int mmap_errno = errno;
  ::close(opened);  // the mapping keeps the memory
  if (mapping == MAP_FAILED) {
    error = fmt::format("mmap of {} bytes of {} failed: {} (the address-space limit, ulimit -v?)",
                        mapped_bytes, path, std::strerror(mmap_errno));
    return nullptr;
  }
  return static_cast<std::byte*>(mapping);
}

}  // namespace ddp::comm::shm
