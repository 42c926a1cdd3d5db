// Argument checks shared by the backends (internal): every backend rejects the same bad calls
// with the same ConfigError text, before anything is queued.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "ddp/comm/types.h"

namespace ddp::comm {

// `p` may be null only when `count` is 0. `name` says which buffer ("send", "recv").
void check_buffer(const void* p, std::size_t count, const char* op, const char* name);
// `r` must be a rank of a group of `size` ranks called `group`. `name` says which ("root", "dst").
void check_rank(int r, int size, const std::string& group, const char* op, const char* name);
// As check_rank, and `r` must not be `self` (point to point needs another rank).
void check_peer(int r, int self, int size, const std::string& group, const char* op,
                const char* name);

// new_group's rank list: not empty, ranks of the group, sorted and unique.
void check_subgroup_ranks(const std::vector<int>& ranks, int size, const std::string& group);

// `dtype` and `op` must be values of their enums (a cast from a bad integer is caught here).
void check_enums(const char* op_name, DType dtype, std::optional<ReduceOp> op);

}  // namespace ddp::comm
