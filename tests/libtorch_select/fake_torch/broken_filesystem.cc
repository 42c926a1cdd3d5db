// Stands in for PyPI's libtorch.so of PyTorch 2.11, which defines and exports its own copy of
// std::filesystem, whose remove_all(path, error_code&) calls through a null pointer. This copy
// says that it was called and aborts: a program linked through ddp::libtorch must find
// libstdc++'s remove_all first (cmake/DdpFindTorch.cmake).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace std::filesystem {
std::uintmax_t remove_all(const path& target, std::error_code&) {
  std::fprintf(stderr, "remove_all(%s) bound to the library's copy, not libstdc++'s\n",
               target.c_str());
  std::abort();
}
}  // namespace std::filesystem
