// ByteSource (byte_source.h).
#include "archive/byte_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "archive/archive_error.h"

namespace ddp::archive {

std::unique_ptr<ByteSource> ByteSource::open(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw ConfigError(
        fmt::format("{}: cannot open the file to read: {}", path.string(), std::strerror(errno)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int error = errno;
    ::close(fd);
    throw ConfigError(fmt::format("{}: {}", path.string(),
                                  S_ISDIR(st.st_mode) ? "a directory, not a file"
                                  : error != 0        ? std::strerror(error)
                                                      : "not a regular file"));
  }
  return std::unique_ptr<ByteSource>(
      new ByteSource(fd, 0, static_cast<std::uint64_t>(st.st_size), path.string()));
}

std::unique_ptr<ByteSource> ByteSource::open_range(const std::filesystem::path& path,
                                                   std::uint64_t offset, std::uint64_t length) {
  std::unique_ptr<ByteSource> whole = open(path);
  if (offset > whole->size_ || length > whole->size_ - offset) {
    throw FormatError(FormatError::Kind::kDamaged,
                      fmt::format("{}: the range of {} bytes at byte {} reaches past the end of "
                                  "the {}-byte file (truncated?)",
                                  path.string(), length, offset, whole->size_));
  }
  whole->base_ = offset;
  whole->size_ = length;
  return whole;
}

ByteSource::ByteSource(std::string bytes) : memory_(std::move(bytes)), size_(memory_.size()) {}

ByteSource::ByteSource(int fd, std::uint64_t base, std::uint64_t size, std::string path)
    : fd_(fd), base_(base), size_(size), path_(std::move(path)) {}

ByteSource::~ByteSource() {
  if (fd_ >= 0) ::close(fd_);
}

void ByteSource::read(std::uint64_t offset, void* out, std::size_t n) const {
  if (offset > size_ || n > size_ - offset) {
    throw FormatError(FormatError::Kind::kDamaged,
                      fmt::format("a read of {} bytes at byte {} reaches past the end of the "
                                  "{}-byte file",
                                  n, offset, size_));
  }
  if (n == 0) return;  // `out` may be null then (an empty vector's data), which memcpy forbids
  if (fd_ < 0) {
    std::memcpy(out, memory_.data() + offset, n);
    return;
  }
  auto* to = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = ::pread(fd_, to, n, static_cast<off_t>(base_ + offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw ConfigError(
          fmt::format("{}: cannot read at byte {}: {}", path_, offset, std::strerror(errno)));
    }
    if (got == 0) {
      throw FormatError(FormatError::Kind::kDamaged,
                        fmt::format("the file ended at byte {}, though it was {} bytes when "
                                    "opened (changed while being read?)",
                                    offset, size_));
    }
    to += got;
    offset += static_cast<std::uint64_t>(got);
    n -= static_cast<std::size_t>(got);
  }
}

std::vector<unsigned char> ByteSource::read(std::uint64_t offset, std::size_t n) const {
  std::vector<unsigned char> bytes(n);
  read(offset, bytes.data(), n);
  return bytes;
}

}  // namespace ddp::archive
