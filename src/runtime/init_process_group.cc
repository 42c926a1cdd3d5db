#include "ddp/runtime/init.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/comm/mpi_process_group.h"
#include "ddp/comm/nccl_process_group.h"
#include "ddp/comm/ring_process_group.h"
#include "ddp/comm/trace.h"
#include "ddp/error.h"
#include "ddp/store/prefix_store.h"
#include "init/resolved_rendezvous.h"
#include "settings/settings.h"

namespace ddp {
namespace {

std::mutex default_group_mutex;
std::shared_ptr<ProcessGroup> default_group;
std::shared_ptr<ProcessGroup> default_cuda_group;  // DDP_BACKEND=auto, where every rank has a GPU
std::string cuda_group_absent_reason;              // DDP_BACKEND=auto, where some rank had none

// DDP_QUIET set and not "0": the notices below stay off stderr.
bool quiet() {
  const auto value = process_environment("DDP_QUIET");
  return value && !value->empty() && *value != "0";
}

// Under "auto": why this rank cannot drive a GPU of its own with nccl; "" when it can (its device
// is then current). Never throws: every rank must reach the agreement that follows.
std::string why_this_rank_has_no_nccl_device(int local_rank) {
  if (!nccl_backend_available()) {
    return fmt::format("this ddp has no nccl backend ({})", nccl_backend_unavailable_reason());
  }
  try {
    prepare_nccl_device({.device = local_rank});
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every rank's `why` through `group` (blocking): "" when every rank's is empty, else how many
// ranks had one and the first, named by its rank.
std::string first_reason_across_ranks(ProcessGroup& group, const std::string& why) {
  const auto world = static_cast<std::size_t>(group.size());
  const std::int64_t mine = static_cast<std::int64_t>(why.size());
  std::vector<std::int64_t> lengths(world);
  group.allgather(&mine, lengths.data(), 1, DType::kInt64, {.blocking = true});
  std::vector<std::size_t> counts(lengths.begin(), lengths.end());
  std::size_t total = 0;
  for (const auto c : counts)
    total += c;
  if (total == 0) return "";
  std::string all(total, '\0');
  group.allgather_v(why.data(), why.size(), all.data(), counts, DType::kUInt8)->wait();
  std::size_t at = 0, failing = 0;
  std::string first;
  for (std::size_t r = 0; r < world; ++r) {
    if (counts[r] > 0 && failing++ == 0)
      first = fmt::format("rank {}: {}", r, all.substr(at, counts[r]));
    at += counts[r];
  }
  return fmt::format("{} of {} ranks cannot use nccl; the first, {}", failing, world, first);
}

// DDP_TRACE=DIR: starts this rank's timeline and aligns its clock with rank 0's through the new
// group. The folder was made and probed before the rendezvous (prepare_output_folder); one that
// went bad since is a warning and the job trains untraced; the clock
// exchange runs on every rank anyway (every rank sees the same DDP_TRACE), so ranks whose trace
// did start still pair their messages.
void start_trace_from_environment(ProcessGroup& group) {
  const std::string dir = settings::trace_dir();
  if (dir.empty()) return;
  const std::size_t max_events = settings::trace_max_events();
  try {
    start_trace(
        {.dir = dir, .rank = group.rank(), .world_size = group.size(), .max_events = max_events});
  } catch (const TraceError& e) {
    std::fprintf(stderr, "ddp: warning: %s (from DDP_TRACE)\n", e.what());
  }
  synchronize_trace_clock(group);
}

// DDP_DUMP_DIR and DDP_TRACE name folders that are written at a failure or at exit: made now
// (mkdir -p) and probed with a file, or refused with the variable, the path and the system's
// reason, so that a wrong path shows at the start and not when the dump it was for is lost.
void prepare_output_folder(const char* variable, const std::string& path) {
  if (path.empty()) return;
  namespace fs = std::filesystem;
  const auto refuse = [&](const std::string& problem) {
    throw ConfigError(
        fmt::format("{}='{}' {}; point {} at a folder this process can write, or unset it",
                    variable, path, problem, variable));
  };
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path, ec)) && !fs::is_directory(path, ec)) {
    refuse("is not a folder (a file of that name exists)");
  }
  fs::create_directories(path, ec);
  if (ec && !fs::is_directory(path)) {  // another rank creating it at once is no error
    refuse(fmt::format("cannot be created ({})", ec.message()));
  }
  const std::string probe = (fs::path(path) / fmt::format(".ddp_probe.{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    refuse(fmt::format("is a folder this process cannot write in ({})", std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// A launcher variable read as a number; nullopt when unset or not a number.
std::optional<long long> number_from_environment(const char* name) {
  const auto text = process_environment(name);
  if (!text) return std::nullopt;
  try {
    std::size_t used = 0;
    const long long value = std::stoll(*text, &used);
    if (used == text->size()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// The mpi backend learns its world from MPI, which knows it only under mpirun (or srun with
// PMI). Started by ddprun or torchrun instead, every process would be a world of one and train
// alone, and the job would exit 0: refused, before MPI starts.
void refuse_mpi_without_mpirun() {
  if (process_environment("OMPI_COMM_WORLD_SIZE") || process_environment("PMI_SIZE") ||
      process_environment("PMIX_RANK")) {
    return;  // mpirun (or a PMI launcher) started it: MPI knows the world
  }
  const auto rank_text = process_environment("RANK");
  const auto world_text = process_environment("WORLD_SIZE");
  if (!rank_text && !world_text) return;
  const auto world = number_from_environment("WORLD_SIZE");
  const auto rank = number_from_environment("RANK");
  if (world == 1 && rank.value_or(0) == 0) return;  // a job of one: MPI's world of one is right
  throw ConfigError(fmt::format(
      "the mpi backend needs mpirun: this process was started with RANK={} WORLD_SIZE={} (by "
      "ddprun or torchrun) but not by mpirun, so MPI would make each process a separate world "
      "of one, training alone. Under ddprun or torchrun use the ring backend (unset DDP_BACKEND "
      "or set DDP_BACKEND=ring), or launch with mpirun -np {} and DDP_BACKEND=mpi",
      rank_text.value_or("(unset)"), world_text.value_or("(unset)"),
      world ? std::to_string(*world) : std::string("N")));
}

// After MPI started: its world must be the one the launcher announced.
void check_mpi_world_against_launcher(const ProcessGroup& group) {
  for (const char* name : {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}) {
    const auto expected = number_from_environment(name);
    if (!expected) continue;
    if (*expected != group.size()) {
      throw ConfigError(fmt::format(
          "{}={} but MPI's world has {} process(es): the mpi backend needs the processes to be "
          "started by mpirun (or srun with MPI support); otherwise use the ring backend",
          name, *expected, group.size()));
    }
    return;
  }
}

// A process that no launcher started trains alone; say so once, on stderr, with how to start
// more. Quiet when the caller chose its rank and world itself, or with DDP_QUIET set (not "0").
void notice_single_process(const InitOptions& options) {
  if (options.launch.rank || options.launch.world_size) return;
  for (const char* name : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                           "SLURM_PROCID", "SLURM_NTASKS", "PMI_SIZE", "PMIX_RANK"}) {
    if (process_environment(name)) return;
  }
  if (quiet()) return;
  static std::once_flag once;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "ddp: no launcher environment (RANK, WORLD_SIZE, OMPI_COMM_WORLD_*, SLURM_*) "
                 "found; running as a single process. Launch more with `ddprun "
                 "--nproc-per-node N prog` or torchrun (DDP_QUIET=1 silences this line)\n");
  });
}

}  // namespace

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"ring"};
  if (mpi_backend_available()) names.push_back("mpi");
  if (nccl_backend_available()) names.push_back("nccl");
  names.push_back("auto");
  return names;
}

