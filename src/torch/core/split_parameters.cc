#include "torch/core/split_parameters.h"

#include <cstddef>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace ddp::detail {

namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  std::optional<SplitPart> part;
  std::optional<GradientRanks> ranks;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
  std::size_t pruned_at = 0;  // the size after the last sweep of freed entries
};

Registry& registry() {
  static auto* instance = new Registry();  // never destroyed: used from static destructors
  return *instance;
}

// The entry of `parameter`, made (or renewed, when a freed tensor's address was reused) under the
// registry's lock.
Entry& entry_of(Registry& r, const at::Tensor& parameter) {
  // Sweep the freed ones once the map has doubled since the last sweep: amortised O(1).
  if (r.entries.size() >= 2 * r.pruned_at + 64) {
    std::erase_if(r.entries, [](const auto& item) { return item.second.impl.expired(); });
    r.pruned_at = r.entries.size();
  }
  const auto* key = parameter.unsafeGetTensorImpl();
  auto it = r.entries.find(key);
  if (it == r.entries.end() || it->second.impl.lock().get() != key) {
    it = r.entries
             .insert_or_assign(
                 key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(parameter.getIntrusivePtr()),
                            std::nullopt, std::nullopt})
             .first;
  }
  return it->second;
}

// The entry recorded for `parameter` itself (not a freed tensor at its address), or null.
const Entry* find_entry(Registry& r, const at::Tensor& parameter) {
  if (!parameter.defined()) return nullptr;
  const auto it = r.entries.find(parameter.unsafeGetTensorImpl());
  if (it == r.entries.end()) return nullptr;
  if (it->second.impl.lock().get() != parameter.unsafeGetTensorImpl()) return nullptr;
  return &it->second;
}

}  // namespace

void note_split_parameter(const at::Tensor& parameter, SplitPart part) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  entry_of(r, parameter).part = part;
}

void note_gradient_ranks(const at::Tensor& parameter, GradientRanks ranks) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  entry_of(r, parameter).ranks = ranks;
}

std::optional<SplitPart> split_part_of(const at::Tensor& parameter) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto* entry = find_entry(r, parameter);
  return entry != nullptr ? entry->part : std::nullopt;
}

std::optional<GradientRanks> gradient_ranks_of(const at::Tensor& parameter) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto* entry = find_entry(r, parameter);
  return entry != nullptr ? entry->ranks : std::nullopt;
}

}  // namespace ddp::detail
