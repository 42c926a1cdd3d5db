// make_nccl_process_group in a build without the NCCL headers: callers link either way and learn
// why at run time.
#include <fmt/format.h>

#include "ddp/comm/nccl_process_group.h"
#include "ddp/error.h"

#ifndef DDP_NCCL_OFF_REASON
#define DDP_NCCL_OFF_REASON "no NCCL headers at configure time"
#endif

namespace ddp {

namespace {

[[noreturn]] void refuse() {
  throw ConfigError(fmt::format(
      "the nccl backend is not built into this ddp ({}): rebuild with nccl.h and cuda_runtime.h "
      "available (PyTorch's CUDA wheel in DDP_PYTORCH_VENV, or the CUDA toolkit and NCCL in "
      "/usr/local/cuda) and -DDDP_WITH_NCCL=ON, or use the ring backend",
      DDP_NCCL_OFF_REASON));
}

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_process_group(std::shared_ptr<Store>, int, int,
                                                      NcclOptions) {
  refuse();
}

int prepare_nccl_device(const NcclOptions&) {
  refuse();
}

bool nccl_backend_available() {
  return false;
}

const char* nccl_backend_unavailable_reason() {
  return DDP_NCCL_OFF_REASON;
}

}  // namespace ddp
