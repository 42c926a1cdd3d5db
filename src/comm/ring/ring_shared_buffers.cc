// RingProcessGroup::allocate_shared_buffer: the collective that makes a shared buffer (every
// rank's copy mapped by every rank, shm/shared_buffers.h) or, on every rank alike, none.
#include <unistd.h>

#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/ring/ring_group.h"
#include "ddp/error.h"
#include "settings/settings.h"

namespace ddp {

namespace {

const comm::RingProcessGroup* ring_of(const ProcessGroup& group) {
  return dynamic_cast<const comm::RingProcessGroup*>(&group);
}

}  // namespace

long long ring_shared_buffer_allreduces_of(const ProcessGroup& group) {
  const auto* ring = ring_of(group);
  return ring != nullptr ? ring->shared_buffer_allreduces() : -1;
}

long long ring_shared_buffer_reduce_scatters_of(const ProcessGroup& group) {
  const auto* ring = ring_of(group);
  return ring != nullptr ? ring->shared_buffer_reduce_scatters() : -1;
}

long long ring_shared_buffer_allgathers_of(const ProcessGroup& group) {
  const auto* ring = ring_of(group);
  return ring != nullptr ? ring->shared_buffer_allgathers() : -1;
}

namespace comm {
namespace {

// What each rank tells the others, in exchange_words's words.
enum Word : std::size_t { kBytes, kPid, kFd, kWords };

}  // namespace

long long RingProcessGroup::shared_buffer_allreduces() const {
  return mode_ == Mode::kShm && domain_
             ? static_cast<long long>(domain_->shared_buffer_allreduces())
             : 0;
}

long long RingProcessGroup::shared_buffer_reduce_scatters() const {
  return mode_ == Mode::kShm && domain_
             ? static_cast<long long>(domain_->shared_buffer_reduce_scatters())
             : 0;
}

long long RingProcessGroup::shared_buffer_allgathers() const {
  return mode_ == Mode::kShm && domain_
             ? static_cast<long long>(domain_->shared_buffer_allgathers())
             : 0;
}

// Two exchanges, so that every rank decides alike: where each rank's copy can be opened (or that
// it has none), then whether each rank mapped every peer's. A copy's descriptor stays open until
// the second exchange, so no peer can open a reused descriptor number.
std::shared_ptr<void> RingProcessGroup::allocate_shared_buffer(std::size_t bytes,
                                                               std::string* why_not) {
  std::string unused;
  std::string& why = why_not != nullptr ? *why_not : unused;
  why.clear();
  if (mode_ != Mode::kShm || !domain_) return nullptr;  // the same on every rank
  if (bytes == 0) {
    throw ConfigError("allocate_shared_buffer: bytes is 0; ask for at least one byte");
  }
  shm::OwnSharedMemory own;
  std::string mine_failed;  // why this rank has no copy
  const bool turned_off = !settings::shm_shared_buffers();
  if (turned_off) {
    mine_failed = "DDP_SHM_SHARED_BUFFERS=0";
  } else {
    mine_failed = own.create(bytes, "ddp-shm");
  }
  const bool have_copy = mine_failed.empty();
  std::vector<std::int64_t> mine(kWords);
  mine[kBytes] = static_cast<std::int64_t>(bytes);
  // No copy: -1, or -2 when turned off (so that every rank can say so).
  mine[kPid] = have_copy ? ::getpid() : turned_off ? -2 : -1;
  mine[kFd] = have_copy ? own.fd() : -1;
  const auto all = exchange_words(mine, {});
  auto word = [&](int r, Word w) { return all[static_cast<std::size_t>(r) * kWords + w]; };
  for (int r = 0; r < size(); ++r) {
    if (word(r, kBytes) != static_cast<std::int64_t>(bytes)) {
      throw ConfigError(fmt::format(
          "allocate_shared_buffer: rank {} asked for {} bytes and rank {} for {}; every rank must "
          "ask for the same size (do all ranks wrap the same model?)",
          rank(), bytes, r, word(r, kBytes)));
    }
  }
  for (int r = 0; r < size(); ++r) {
    if (word(r, kPid) >= 0) continue;
    why = r == rank() ? fmt::format("rank {} could not make its copy: {}", r, mine_failed)
          : word(r, kPid) == -2
              ? fmt::format("rank {} has DDP_SHM_SHARED_BUFFERS=0", r)
              : fmt::format("rank {} could not make its copy (its log says why)", r);
    return nullptr;
  }

  auto mapping = std::make_shared<shm::SharedBufferMapping>();
  mapping->bytes = bytes;
  mapping->mapped_bytes = own.mapped_bytes();
  mapping->bases.assign(static_cast<std::size_t>(size()), nullptr);
  mapping->bases[static_cast<std::size_t>(rank())] = own.release_mapping();
  std::string map_failed;
  for (int r = 0; r < size() && map_failed.empty(); ++r) {
    if (r == rank()) continue;
    std::string error;
    std::byte* base =
        shm::map_peer_copy(static_cast<int>(word(r, kPid)), static_cast<int>(word(r, kFd)),
                           mapping->mapped_bytes, error);
    if (base == nullptr) map_failed = fmt::format("rank {}'s copy: {}", r, error);
    mapping->bases[static_cast<std::size_t>(r)] = base;
  }
  const auto mapped = exchange_words({map_failed.empty() ? 1 : 0}, {});
  own.close_descriptor();  // every peer has mapped it, or given up
  for (int r = 0; r < size(); ++r) {
    if (mapped[static_cast<std::size_t>(r)] == 1) continue;
    why = r == rank() ? fmt::format("rank {} could not map {}", r, map_failed)
                      : fmt::format("rank {} could not map a peer's copy (its log says why)", r);
    return nullptr;  // `mapping` unmaps what was mapped
  }
  auto registry = domain_->shared_buffer_registry();
  registry->add(mapping, rank());
  std::byte* data = mapping->bases[static_cast<std::size_t>(rank())];
  return std::shared_ptr<void>(data,
                               [registry, mapping](void*) { registry->remove(mapping.get()); });
}

}  // namespace comm
}  // namespace ddp
