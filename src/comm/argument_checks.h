// Argument checks shared by the backends (internal): every backend rejects the same bad calls
// with the same ConfigError text, before anything is queued.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "ddp/types.h"

namespace ddp::comm {

// `p` may be null only when `count` is 0. `name` says which buffer ("send", "recv").
void check_buffer(const void* p, std::size_t count, const char* op, const char* name);
// `r` must be a rank of a group of `size` ranks called `group`. `name` says which ("root", "dst").
void check_rank(int r, int size, const std::string& group, const char* op, const char* name);
// As check_rank, and `r` must not be `self` (point to point needs another rank).
void check_peer(int r, int self, int size, const std::string& group, const char* op,
                const char* name);

// `dtype` and `op` must be values of their enums (a cast from a bad integer is caught here).
void check_enums(const char* op_name, DType dtype, std::optional<ReduceOp> op);

}  // namespace ddp::comm
