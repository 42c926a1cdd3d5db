#include "comm/argument_checks.h"

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::comm {

void check_buffer(const void* p, std::size_t count, const char* op, const char* name) {
  if (p == nullptr && count > 0) {
    throw ConfigError(fmt::format(
        "{}: the {} buffer is null but count is {}; pass a buffer of at least count elements", op,
        name, count));
  }
}

void check_rank(int r, int size, const std::string& group, const char* op, const char* name) {
  if (r < 0 || r >= size) {
    throw ConfigError(fmt::format("{}: {} {} is not a rank of group '{}' (ranks 0..{})", op, name,
                                  r, group, size - 1));
  }
}

void check_peer(int r, int self, int size, const std::string& group, const char* op,
                const char* name) {
  check_rank(r, size, group, op, name);
  if (r == self) {
    throw ConfigError(fmt::format(
        "{}: {} {} is this rank itself; point-to-point needs another rank", op, name, r));
  }
}

}  // namespace ddp::comm
