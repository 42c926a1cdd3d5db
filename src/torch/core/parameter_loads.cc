#include "torch/core/parameter_loads.h"

#include <atomic>

namespace ddp::detail {
namespace {

std::atomic<std::uint64_t> loads{0};

}  // namespace

void note_parameters_loaded() noexcept {
  loads.fetch_add(1, std::memory_order_relaxed);
}

std::uint64_t parameters_loaded_count() noexcept {
  return loads.load(std::memory_order_relaxed);
}

}  // namespace ddp::detail
