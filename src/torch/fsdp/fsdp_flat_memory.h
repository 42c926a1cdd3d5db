// FullyShardedDataParallel's flat buffers: where their memory comes from (mmap on the host, the
// device's allocator on a device), freeing and refilling a buffer in place, and the byte counts
// of ddp/torch/fsdp/fsdp_memory.h. Internal to ddp_torch.
#pragma once

#include <cstddef>
#include <cstdint>

#include <torch/torch.h>

namespace ddp::detail {

// What a flat buffer is, for fsdp_memory.h's count: kUnsharded (a unit's full parameters or full
// flat gradient) is counted, kShardSized (a reduce-scatter's output, which becomes the shard's
// gradient) is not.
enum class FlatBufferKind { kUnsharded, kShardSized };

// A tensor of `numel` elements of `dtype` in FSDP's memory on `device`, zero-filled.
torch::Tensor fsdp_flat_zeros(std::int64_t numel, torch::ScalarType dtype,
                              const c10::Device& device,
                              FlatBufferKind kind = FlatBufferKind::kUnsharded);

// Whether `data` is memory FSDP allocated (a parameter another wrapper already holds).
bool is_fsdp_memory(const c10::DataPtr& data);

// Freeing and refilling a full parameter buffer in place, as PyTorch's FSDP resizes the flat
// parameter's storage to 0 and back: the module's parameters and the tensors autograd saved for
// backward are views of this storage, so they stay valid handles and see the new memory once it
// is refilled (and gathered). The refilled memory is not zeroed.
void release_fsdp_storage(const torch::Tensor& full);
void allocate_fsdp_storage(const torch::Tensor& full);
bool fsdp_storage_allocated(const torch::Tensor& full);

}  // namespace ddp::detail
