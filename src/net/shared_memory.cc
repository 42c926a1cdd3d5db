#include "net/shared_memory.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <fstream>
#include <random>
#include <utility>

#include <fmt/format.h>

#include "ddp/error.h"
#include "net/descriptors.h"

namespace ddp::net {
namespace {

// Its size can no longer change: nobody can shrink it under a peer's mapping (SIGBUS), and the
// peers check these seals to know they opened such memory, not some other file.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// Closes a descriptor and unmaps a mapping that a failed make() or open() leaves.
struct Guard {
  int fd = -1;
  void* mapping = nullptr;
  std::size_t bytes = 0;
  ~Guard() {
    if (fd >= 0) ::close(fd);
    if (mapping != nullptr) ::munmap(mapping, bytes);
  }
};

bool digits(std::string_view text) {
  return !text.empty() && text.size() <= 10 &&
         std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

void futex_wait(std::uint32_t* word, std::uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout <= std::chrono::nanoseconds::zero()) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::uint32_t* word) {
  ::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

bool is_descriptor_path(std::string_view path) {
  if (!path.starts_with("/proc/")) return false;
  path.remove_prefix(6);
  const auto slash = path.find("/fd/");
  return slash != std::string_view::npos && digits(path.substr(0, slash)) &&
         digits(path.substr(slash + 4));
}

SharedMemory::~SharedMemory() {
  close_descriptor();
  if (data_ != nullptr) ::munmap(data_, bytes_);
}

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)) {}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    SharedMemory old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

void SharedMemory::close_descriptor() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  path_.clear();
}

SharedMemory SharedMemory::make(const std::string& name, std::size_t bytes) {
  if (bytes == 0) throw ConfigError("shared memory: cannot make 0 bytes");
  std::random_device random;
  const std::string full = fmt::format("{}-{}-{:08x}", name, ::getpid(), random());
  Guard guard;
  guard.fd = ::memfd_create(full.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (guard.fd < 0) {
    throw Error(fmt::format("memfd_create({}) failed: {}", full, system_error_text(errno)));
  }
  const int err = ::posix_fallocate(guard.fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    throw Error(
        fmt::format("cannot reserve {} bytes of shared memory: {}", bytes, system_error_text(err)));
  }
  if (::fcntl(guard.fd, F_ADD_SEALS, kSeals) != 0) {
    throw Error(fmt::format("sealing shared memory failed: {}", system_error_text(errno)));
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, guard.fd, 0);
  if (mapping == MAP_FAILED) {
    throw Error(fmt::format("mapping {} bytes of shared memory failed: {}", bytes,
                            system_error_text(errno)));
  }
  SharedMemory memory;
  memory.data_ = static_cast<std::byte*>(mapping);
  memory.bytes_ = bytes;
  memory.fd_ = std::exchange(guard.fd, -1);
  memory.path_ = fmt::format("/proc/{}/fd/{}", ::getpid(), memory.fd_);
  return memory;
}

SharedMemory SharedMemory::open(const std::string& path, std::size_t bytes) {
  if (!is_descriptor_path(path)) {
    throw Error(
        fmt::format("'{}' is not a path of the form /proc/<pid>/fd/<fd>", path.substr(0, 80)));
  }
  // Before opening: a path of this form may name a pipe, a socket or a device of some process,
  // and opening some of those does something.
  struct stat before {};
  if (::stat(path.c_str(), &before) != 0) {
    throw Error(
        fmt::format("cannot find {}: {} (its maker exited or closed it, or this process "
                    "may not read its /proc entries)",
                    path, system_error_text(errno)));
  }
  if (!S_ISREG(before.st_mode)) throw Error(fmt::format("{} is not shared memory", path));
  Guard guard;
  guard.fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (guard.fd < 0) {
    throw Error(fmt::format("cannot open {}: {}", path, system_error_text(errno)));
  }
  struct stat st {};
  const int seals = ::fcntl(guard.fd, F_GET_SEALS);
  if (::fstat(guard.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_ino != before.st_ino ||
      seals < 0 || (seals & kSeals) != kSeals) {
    throw Error(fmt::format("{} is not sealed shared memory", path));
  }
  if (static_cast<std::size_t>(st.st_size) != bytes) {
    throw Error(fmt::format("{} has {} bytes, not the {} expected", path,
                            static_cast<long long>(st.st_size), bytes));
  }
  void* mapping = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, guard.fd, 0);
  if (mapping == MAP_FAILED) {
    throw Error(fmt::format("mapping {} failed: {}", path, system_error_text(errno)));
  }
  SharedMemory memory;
  memory.data_ = static_cast<std::byte*>(mapping);
  memory.bytes_ = bytes;
  return memory;  // the descriptor closes with the guard: the mapping keeps the memory
}

std::string shared_memory_domain(const std::string& explicit_host_id) {
  std::string boot;
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot);
  char pidns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", pidns, sizeof pidns - 1);
  if (boot.empty() || n <= 0) return {};
  return fmt::format("{}|{}|{}", boot, std::string_view(pidns, static_cast<std::size_t>(n)),
                     explicit_host_id);
}

}  // namespace ddp::net
