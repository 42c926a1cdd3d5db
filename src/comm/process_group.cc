#include "ddp/comm/process_group.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/argument_checks.h"
#include "ddp/error.h"

namespace ddp {
namespace {

// FNV-1a over the counts: ranks compare one word instead of the whole vector.
std::int64_t fingerprint(const std::vector<std::size_t>& counts) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t c : counts) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= (static_cast<std::uint64_t>(c) >> (8 * byte)) & 0xff;
      h *= 1099511628211ULL;
    }
  }
  return static_cast<std::int64_t>(h);
}

void check_counts_length(const std::vector<std::size_t>& counts, int size, const char* op,
                         const char* name) {
  if (counts.size() != static_cast<std::size_t>(size)) {
    throw ConfigError(fmt::format("{}: {} has {} entries; it needs one per rank of the group ({})",
                                  op, name, counts.size(), size));
  }
}

std::size_t total(const std::vector<std::size_t>& counts) {
  return std::accumulate(counts.begin(), counts.end(), std::size_t{0});
}

using Copier = std::function<void(void* dst, const void* src, std::size_t bytes)>;

// Copies block j (counts[j] elements) of a buffer of padded blocks into place, after the padded
// collective succeeded (through the group's copy_bytes: its buffers may be device memory).
void unpad(const Copier& copier, const std::byte* padded, std::size_t block_bytes, void* out,
           const std::vector<std::size_t>& counts, std::size_t element_bytes) {
  std::size_t at = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    const std::size_t bytes = counts[j] * element_bytes;
    if (bytes > 0) copier(static_cast<std::byte*>(out) + at, padded + j * block_bytes, bytes);
    at += bytes;
  }
}

// Lays `counts` consecutive blocks of `in` out at a stride of `block_bytes` in `padded` (which
// holds at least counts.size() blocks; the gaps keep what they held).
void pad(const Copier& copier, std::byte* padded, const void* in,
         const std::vector<std::size_t>& counts, std::size_t block_bytes,
         std::size_t element_bytes) {
  std::size_t at = 0;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    const std::size_t bytes = counts[j] * element_bytes;
    if (bytes > 0) copier(padded + j * block_bytes, static_cast<const std::byte*>(in) + at, bytes);
    at += bytes;
  }
}

bool all_equal(const std::vector<std::size_t>& counts) {
  return std::adjacent_find(counts.begin(), counts.end(), std::not_equal_to<>()) == counts.end();
}

}  // namespace

ProcessGroup::ProcessGroup(int rank, int size)
    : rank_(rank), size_(size), world_ranks_(static_cast<std::size_t>(size > 0 ? size : 0)) {
  std::iota(world_ranks_.begin(), world_ranks_.end(), 0);
}

int ProcessGroup::local_rank() const {
  throw ConfigError(fmt::format(
      "the {} backend does not know which ranks share a host (local_rank); pass the local rank "
      "explicitly (e.g. new_subgroups with a group size)",
      backend()));
}

int ProcessGroup::local_size() const {
  throw ConfigError(fmt::format(
      "the {} backend does not know which ranks share a host (local_size); pass the group size "
      "explicitly (e.g. new_subgroups with a group size)",
      backend()));
}

// Every rank contributes `mine` (the same length on every rank) and gets every rank's, waiting for
// it: the size exchange of the uneven collectives. Its int64 words are compared, never reduced.
std::shared_ptr<Work> ProcessGroup::recv_any_source(void* buf, std::size_t count, DType dtype,
                                                    int* source, int tag, CallOptions options) {
  static_cast<void>(buf);
  static_cast<void>(count);
  static_cast<void>(dtype);
  static_cast<void>(source);
  static_cast<void>(tag);
  static_cast<void>(options);
  throw ConfigError(fmt::format(
      "recv_any_source: the {} backend cannot receive from any source (the ring and mpi "
      "backends can); name the sender with recv(..., src, ...)",
      backend()));
}

std::shared_ptr<void> ProcessGroup::allocate_shared_buffer(std::size_t bytes,
                                                           std::string* why_not) {
  static_cast<void>(bytes);
  if (why_not != nullptr) why_not->clear();
  return nullptr;
}

std::vector<std::int64_t> ProcessGroup::exchange_words(const std::vector<std::int64_t>& mine,
                                                       CallOptions options) {
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size()));
  allgather(mine.data(), all.data(), mine.size(), DType::kInt64, options)->wait();
  return all;
}

std::shared_ptr<void> ProcessGroup::make_scratch(std::size_t bytes) {
  auto buffer = std::make_shared<std::vector<std::byte>>(bytes);
  return std::shared_ptr<void>(buffer, buffer->data());
}

