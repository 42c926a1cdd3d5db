#include "torch/fsdp/fsdp_flat_memory.h"

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <new>

#include "ddp/torch/fsdp/fsdp_memory.h"

namespace ddp {

namespace {

// fsdp_memory.h's counts: requested bytes of unsharded buffers (not the mapping's extra huge page,
// nor the device allocator's rounding), so that they compare with a formula in elements.
struct PlaceCount {
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> peak{0};
};
std::array<PlaceCount, 2> place_counts;

PlaceCount& count_of(FsdpMemoryPlace place) {
  return place_counts[place == FsdpMemoryPlace::kHost ? 0 : 1];
}

void count_allocated(FsdpMemoryPlace place, std::size_t bytes) {
  auto& count = count_of(place);
  const std::int64_t live =
      count.live.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  std::int64_t peak = count.peak.load();
  while (live > peak && !count.peak.compare_exchange_weak(peak, live)) {
  }
}

void count_freed(FsdpMemoryPlace place, std::size_t bytes) {
  count_of(place).live.fetch_sub(static_cast<std::int64_t>(bytes));
}

// Memory for the buffers FSDP frees during a step (full parameters, full flat gradients) comes
// straight from mmap and goes back with munmap: through malloc it would stay in the process when
// malloc is told to keep freed memory (ddprun's GLIBC_TUNABLES, for speed), and the buffers of
// different units would fragment the heap, so freeing would save nothing.
//
// Those buffers are mapped afresh several times per step, and every page of a fresh mapping costs
// a fault on first touch: with 4 KiB pages that was 16 384 faults per 64 MiB unit, about as long
// as gathering it. So blocks of at least one huge page are aligned to 2 MiB and advised
// MADV_HUGEPAGE (transparent huge pages, used where the system allows it: "madvise" or "always"
// in /sys/kernel/mm/transparent_hugepage/enabled), 512 times fewer faults; elsewhere the advice
// is ignored and the block works as before.
constexpr std::size_t kHugePage = std::size_t{2} << 20;

struct MappedBlock {
  void* mapping = nullptr;  // what munmap gets (the aligned block lies inside)
  std::size_t mapped_bytes = 0;
  std::size_t counted_bytes = 0;  // what fsdp_memory.h counts of it (0: not counted)
};

void unmap_block(void* context) {
  auto* block = static_cast<MappedBlock*>(context);
  if (block->mapping != nullptr) munmap(block->mapping, block->mapped_bytes);
  count_freed(FsdpMemoryPlace::kHost, block->counted_bytes);
  delete block;
}

c10::DataPtr map_bytes(std::size_t bytes, std::size_t counted_bytes) {
  auto* block = new MappedBlock{};
  void* address = nullptr;
  if (bytes > 0) {
    const bool huge = bytes >= kHugePage;
    // One huge page more than asked, so that a 2 MiB-aligned block of `bytes` fits inside.
    const std::size_t mapped = huge ? bytes + kHugePage : bytes;
    void* mapping =
        mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) {
      delete block;
      throw std::bad_alloc();
    }
    block->mapping = mapping;
    block->mapped_bytes = mapped;
    address = mapping;
    if (huge) {
      const auto at = reinterpret_cast<std::uintptr_t>(mapping);
      address = reinterpret_cast<void*>((at + kHugePage - 1) & ~(kHugePage - 1));
      // Advice only: a kernel without THP answers EINVAL and the 4 KiB pages serve as before.
      (void)madvise(address, bytes, MADV_HUGEPAGE);
    }
  }
  block->counted_bytes = counted_bytes;
  count_allocated(FsdpMemoryPlace::kHost, counted_bytes);
  return c10::DataPtr(address, block, &unmap_block, c10::Device(c10::kCPU));
}

// Device memory (CUDA) from the device's own allocator, under a deleter of FSDP's own, so that a
// storage FSDP made is recognised on every device (sharded_elsewhere in fsdp_sharding.cc) as
// mapped host memory is by unmap_block, and counted.
struct DeviceBlock {
  c10::DataPtr held;  // the allocator's: freeing it frees the block
  std::size_t counted_bytes = 0;
};

void free_device_block(void* context) {
  auto* block = static_cast<DeviceBlock*>(context);
  count_freed(FsdpMemoryPlace::kDevice, block->counted_bytes);
  delete block;
}

c10::DataPtr device_bytes(std::size_t bytes, std::size_t counted_bytes, const c10::Device& device) {
  c10::DeviceGuard on_device(device);  // the caching allocator allocates on the current device
  auto* block = new DeviceBlock{c10::GetAllocator(device.type())->allocate(bytes), counted_bytes};
  void* address = block->held.get();
  count_allocated(FsdpMemoryPlace::kDevice, counted_bytes);
  return c10::DataPtr(address, block, &free_device_block, device);
}

c10::DataPtr flat_bytes(std::size_t bytes, const c10::Device& device, detail::FlatBufferKind kind) {
  const std::size_t counted = kind == detail::FlatBufferKind::kUnsharded ? bytes : 0;
  return device.is_cpu() ? map_bytes(bytes, counted) : device_bytes(bytes, counted, device);
}

}  // namespace

FsdpBufferBytes fsdp_buffer_bytes(FsdpMemoryPlace place) {
  const auto& count = count_of(place);
  return {.live = count.live.load(), .peak = count.peak.load()};
}

void reset_fsdp_buffer_peak() {
  for (auto& count : place_counts)
    count.peak.store(count.live.load());
}

namespace detail {

torch::Tensor fsdp_flat_zeros(std::int64_t numel, torch::ScalarType dtype,
                              const c10::Device& device, FlatBufferKind kind) {
  const auto bytes = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, flat_bytes(bytes, device, kind),
                       /*allocator=*/nullptr, /*resizable=*/false);
  auto tensor =
      torch::empty({0}, torch::TensorOptions(dtype).device(device)).set_(storage, 0, {numel}, {1});
  if (!device.is_cpu()) tensor.zero_();  // fresh mappings are zero; device memory is not
  return tensor;
}

bool is_fsdp_memory(const c10::DataPtr& data) {
  return data.get_deleter() == &unmap_block || data.get_deleter() == &free_device_block;
}

// The same StorageImpl calls exist in libtorch 1.13 and 2.x.
void release_fsdp_storage(const torch::Tensor& full) {
  auto* storage = full.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, full.device()));
  storage->set_nbytes(std::size_t{0});
}

void allocate_fsdp_storage(const torch::Tensor& full) {
  auto* storage = full.storage().unsafeGetStorageImpl();
  const auto bytes = static_cast<std::size_t>(full.numel()) * full.element_size();
  storage->set_data_ptr_noswap(flat_bytes(bytes, full.device(), FlatBufferKind::kUnsharded));
  storage->set_nbytes(bytes);
}

bool fsdp_storage_allocated(const torch::Tensor& full) {
  return full.storage().nbytes() > 0;
}

}  // namespace detail

}  // namespace ddp
