// FileStore: a Store on a shared directory, for multi-process tests that want no server.
//
// Each key is a file (named by the key's hex encoding); set writes a temporary file and renames
// it into place, so readers see whole values; get/wait poll until the file exists or the deadline
// passes. add and compare_set take an flock on the directory's lock file, so they are atomic
// across processes. Thread-safe (no shared state but the directory). Test fixture only.
#pragma once

#include "support/temp_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "ddp/error.h"
#include "ddp/store/store.h"

namespace ddp::test {

class FileStore : public Store {
 public:
  explicit FileStore(std::filesystem::path dir, Milliseconds timeout = std::chrono::seconds(30))
      : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
    set_timeout(timeout);
  }

  void set(std::string_view key, std::span<const std::uint8_t> value) override {
    write(key, value);
  }
  using Store::set;

  Bytes get(std::string_view key, Milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (auto value = read(key)) return *value;
      if (std::chrono::steady_clock::now() >= deadline) {
        throw TimeoutError(
            fmt::format("FileStore: key '{}' not set within {} ms", key, timeout.count()));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }

  std::int64_t add(std::string_view key, std::int64_t delta) override {
    Lock lock(dir_);
    std::int64_t value = 0;
    if (auto old = read(key)) value = std::stoll(std::string(old->begin(), old->end()));
    value += delta;
    const std::string text = std::to_string(value);
    write(key, {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()});
    return value;
  }

  Bytes compare_set(std::string_view key, std::span<const std::uint8_t> expected,
                    std::span<const std::uint8_t> desired) override {
    Lock lock(dir_);
    const auto current = read(key);
    const Bytes now = current.value_or(Bytes{});
    if ((!current && expected.empty()) ||
        (current && Bytes(expected.begin(), expected.end()) == *current)) {
      write(key, desired);
      return Bytes(desired.begin(), desired.end());
    }
    return now;
  }

  bool check(std::span<const std::string> keys) override {
    for (const auto& key : keys) {
      if (!std::filesystem::exists(path(key))) return false;
    }
    return true;
  }

  void wait(std::span<const std::string> keys, Milliseconds timeout) override {
    for (const auto& key : keys)
      get(key, timeout);
  }

  bool delete_key(std::string_view key) override { return std::filesystem::remove(path(key)); }

  std::int64_t num_keys() override {
    std::int64_t n = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      if (entry.path().extension() == ".key") ++n;
    }
    return n;
  }

 private:
  struct Lock {
    explicit Lock(const std::filesystem::path& dir)
        : fd(::open((dir / "lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600)) {
      ::flock(fd, LOCK_EX);
    }
    ~Lock() {
      ::flock(fd, LOCK_UN);
      ::close(fd);
    }
    int fd;
  };

  std::filesystem::path path(std::string_view key) const {
    std::string name;
    for (unsigned char c : key)
      name += fmt::format("{:02x}", c);
    return dir_ / (name + ".key");
  }

  std::optional<Bytes> read(std::string_view key) const {
    std::ifstream in(path(key), std::ios::binary);
    if (!in) return std::nullopt;
    return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  void write(std::string_view key, std::span<const std::uint8_t> value) {
    const auto final_path = path(key);
    const auto temp =
        final_path.string() + fmt::format(".tmp{}.{}", ::getpid(),
                                          std::hash<std::thread::id>{}(std::this_thread::get_id()));
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(value.data()),
                static_cast<std::streamsize>(value.size()));
    }
    std::filesystem::rename(temp, final_path);
  }

  std::filesystem::path dir_;
};

}  // namespace ddp::test
