// Creating mpi process groups: the world group's communicators and new_group's subgroups.
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

namespace {

// This rank's position among the ranks of `comm` that share its host, and their number
// (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)). Collective over `comm`; blocking, so call it only
// once every rank is known to be there.
std::pair<int, int> local_layout(MPI_Comm comm) {
  auto lock = MpiRuntime::instance().lock();
  MPI_Comm node = MPI_COMM_NULL;
  const int rc = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) {
    throw CommError(CommErrorKind::kSetup,
                    fmt::format("mpi backend: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed: {}",
                                mpi_error_text(rc)),
                    "", "local_layout", 0, -1);
  }
  int local_rank = 0;
  int local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  return {local_rank, local_size};
}

std::uint64_t hash_ranks(const std::vector<int>& ranks) {
  std::uint64_t h = 14695981039346656037ull;  // FNV-1a
  auto mix = [&](std::uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(ranks.size());
  for (int r : ranks)
    mix(static_cast<std::uint32_t>(r));
  return h;
}

}  // namespace

std::shared_ptr<ProcessGroup> MpiProcessGroup::make_subgroup(std::vector<int> ranks) {
  auto& runtime = MpiRuntime::instance();
  std::lock_guard guard(new_group_mutex_);
  if (control_error_) std::rethrow_exception(control_error_);
  const int index = subgroups_created_++;
  auto comm_error = [&](const std::string& what, CommErrorKind kind = CommErrorKind::kSetup) {
    return CommError(kind,
                     fmt::format("rank {} of group '{}' (mpi backend): new_group({}) {}", rank(),
                                 name(), fmt::join(ranks, ", "), what),
                     name(), "new_group", 0, -1);
  };

  // Every rank must pass the same list: max over ranks of (h, ~h) is (h, ~h) on every rank iff
  // all hashes are equal. The Iallreduce also bounds the wait for the other ranks by a deadline;
  // the blocking MPI_Comm_split after it then finds every rank there.
  const std::uint64_t h = hash_ranks(ranks);
  // On the heap: after a timeout MPI may still write `most`, so the buffer is then kept until exit.
  auto buffer = std::make_unique<std::uint64_t[]>(4);
  std::uint64_t* mine = buffer.get();
  std::uint64_t* most = buffer.get() + 2;
  mine[0] = h;
  mine[1] = ~h;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc;
  {
    auto lock = runtime.lock();
    rc = MPI_Iallreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, control_, &request);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (!wait_request(request, Clock::now() + group_timeout(), rc)) {
    // The request stays posted on control_ (and writes `most` if the peers come): never reuse it.
    MpiRuntime::instance().keep_until_exit(std::shared_ptr<void>(std::move(buffer)));
    control_error_ = std::make_exception_ptr(comm_error(
        fmt::format(
            "timed out after {} ms waiting for the other ranks of the group to call it (every rank "
            "of the group calls new_group, members or not)",
            group_timeout().count()),
        CommErrorKind::kTimeout));
    std::rethrow_exception(control_error_);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (most[0] != h || most[1] != ~h) {
    throw ConfigError(
        fmt::format("new_group on group '{}': the ranks passed different rank lists "
                    "(rank {} passed [{}]); pass the same list on every rank",
                    name(), rank(), fmt::join(ranks, ", ")));
  }
  const auto it = std::find(ranks.begin(), ranks.end(), rank());
  const bool member = it != ranks.end();
  const int key = member ? static_cast<int>(it - ranks.begin()) : 0;
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm sub_check = MPI_COMM_NULL;
  MPI_Comm sub_control = MPI_COMM_NULL;
  MPI_Comm sub_p2p = MPI_COMM_NULL;
  {
    auto lock = runtime.lock();
    rc = MPI_Comm_split(control_, member ? 0 : MPI_UNDEFINED, key, &sub);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_check);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_control);
    if (rc == MPI_SUCCESS && member) rc = MPI_Comm_dup(sub, &sub_p2p);
    if (rc == MPI_SUCCESS && member) {
      MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_check, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_control, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(sub_p2p, MPI_ERRORS_RETURN);
    }
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  if (!member) return nullptr;
  const auto [local_rank, local_size] = local_layout(sub_control);
  GroupOptions options = options_;
  options.name = fmt::format("{}/sub{}", name(), index);
  options.notice_key = fmt::format("{}/sub{}", options_.notice_key, index);
  std::vector<int> world_ranks;
  for (int r : ranks)
    world_ranks.push_back(world_ranks_[static_cast<std::size_t>(r)]);
  auto group = std::make_shared<MpiProcessGroup>(
      sub, sub_check, sub_control, sub_p2p, std::move(options), key, static_cast<int>(ranks.size()),
      local_rank, local_size, std::move(world_ranks));
  group->start();
  return group;
}

}  // namespace ddp::comm::mpi

