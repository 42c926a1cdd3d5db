// Stands in for PyPI's libtorch.so of PyTorch 2.11, which defines and exports its own copy of
// std::filesystem, whose remove_all(path, error_code&) calls through a null pointer. This copy
// says that it was called and aborts: a program linked through ddp::libtorch must find
// libstdc++'s remove_all first (cmake/DdpFindTorch.cmake). Like libtorch's, it also defines the
// other operations the probe uses (working ones), so that a linker that takes libstdc++ from its
// archive finds nothing left to pull from it unless ddp::libtorch puts the archive first.
#include <errno.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace std::filesystem {

std::uintmax_t remove_all(const path& target, std::error_code&) {
  std::fprintf(stderr, "remove_all(%s) bound to the library's copy, not libstdc++'s\n",
               target.c_str());
  std::abort();
}

path temp_directory_path() {
  return "/tmp";
}

bool create_directories(const path& target) {
  std::string prefix;
  for (const auto& part : target) {
    prefix =
        prefix.empty() || prefix == "/" ? prefix + part.string() : prefix + "/" + part.string();
    if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) return false;
  }
  return true;
}

file_status status(const path& target) {
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) return file_status(file_type::not_found);
  return file_status(S_ISDIR(st.st_mode) ? file_type::directory : file_type::regular);
}

}  // namespace std::filesystem
