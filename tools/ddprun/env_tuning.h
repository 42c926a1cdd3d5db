// Environment tuning: variables ddprun adds to its workers' environment, beyond torchrun's, because
// they make libtorch training markedly faster on common machines (measured: docs/ddprun.md,
// "Environment tuning"). A variable the user already set is never touched, and
// `ddprun --no-env-tuning` adds none.
//
//   Environment tuning = choose_env_tuning(current_environment());
//   for (const auto& [key, value] : tuning) worker_env.emplace(key, value);
//
// - GLIBC_TUNABLES=kMallocTunables: libtorch's CPU allocator frees and re-allocates the same large
//   activation and gradient buffers every step; with glibc's defaults those go back to the kernel
//   (munmap, heap trimming) and are page-faulted in again, zeroed, on the next step. Keeping freed
//   memory in the process (as PyTorch's CUDA caching allocator does on GPUs) removes that cost;
//   the price is that a worker's resident memory stays near its peak.
// - OPENBLAS_CORETYPE: OpenBLAS picks its kernels from the CPU model number and falls back to its
//   generic "Prescott" kernels (SSE3) for models it does not know, e.g. recent Xeons; matrix
//   products then run at a fraction of the speed. When OpenBLAS reports Prescott on a CPU with
//   AVX-512 (or AVX2 + FMA), the workers get SkylakeX (or Haswell).
//
// choose_env_tuning starts one short-lived child process to ask OpenBLAS (dlopen) which kernels
// it would use; it throws nothing (a failed probe only means no OPENBLAS_CORETYPE).
#pragma once

#include <string>
#include <string_view>

#include "ddprun/worker_env.h"

namespace ddp::ddprun {

inline constexpr std::string_view kMallocTunables =
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824";

// The variables to add, given the environment ddprun runs in (variables present there are left
// out).
Environment choose_env_tuning(const Environment& base);

// The OPENBLAS_CORETYPE to force, given the core name OpenBLAS chose ("" when OpenBLAS is not
// installed) and what the CPU supports: "" unless OpenBLAS fell back to Prescott.
std::string openblas_coretype_for(std::string_view detected_core, bool has_avx512, bool has_avx2);

// The core name OpenBLAS picks on this machine (openblas_get_corename), asked in a child process;
// "" when OpenBLAS cannot be loaded or does not answer within a second.
std::string probe_openblas_core();

}  // namespace ddp::ddprun
