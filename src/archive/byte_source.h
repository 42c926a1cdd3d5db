// Where an archive's bytes come from: a regular file read with pread (positional, so reads need
// no shared position and may run from several threads at once) or memory (fuzzing, tests). Every
// read is checked against the size the source had when opened: a read past it, or a file that
// shrank meanwhile, is a FormatError (kDamaged), never a short read. Internal to the archive
// layer.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace ddp::archive {

class ByteSource {
 public:
  // Throws ConfigError: missing, unreadable, a directory, not a regular file.
  static std::unique_ptr<ByteSource> open(const std::filesystem::path& path);
  // The `length` bytes of the file at `path` from `offset`, read as if they were the whole file
  // (what a container of several archives, such as PyTorch's distributed checkpoint data files,
  // holds). Throws ConfigError as open does, and FormatError (kDamaged) where the range reaches
  // past the file's end (a truncated file).
  static std::unique_ptr<ByteSource> open_range(const std::filesystem::path& path,
                                                std::uint64_t offset, std::uint64_t length);
  explicit ByteSource(std::string bytes);
  ~ByteSource();
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  std::uint64_t size() const { return size_; }
  // Reads [offset, offset + n) into `out`. Thread-safe.
  void read(std::uint64_t offset, void* out, std::size_t n) const;
  std::vector<unsigned char> read(std::uint64_t offset, std::size_t n) const;

 private:
  ByteSource(int fd, std::uint64_t base, std::uint64_t size, std::string path);

  int fd_ = -1;
  std::string memory_;
  std::uint64_t base_ = 0;  // where the bytes start in the file (open_range)
  std::uint64_t size_ = 0;
  std::string path_;
};

}  // namespace ddp::archive
