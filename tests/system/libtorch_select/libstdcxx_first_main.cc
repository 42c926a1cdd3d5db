// Linked through ddp::libtorch and against a library that exports a broken std::filesystem (as
// PyTorch 2.11's libtorch.so does): removes a folder tree, which must work (exit 0, "removed 3").
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

int main() {
  const auto root = std::filesystem::temp_directory_path() /
                    ("ddp-libstdcxx-first-" + std::to_string(::getpid()));
  std::filesystem::create_directories(root / "a" / "b");
  std::error_code error;
  const auto removed = std::filesystem::remove_all(root, error);
  std::printf("removed %ju (%s)\n", static_cast<std::uintmax_t>(removed), error.message().c_str());
  return removed == 3 && !error && !std::filesystem::exists(root) ? 0 : 1;
}
