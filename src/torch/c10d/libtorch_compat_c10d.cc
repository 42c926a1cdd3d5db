// libtorch_compat_c10d.h: the version differences of c10d groups.
#include "torch/c10d/libtorch_compat_c10d.h"

#include "ddp/error.h"

namespace ddp::libtorch_compat {

c10::intrusive_ptr<C10dCollectives> c10d_cpu_collectives(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) throw ConfigError("wrap_c10d: the c10d::ProcessGroup is null");
#if TORCH_VERSION_MAJOR >= 2
  // getBackend throws (c10::Error) when the group has no backend for the device type.
  try {
    return group->getBackend(c10::DeviceType::CPU);
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("wrap_c10d: the c10d::ProcessGroup has no CPU backend (ddp's "
                                  "buffers are host memory): ") +
                      e.what_without_backtrace());
  }
#else
  return group;
#endif
}

c10::intrusive_ptr<C10dCollectives> c10d_cpu_collectives(
    const c10::intrusive_ptr<c10d::Backend>& backend) {
  if (!backend) throw ConfigError("wrap_c10d: the c10d::Backend is null");
#if TORCH_VERSION_MAJOR >= 2
  return backend;
#else
  throw ConfigError(
      "wrap_c10d: libtorch 1.13 runs collectives on c10d::ProcessGroup (ProcessGroupGloo derives "
      "from it), not on a c10d::Backend; pass the c10d::ProcessGroup");
#endif
}

bool c10d_gloo_takes(at::ScalarType type) {
  return TORCH_VERSION_MAJOR >= 2 || type != at::kBFloat16;
}

}  // namespace ddp::libtorch_compat