ProcessGroup::BlockCopier ProcessGroup::block_copier(const CallOptions& options) {
  static_cast<void>(options);
  return [](void* dst, const void* src, std::size_t bytes) { std::memcpy(dst, src, bytes); };
}

// Cost: one allgather of 2 words per rank (waited for), then one allgather of size() blocks of
// max(recv_counts) elements (padding only when the counts differ).
std::shared_ptr<Work> ProcessGroup::allgather_v(const void* send, std::size_t send_count,
                                                void* recv, std::vector<std::size_t> recv_counts,
                                                DType dtype, CallOptions options) {
  comm::check_enums("allgather_v", dtype, std::nullopt);
  check_counts_length(recv_counts, size(), "allgather_v", "recv_counts");
  comm::check_buffer(send, send_count, "allgather_v", "send");
  comm::check_buffer(recv, total(recv_counts), "allgather_v", "recv");
  const auto words =
      exchange_words({static_cast<std::int64_t>(send_count), fingerprint(recv_counts)}, options);
  // Every rank judges the same words, so every rank reaches the same verdict.
  std::vector<std::size_t> sent(static_cast<std::size_t>(size()));
  bool same_view = true;
  for (std::size_t r = 0; r < sent.size(); ++r) {
    sent[r] = static_cast<std::size_t>(words[2 * r]);
    same_view = same_view && words[2 * r + 1] == words[1];
  }
  if (!same_view || sent != recv_counts) {
    throw ConfigError(fmt::format(
        "allgather_v: the ranks disagree on the counts: the ranks send {} elements, this rank "
        "(rank {}) expected recv_counts {}{}; pass every rank's send count, the same on every rank",
        fmt::join(sent, ", "), rank(), fmt::join(recv_counts, ", "),
        same_view ? "" : " (and the ranks' recv_counts differ)"));
  }
  if (all_equal(recv_counts)) {
    return allgather(send, recv, recv_counts.empty() ? 0 : recv_counts[0], dtype, options);
  }
  const std::size_t esz = dtype_size(dtype);
  const std::size_t block = *std::max_element(recv_counts.begin(), recv_counts.end());
  auto padded = make_scratch(block * esz * (recv_counts.size() + 1));
  auto* base = static_cast<std::byte*>(padded.get());
  auto copier = block_copier(options);
  // The first block is this rank's padded input, the rest the gathered blocks.
  if (send_count > 0) copier(base, send, send_count * esz);
  std::byte* gathered = base + block * esz;
  auto work = allgather(base, gathered, block, dtype, options);
  work->then([padded, gathered, recv, counts = std::move(recv_counts), block, esz,
              copier](Work& done) mutable {
    if (!done.error()) unpad(copier, gathered, block * esz, recv, counts, esz);
  });
  return work;
}

// Cost: one allgather of 2 x size() words per rank (waited for), then one alltoall of blocks of
// the largest count any rank sends to any rank.
std::shared_ptr<Work> ProcessGroup::alltoall_v(const void* send,
                                               std::vector<std::size_t> send_counts, void* recv,
                                               std::vector<std::size_t> recv_counts, DType dtype,
                                               CallOptions options) {
  comm::check_enums("alltoall_v", dtype, std::nullopt);
  check_counts_length(send_counts, size(), "alltoall_v", "send_counts");
  check_counts_length(recv_counts, size(), "alltoall_v", "recv_counts");
  comm::check_buffer(send, total(send_counts), "alltoall_v", "send");
  comm::check_buffer(recv, total(recv_counts), "alltoall_v", "recv");
  const auto n = static_cast<std::size_t>(size());
  std::vector<std::int64_t> mine(2 * n);
  for (std::size_t j = 0; j < n; ++j) {
    mine[j] = static_cast<std::int64_t>(send_counts[j]);
    mine[n + j] = static_cast<std::int64_t>(recv_counts[j]);
  }
  // words[r * 2n + j]: what r sends to j; words[r * 2n + n + j]: what r expects from j.
  const auto words = exchange_words(mine, options);
  std::vector<std::string> disagreements;
  std::size_t block = 0;
  for (std::size_t r = 0; r < n; ++r) {
    for (std::size_t j = 0; j < n; ++j) {
      const auto sends = words[j * 2 * n + r];
      const auto expects = words[r * 2 * n + n + j];
      block = std::max(block, static_cast<std::size_t>(sends));
      if (sends != expects && disagreements.size() < 8) {
        disagreements.push_back(
            fmt::format("rank {} sends {} to rank {}, which expects {}", j, sends, r, expects));
      }
    }
  }
  if (!disagreements.empty()) {
    throw ConfigError(fmt::format(
        "alltoall_v: the split sizes differ across ranks: {} (rank {}); recv_counts[j] on rank r "
        "must equal send_counts[r] on rank j",
        fmt::join(disagreements, "; "), rank()));
  }
  if (all_equal(send_counts) && all_equal(recv_counts) && send_counts == recv_counts &&
      send_counts[0] == block) {
    return alltoall(send, recv, block, dtype, options);
  }
  const std::size_t esz = dtype_size(dtype);
  auto padded = make_scratch(block * esz * n);
  auto out = make_scratch(block * esz * n);
  auto copier = block_copier(options);
  pad(copier, static_cast<std::byte*>(padded.get()), send, send_counts, block * esz, esz);
  auto work = alltoall(padded.get(), out.get(), block, dtype, options);
  work->then(
      [padded, out, recv, counts = std::move(recv_counts), block, esz, copier](Work& done) mutable {
        if (!done.error())
          unpad(copier, static_cast<const std::byte*>(out.get()), block * esz, recv, counts, esz);
      });
  return work;
}

