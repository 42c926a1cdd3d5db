// What the files of ShmDomain share (internal to shm/): the type of the mapping, its per-rank
// controls, and how messages name a rank.
#pragma once

#include <cstddef>
#include <string>

#include <fmt/format.h>

#include "comm/ring/shm/segment.h"
#include "comm/ring/shm/shm_domain.h"

namespace ddp::comm::shm {

struct ShmDomain::Segment {
  SegmentHeader header;
  // RankControl x size follows at Layout::control_offset.
};

inline RankControl* controls(ShmDomain::Segment* segment) {
  return controls_of(&segment->header);
}

// How messages name domain rank `r`: its rank in the enclosing group, with the domain's own
// number when that differs ("3 (local 1)"), so that errors of a multi-host job name the ranks
// users know.
inline std::string rank_number(const ShmOptions& options, int r) {
  if (options.ranks.empty()) return std::to_string(r);
  const int global = options.ranks[static_cast<std::size_t>(r)];
  return global == r ? std::to_string(r) : fmt::format("{} (local {})", global, r);
}

}  // namespace ddp::comm::shm
