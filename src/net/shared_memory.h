// Shared memory between processes of one user on one host: anonymous memory (memfd) whose maker
// reserves every page at once and seals its size, and which another process maps through the
// maker's descriptor, /proc/<pid>/fd/<fd>, while the maker keeps that descriptor open. Nothing
// has a name in /dev/shm at any moment, so a process killed anywhere leaks nothing.
//
//   SharedMemory ring = SharedMemory::make("ddp-rpc", 4 << 20);   // throws Error saying why
//   send ring.path() to the peer ... SharedMemory::open(path, 4 << 20) there; then
//   ring.close_descriptor() once the peer has it mapped (or gave up).
//
// open() trusts nothing it is given: the path must be /proc/<digits>/fd/<digits>, name a regular
// file that carries the maker's seals, and have exactly the size expected; whatever else it names
// is refused before a byte is mapped. The bytes inside stay writable by both sides: a reader
// checks what it reads there (rpc/shared_ring.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ddp::net {

class SharedMemory {
 public:
  SharedMemory() = default;
  ~SharedMemory();
  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  // `bytes` of zeroed memory, reserved (too little memory fails here with a named error, never
  // with SIGBUS later), sealed and mapped. `name` shows in /proc/<pid>/maps.
  static SharedMemory make(const std::string& name, std::size_t bytes);
  // Maps the memory another process made, through `path` (its path()). Throws Error naming what
  // was wrong with the path or what it names.
  static SharedMemory open(const std::string& path, std::size_t bytes);

  std::byte* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool valid() const { return data_ != nullptr; }
  // Where another process opens it ("" once the descriptor is closed, and for an opened one).
  const std::string& path() const { return path_; }
  // Closes the maker's descriptor: the mapping stays, nobody can open it any more.
  void close_descriptor();

 private:
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  int fd_ = -1;
  std::string path_;
};

// Futexes on shared memory (no FUTEX_PRIVATE_FLAG: the waiters live in other processes). Sleeps
// while *word == expected, at most `timeout` (returns at once for a non-positive one); a
// spurious or early return is harmless: every caller re-checks its condition.
void futex_wait(std::uint32_t* word, std::uint32_t expected, std::chrono::nanoseconds timeout);
void futex_wake_all(std::uint32_t* word);

// "/proc/<pid>/fd/<fd>" and nothing else.
bool is_descriptor_path(std::string_view path);

// What makes two processes able to share memory by SharedMemory's paths: the same kernel (boot
// id), the same pid namespace, and the same `explicit_host_id` (DDP_HOST_ID: tests give processes
// of one machine different "hosts" with it). "" when it cannot be read (then never share).
std::string shared_memory_domain(const std::string& explicit_host_id);

}  // namespace ddp::net
