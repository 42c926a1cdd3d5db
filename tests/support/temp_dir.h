// TempDir: a fresh directory under the system's temporary directory (mkdtemp), removed with
// everything in it by the destructor. For files one test writes: stores, checkpoints, datasets.
//
//   TempDir dir("ddp-checkpoint-test");
//   write(dir / "model.pt");
#pragma once

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ddp::test {

class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "ddp-test") {
    std::string pattern =
        (std::filesystem::temp_directory_path() / (std::string(prefix) + "-XXXXXX")).string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::runtime_error("mkdtemp failed for " + pattern);
    }
    path_ = pattern;
  }
  // nftw, not std::filesystem::remove_all: PyPI's libtorch.so of PyTorch 2.11 exports its own
  // std::filesystem, whose remove_all calls through a null pointer, and a test program must not
  // depend on which copy its link binds to (the GPU machine's crashed in this destructor;
  // docs/gpu.md). Gpu.StdFilesystemRemoveAllBindsToLibstdcxxBesideLibtorch checks that alone.
  ~TempDir() {
    ::nftw(
        path_.c_str(),
        [](const char* entry, const struct stat*, int, struct FTW*) { return ::remove(entry); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace ddp::test