namespace ddp {

std::shared_ptr<ProcessGroup> make_mpi_process_group(MpiOptions options) {
  using namespace comm::mpi;
  if (options.group_name.empty()) {
    throw ConfigError("make_mpi_process_group: MpiOptions::group_name is empty");
  }
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("MpiOptions::timeout is negative ({} ms); use a positive "
                    "value, or 0 for DDP_TIMEOUT / the default",
                    options.timeout.count()));
  }
  if (options.stall_check_after.count() <= 0) {
    throw ConfigError(fmt::format("MpiOptions::stall_check_after must be positive (got {} ms)",
                                  options.stall_check_after.count()));
  }
  // The option, else DDP_TIMEOUT, else the default.
  const milliseconds timeout = options.timeout.count() > 0 ? options.timeout : settings::timeout();
  auto& runtime = MpiRuntime::instance();
  int world_rank = 0;
  int world_size = 0;
  // On the heap: after a timeout MPI may still complete the duplication into it (then kept until
  // exit). Data, check and control communicators (see the top of this file). The first group also
  // makes the process-wide communicator of notices (MpiRuntime).
  const int count = runtime.has_notice_comm() ? 3 : 4;
  auto comms_buffer = std::make_unique<MPI_Comm[]>(4);
  MPI_Comm* comms = comms_buffer.get();
  comms[0] = comms[1] = comms[2] = comms[3] = MPI_COMM_NULL;
  MPI_Request requests[4] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                             MPI_REQUEST_NULL};
  int rc = MPI_SUCCESS;
  {
    auto lock = runtime.lock();
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    // Later groups duplicate the notice communicator (MPI_ERRORS_RETURN) rather than
    // MPI_COMM_WORLD: an abandoned request of a failed group can make OpenMPI's progress engine
    // fail an MPI_Comm_idup in flight, and MPI_COMM_WORLD's handler (by default
    // MPI_ERRORS_ARE_FATAL) would then end the process.
    const MPI_Comm base = count == 4 ? MPI_COMM_WORLD : runtime.notice_comm();
    for (int i = 0; i < count && rc == MPI_SUCCESS; ++i) {
      rc = MPI_Comm_idup(base, &comms[i], &requests[i]);
    }
  }
  auto comm_error = [&](const std::string& what, CommErrorKind kind = CommErrorKind::kSetup) {
    return CommError(kind,
                     fmt::format("rank {} of {} (mpi backend): creating group '{}' {}", world_rank,
                                 world_size, options.group_name, what),
                     options.group_name, "make_mpi_process_group", 0, -1);
  };
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  const auto deadline = Clock::now() + timeout;
  for (int i = 0; i < count; ++i) {
    if (!wait_request(requests[i], deadline, rc)) {
      MpiRuntime::instance().keep_until_exit(std::shared_ptr<void>(std::move(comms_buffer)));
      throw comm_error(fmt::format("timed out after {} ms waiting for every rank of "
                                   "MPI_COMM_WORLD to call make_mpi_process_group",
                                   timeout.count()),
                       CommErrorKind::kTimeout);
    }
    if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  }
  {
    auto lock = runtime.lock();
    for (int i = 0; i < count; ++i)
      MPI_Comm_set_errhandler(comms[i], MPI_ERRORS_RETURN);
  }
  if (count == 4) runtime.set_notice_comm(comms[3]);
  // Point-to-point's own communicator (blocking: every rank completed the duplications above).
  MPI_Comm p2p = MPI_COMM_NULL;
  {
    auto lock = runtime.lock();
    rc = MPI_Comm_dup(comms[0], &p2p);
    if (rc == MPI_SUCCESS) MPI_Comm_set_errhandler(p2p, MPI_ERRORS_RETURN);
  }
  if (rc != MPI_SUCCESS) throw comm_error(fmt::format("failed: {}", mpi_error_text(rc)));
  const auto [local_rank, local_size] = local_layout(comms[2]);
  std::vector<int> world_ranks(static_cast<std::size_t>(world_size));
  for (int r = 0; r < world_size; ++r)
    world_ranks[static_cast<std::size_t>(r)] = r;
  auto group = std::make_shared<MpiProcessGroup>(
      comms[0], comms[1], comms[2], p2p,
      GroupOptions{.name = options.group_name,
                   .notice_key = std::to_string(runtime.next_world_group()),
                   .timeout = timeout,
                   .abort_on_failure = options.abort_on_failure,
                   .stall_check_after = options.stall_check_after},
      world_rank, world_size, local_rank, local_size, std::move(world_ranks));
  group->start();
  return group;
}

bool mpi_backend_available() {
  return true;
}

}  // namespace ddp
