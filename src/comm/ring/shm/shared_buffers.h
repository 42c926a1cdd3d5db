// Shared buffers: host memory that the ranks of one shared-memory domain map into each other's
// address space (internal to the ring backend), so that an in-place allreduce of a range of it
// reads every rank's copy where it lies and writes each result into all of them (ShmDomain's
// zero-copy path; docs/shared-memory.md, "Shared buffers").
//
// Making one is collective (RingProcessGroup::allocate_shared_buffer): every rank makes its copy
// (OwnSharedMemory), the ranks exchange where to open them, every rank maps its peers' copies
// (map_peer_copy), and only when every rank succeeded does each register the buffer here under
// the same id (the ids count successful collective allocations, so they agree between ranks).
//
// Threads: the registry is thread-safe (the group's worker looks buffers up while the caller's
// thread adds or drops them). A mapping is unmapped when the last holder lets go: the caller's
// buffer and any call that is using it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace ddp::comm::shm {

// One buffer as this rank sees it: every rank's copy, mapped into this process.
struct SharedBufferMapping {
  std::uint64_t id = 0;
  std::size_t bytes = 0;          // what the caller asked for
  std::size_t mapped_bytes = 0;   // each copy's mapping (bytes rounded up to a page)
  std::vector<std::byte*> bases;  // by domain rank; null where not mapped (failed set-up)
  SharedBufferMapping() = default;
  SharedBufferMapping(const SharedBufferMapping&) = delete;
  SharedBufferMapping& operator=(const SharedBufferMapping&) = delete;
  ~SharedBufferMapping();
};

class SharedBufferRegistry {
 public:
  // Registers `mapping` (its bases complete; `rank` is this rank's) under the next id, which it
  // sets.
  void add(const std::shared_ptr<SharedBufferMapping>& mapping, int rank);
  void remove(const SharedBufferMapping* mapping);
  // The buffer whose copy on `rank` holds [data, data + bytes) whole, and data's offset in it;
  // null when none does.
  std::shared_ptr<const SharedBufferMapping> find(const void* data, std::size_t bytes, int rank,
                                                  std::size_t& offset) const;
  std::size_t size() const;

 private:
  mutable std::mutex mutex_;
  std::uint64_t last_id_ = 0;
  std::map<const std::byte*, std::shared_ptr<SharedBufferMapping>> by_base_;  // own copy's base
};

// This rank's copy of a new shared buffer: a sealed memfd of `bytes` rounded up to a page, with
// its memory reserved (posix_fallocate: too little memory, the machine's or the memory cgroup's,
// fails here, not with a SIGBUS later) and mapped. The peers open it through
// /proc/<pid>/fd/<fd> while this object keeps the descriptor; close_descriptor() once they all
// have.
class OwnSharedMemory {
 public:
  OwnSharedMemory() = default;
  OwnSharedMemory(const OwnSharedMemory&) = delete;
  OwnSharedMemory& operator=(const OwnSharedMemory&) = delete;
  ~OwnSharedMemory();

  // Empty on success, else why not (errno's text and what to do).
  std::string create(std::size_t bytes, const std::string& name_prefix);
  int fd() const { return fd_; }
  std::size_t mapped_bytes() const { return mapped_bytes_; }
  // Hands the mapping over (the caller unmaps it, through SharedBufferMapping).
  std::byte* release_mapping();
  void close_descriptor();

 private:
  int fd_ = -1;
  void* mapping_ = nullptr;
  std::size_t mapped_bytes_ = 0;
};

// Maps a peer's copy, opened through /proc/<pid>/fd/<fd>, after checking that it is a sealed
// memfd of `mapped_bytes`. Returns the mapping, or null with `error` set.
std::byte* map_peer_copy(int pid, int fd, std::size_t mapped_bytes, std::string& error);

// The page-rounded size of a buffer of `bytes`.
std::size_t shared_mapping_bytes(std::size_t bytes);

}  // namespace ddp::comm::shm
