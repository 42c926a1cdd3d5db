// A process-wide count of loads into module parameters done by ddp's own loaders
// (load_checkpoint, TrainState's resume). They copy into the parameters in place, which
// DistributedDataParallel cannot see from the tensors; it compares this count at each training
// forward and, when any rank loaded since the last one, checks across the ranks that every rank
// holds the same parameters (see distributed_data_parallel.h).
#pragma once

#include <cstdint>

namespace ddp::detail {

void note_parameters_loaded() noexcept;
std::uint64_t parameters_loaded_count() noexcept;

}  // namespace ddp::detail