std::string resolve_backend(const std::string& requested, const std::string& source) {
  std::string name = requested;
  std::string from = source;
  if (name.empty()) {
    if (const auto env = process_environment("DDP_BACKEND"); env && !env->empty()) {
      name = *env;
      from = "DDP_BACKEND";
    } else {
      // Launched by mpirun (and not by a torchrun-style launcher inside it): MPI knows the world.
      const bool under_mpirun =
          process_environment("OMPI_COMM_WORLD_SIZE").has_value() && !process_environment("RANK");
      return under_mpirun && mpi_backend_available() ? "mpi" : "ring";
    }
  }
  const auto names = available_backends();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    throw ConfigError(fmt::format(
        "unknown backend '{}' (from {}); this build of ddp has: {}{}", name, from,
        fmt::join(names, ", "),
        name == "mpi"    ? " (the mpi backend needs OpenMPI (libopenmpi-dev) at configure time and "
                           "-DDDP_WITH_MPI=ON)"
        : name == "nccl" ? fmt::format(" (the nccl backend is not built: {}; it needs nccl.h and "
                                       "cuda_runtime.h at configure time and -DDDP_WITH_NCCL=ON)",
                                       nccl_backend_unavailable_reason())
                         : std::string()));
  }
  return name;
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  const std::string backend = resolve_backend(options.backend, "InitOptions::backend");
  notice_single_process(options);
  prepare_output_folder("DDP_DUMP_DIR", settings::dump_dir());
  prepare_output_folder("DDP_TRACE", settings::trace_dir());
  std::shared_ptr<ProcessGroup> group;
  std::shared_ptr<ProcessGroup> cuda_group;
  std::string cuda_absent;
  if (backend == "ring" || backend == "auto") {
    // Under auto, each rank looks for its GPU before the rendezvous (loading the CUDA runtime
    // can take seconds), and the ranks agree on the answer once the ring group exists.
    LaunchEnvironment environment = resolve_launch_environment(options.launch);
    const std::string why_not_here = backend == "auto"
                                         ? why_this_rank_has_no_nccl_device(environment.local_rank)
                                         : std::string();
    World world = rendezvous(options, std::move(environment));
    auto store = std::make_shared<PrefixStore>("ddp/pg", world.store);
    group = make_ring_process_group(
        store, world.rank(), world.size(),
        {.timeout = world.timeout, .group_name = "default", .secret = world.environment.secret});
    if (backend == "auto") {
      cuda_absent = first_reason_across_ranks(*group, why_not_here);
      if (cuda_absent.empty()) {
        cuda_group = make_nccl_process_group(
            store, world.rank(), world.size(),
            {.timeout = world.timeout, .group_name = "cuda", .device = world.local_rank()});
      }
      if (world.rank() == 0 && !quiet()) {
        if (cuda_group) {
          std::fprintf(stderr,
                       "ddp: DDP_BACKEND=auto: CPU tensors on ring, CUDA tensors on nccl\n");
        } else {
          std::fprintf(stderr,
                       "ddp: DDP_BACKEND=auto: CPU tensors on ring; CUDA tensors staged through "
                       "host memory on ring (%s)\n",
                       cuda_absent.c_str());
        }
      }
    }
  } else if (backend == "nccl") {  // resolve_backend accepts it only when it was built
    // Each rank drives the GPU of its local rank (LOCAL_RANK); one without a GPU or libnccl
    // fails here, before it waits for its peers in the rendezvous (as the ring backend's).
    LaunchEnvironment environment = resolve_launch_environment(options.launch);
    prepare_nccl_device({.device = environment.local_rank});
    World world = rendezvous(options, std::move(environment));
    group = make_nccl_process_group(
        std::make_shared<PrefixStore>("ddp/pg", world.store), world.rank(), world.size(),
        {.timeout = world.timeout, .group_name = "default", .device = world.local_rank()});
  } else {  // "mpi": resolve_backend accepts it only when it was built
    // MPI has its own rendezvous; the launcher's variables are only checked against it.
    refuse_mpi_without_mpirun();
    group = make_mpi_process_group({.timeout = resolve_timeout(options.timeout),
                                    .abort_on_failure = options.mpi_abort_on_failure});
    if (options.launch.rank && *options.launch.rank != group->rank()) {
      throw ConfigError(fmt::format("options.rank={} but MPI says this process is rank {}",
                                    *options.launch.rank, group->rank()));
    }
    if (options.launch.world_size && *options.launch.world_size != group->size()) {
      throw ConfigError(fmt::format("options.world_size={} but MPI's world has {} processes",
                                    *options.launch.world_size, group->size()));
    }
    if (!options.launch.world_size) check_mpi_world_against_launcher(*group);
  }
  start_trace_from_environment(*group);
  std::lock_guard lock(default_group_mutex);
  default_group = group;
  default_cuda_group = cuda_group;
  cuda_group_absent_reason = cuda_absent;
  return group;
}

std::shared_ptr<ProcessGroup> default_cuda_process_group() {
  std::lock_guard lock(default_group_mutex);
  return default_cuda_group;
}

std::string cuda_process_group_absent_reason() {
  std::lock_guard lock(default_group_mutex);
  return cuda_group_absent_reason;
}

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard lock(default_group_mutex);
  return default_group;
}

void destroy_process_group() {
  std::lock_guard lock(default_group_mutex);
  default_group.reset();
  default_cuda_group.reset();
  cuda_group_absent_reason.clear();
}

}  // namespace ddp
