// What differs between libtorch 1.13 and 2.x for ddp's adapter over c10d groups
// (c10d_backend.h), in one place.
//
// 2.x splits a c10d::ProcessGroup (the front) from the c10d::Backend per device type that runs
// its collectives; ProcessGroupGloo is a Backend. 1.13 has no such split: ProcessGroupGloo
// derives from c10d::ProcessGroup. Both have the same collective methods (vectors of tensors
// and an options struct, returning a c10d::Work), so the adapter calls them on
// C10dCollectives, whichever class that is here.
#pragma once

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace ddp::libtorch_compat {

#if TORCH_VERSION_MAJOR >= 2
using C10dCollectives = c10d::Backend;
#else
using C10dCollectives = c10d::ProcessGroup;
#endif

// What runs `group`'s collectives on CPU tensors: its CPU backend in 2.x, the group itself in
// 1.13. Throws ConfigError when there is none.
c10::intrusive_ptr<C10dCollectives> c10d_cpu_collectives(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group);
// `backend` itself in 2.x; ConfigError in 1.13, where no group is a c10d::Backend.
c10::intrusive_ptr<C10dCollectives> c10d_cpu_collectives(
    const c10::intrusive_ptr<c10d::Backend>& backend);

// Whether c10d's gloo moves and reduces tensors of `type` (ddp's dtypes): 1.13's refuses
// bfloat16 ("Invalid scalar type") in every collective; 2.x takes them all.
bool c10d_gloo_takes(at::ScalarType type);

}  // namespace ddp::libtorch_compat
