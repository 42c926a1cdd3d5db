#include "ddprun/log_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "ddp/error.h"

namespace ddp::ddprun {
namespace {

namespace fs = std::filesystem;

void create_folder(const fs::path& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) {
    throw ConfigError(fmt::format(
        "--log-dir: cannot create the folder '{}': {}; give a --log-dir this user can write",
        path.string(), ec.message()));
  }
}

}  // namespace

LogDir::LogDir(const std::string& root, const std::string& run_id) {
  if (root.empty()) throw ConfigError("--log-dir is empty; give a folder");
  std::error_code ec;
  fs::path absolute = fs::absolute(root, ec);
  if (ec) absolute = root;
  run_dir_ = (absolute.lexically_normal() / run_id).string();
}

std::string LogDir::attempt_dir(int attempt) const {
  return fmt::format("{}/attempt_{}", run_dir_, attempt);
}

std::string LogDir::rank_dir(int attempt, int rank) const {
  return fmt::format("{}/{}", attempt_dir(attempt), rank);
}

void LogDir::check_writable() const {
  create_folder(run_dir_);
  const std::string probe = fmt::format("{}/.ddprun-write-test-{}", run_dir_, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw ConfigError(
        fmt::format("--log-dir: cannot write in '{}': {}; give a --log-dir this user can write",
                    run_dir_, std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

int LogDir::open_file(int attempt, int rank, const std::string& name) const {
  const std::string folder = rank_dir(attempt, rank);
  create_folder(folder);
  const std::string path = folder + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw ConfigError(
        fmt::format("--log-dir: cannot open '{}' for writing: {}", path, std::strerror(errno)));
  }
  return fd;
}

}  // namespace ddp::ddprun