// Cost: one allgather of 1 word per rank (waited for), then one reduce_scatter of blocks of
// max(recv_counts) elements.
std::shared_ptr<Work> ProcessGroup::reduce_scatter_v(const void* send, void* recv,
                                                     std::vector<std::size_t> recv_counts,
                                                     DType dtype, ReduceOp op,
                                                     CallOptions options) {
  comm::check_enums("reduce_scatter_v", dtype, op);
  check_counts_length(recv_counts, size(), "reduce_scatter_v", "recv_counts");
  comm::check_buffer(send, total(recv_counts), "reduce_scatter_v", "send");
  comm::check_buffer(recv, recv_counts[static_cast<std::size_t>(rank())], "reduce_scatter_v",
                     "recv");
  const auto words = exchange_words({fingerprint(recv_counts)}, options);
  std::vector<int> differing;
  for (std::size_t r = 0; r < words.size(); ++r) {
    if (words[r] != words[static_cast<std::size_t>(rank())])
      differing.push_back(static_cast<int>(r));
  }
  if (!differing.empty()) {
    throw ConfigError(fmt::format(
        "reduce_scatter_v: the ranks pass different recv_counts: ranks {} differ from rank {} "
        "(which has {}); pass the same counts on every rank",
        fmt::join(differing, ", "), rank(), fmt::join(recv_counts, ", ")));
  }
  if (all_equal(recv_counts)) {
    return reduce_scatter(send, recv, recv_counts[0], dtype, op, options);
  }
  const std::size_t esz = dtype_size(dtype);
  const std::size_t block = *std::max_element(recv_counts.begin(), recv_counts.end());
  auto padded = make_scratch(block * esz * recv_counts.size());
  auto out = make_scratch(block * esz);
  auto copier = block_copier(options);
  pad(copier, static_cast<std::byte*>(padded.get()), send, recv_counts, block * esz, esz);
  auto work = reduce_scatter(padded.get(), out.get(), block, dtype, op, options);
  const std::size_t mine = recv_counts[static_cast<std::size_t>(rank())];
  work->then([padded, out, recv, mine, esz, copier](Work& done) mutable {
    if (!done.error() && mine > 0) copier(recv, out.get(), mine * esz);
  });
  return work;
}

// The portable allreduce_segments: pack, allreduce the packed buffer, unpack on success. The
// unpacking is a completion callback, so it has run when wait() returns.
std::shared_ptr<Work> ProcessGroup::allreduce_segments(std::vector<BufferSegment> segments,
                                                       DType dtype, ReduceOp op,
                                                       CallOptions options) {
  comm::check_enums("allreduce_segments", dtype, op);
  std::size_t total = 0;
  for (const auto& segment : segments) {
    comm::check_buffer(segment.data, segment.count, "allreduce_segments", "segment");
    total += segment.count;
  }
  const std::size_t element_bytes = dtype_size(dtype);
  auto packed = std::make_shared<std::vector<std::byte>>(total * element_bytes);
  std::size_t offset = 0;
  for (const auto& segment : segments) {
    if (segment.count == 0) continue;
    std::memcpy(packed->data() + offset, segment.data, segment.count * element_bytes);
    offset += segment.count * element_bytes;
  }
  auto work = allreduce(packed->data(), total, dtype, op, options);
  work->then([packed, segments = std::move(segments), element_bytes](Work& done) {
    if (done.error()) return;
    std::size_t at = 0;
    for (const auto& segment : segments) {
      if (segment.count == 0) continue;
      std::memcpy(segment.data, packed->data() + at, segment.count * element_bytes);
      at += segment.count * element_bytes;
    }
  });
  return work;
}

}  // namespace ddp
