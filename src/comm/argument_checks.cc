#include "comm/argument_checks.h"

#include <cstdint>

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

void check_subgroup_ranks(const std::vector<int>& ranks, int size, const std::string& group) {
  if (ranks.empty()) {
    throw ConfigError(fmt::format("new_group on group '{}': the rank list is empty", group));
  }
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    check_rank(ranks[i], size, group, "new_group", "rank");
    if (i > 0 && ranks[i] <= ranks[i - 1]) {
      throw ConfigError(
          fmt::format("new_group on group '{}': ranks must be sorted and unique, got {} after {}",
                      group, ranks[i], ranks[i - 1]));
    }
  }
}

void check_enums(const char* op_name, DType dtype, std::optional<ReduceOp> op) {
  if (static_cast<std::uint8_t>(dtype) > static_cast<std::uint8_t>(DType::kInt64)) {
    throw ConfigError(fmt::format("{}: invalid DType value {}", op_name, static_cast<int>(dtype)));
  }
  if (op && static_cast<std::uint8_t>(*op) > static_cast<std::uint8_t>(ReduceOp::kBxor)) {
    throw ConfigError(fmt::format("{}: invalid ReduceOp value {}", op_name, static_cast<int>(*op)));
  }
  if (op && is_bitwise(*op) && !is_integer(dtype)) {
    throw ConfigError(fmt::format(
        "{}: reduce op {} is bitwise and needs an integer dtype (int8, uint8, int32, int64), not "
        "{}; reduce floating-point values with sum, avg, min, max or product",
        op_name, to_string(*op), to_string(dtype)));
  }
}

}  // namespace ddp::comm
