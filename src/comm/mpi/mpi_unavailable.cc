// make_mpi_process_group in a build without MPI: callers link either way and learn why at run
// time.
#include "ddp/comm/mpi_process_group.h"
#include "ddp/error.h"

namespace ddp {

std::shared_ptr<ProcessGroup> make_mpi_process_group(MpiOptions) {
  throw ConfigError(
      "the mpi backend is not built into this ddp: rebuild with an MPI library installed "
      "(Debian: libopenmpi-dev) and -DDDP_WITH_MPI=ON, or use the ring backend");
}

bool mpi_backend_available() {
  return false;
}

}  // namespace ddp
