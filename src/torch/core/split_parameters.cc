#include "torch/core/split_parameters.h"

#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <utility>

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace ddp::detail {

namespace {

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  SplitPart part;
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

}  // namespace

void note_split_parameter(const at::Tensor& parameter, SplitPart part) {
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  // Sweep the freed ones once the map has doubled since the last sweep: amortised O(1).
  if (r.entries.size() >= 2 * r.pruned_at + 64) {
    std::erase_if(r.entries, [](const auto& item) { return item.second.impl.expired(); });
    r.pruned_at = r.entries.size();
  }
  r.entries.insert_or_assign(
      parameter.unsafeGetTensorImpl(),
      Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(parameter.getIntrusivePtr()), part});
}

std::optional<SplitPart> split_part_of(const at::Tensor& parameter) {
  if (!parameter.defined()) return std::nullopt;
  auto& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto it = r.entries.find(parameter.unsafeGetTensorImpl());
  if (it == r.entries.end()) return std::nullopt;
  // Freed and its address reused by another tensor: not the recorded one.
  if (it->second.impl.lock().get() != parameter.unsafeGetTensorImpl()) return std::nullopt;
  return it->second.part;
}

}  // namespace ddp::detail
