// The unique-id exchange of the nccl backend (see nccl_unique_id.h).
#include "comm/nccl/nccl_unique_id.h"

#include <algorithm>
#include <exception>
#include <span>
#include <vector>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"

namespace ddp::comm::nccl {
namespace {

// The value's first byte says what follows: the id, or rank 0's error text.
constexpr std::uint8_t kId = 'I';
constexpr std::uint8_t kFailure = 'E';

CommError setup_error(CommErrorKind kind, const std::string& group, int rank,
                      const std::string& what) {
  return CommError(kind, fmt::format("rank {} of group '{}' (nccl backend): {}", rank, group, what),
                   group, "setting up the NCCL communicator", 0, 0);
}

}  // namespace

std::string next_setup_prefix(Store& store, const std::string& group, int size) {
  const std::int64_t joined = store.add(fmt::format("nccl/{}/joins", group), 1);
  return fmt::format("nccl/{}/{}/", group, (joined - 1) / std::max(size, 1));
}

UniqueIdBytes exchange_unique_id(Store& store, const std::string& prefix, const std::string& group,
                                 int rank, const UniqueIdGenerator& generate,
                                 net::Deadline deadline) {
  const std::string key = prefix + "unique_id";
  if (rank == 0) {
    UniqueIdBytes id{};
    try {
      id = generate();
    } catch (const std::exception& e) {
      const std::string text = e.what();
      std::vector<std::uint8_t> value{kFailure};
      value.insert(value.end(), text.begin(), text.end());
      try {
        store.set(key, std::span<const std::uint8_t>(value));
      } catch (const std::exception&) {
        // Best effort: the peers then wait for their deadline.
      }
      throw;
    }
    std::vector<std::uint8_t> value{kId};
    value.insert(value.end(), id.begin(), id.end());
    store.set(key, std::span<const std::uint8_t>(value));
    return id;
  }
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - net::Clock::now());
  Bytes value;
  try {
    value = store.get(key, std::max(left, std::chrono::milliseconds(1)));
  } catch (const TimeoutError&) {
    throw setup_error(
        CommErrorKind::kTimeout, group, rank,
        fmt::format("rank 0 did not publish the NCCL unique id (store key '{}') within {} ms: "
                    "rank 0 has not reached the group's creation (it is slower, stuck, or gone)",
                    key, std::max<long long>(left.count(), 0)));
  }
  if (!value.empty() && value[0] == kFailure) {
    throw setup_error(CommErrorKind::kSetup, group, rank,
                      fmt::format("rank 0 could not create the NCCL unique id: {}",
                                  std::string(value.begin() + 1, value.end())));
  }
  if (value.size() != 1 + kUniqueIdBytes || value[0] != kId) {
    throw setup_error(CommErrorKind::kSetup, group, rank,
                      fmt::format("the NCCL unique id under store key '{}' is malformed ({} bytes, "
                                  "expected {}): another program uses this group name in the store",
                                  key, value.size(), 1 + kUniqueIdBytes));
  }
  UniqueIdBytes id{};
  std::copy(value.begin() + 1, value.end(), id.begin());
  return id;
}

}  // namespace ddp::comm::nccl
