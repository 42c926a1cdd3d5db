// Naming mismatched collectives: the stall notices and the gathering of every rank's header.
#include "comm/mpi/mpi_group.h"

namespace ddp::comm::mpi {

std::optional<CommError> MpiProcessGroup::stall_problem(const Call& op, bool& announced) {
  const comm::OpHeader& header = op.header;
  const auto problem = [&](CommErrorKind kind, const std::string& text) {
    return CommError(kind, text, name(), op.description(), header.sequence, -1);
  };
  auto& runtime = MpiRuntime::instance();
  const std::uint64_t mine = fingerprint_hash(header);
  if (!announced) {
    announced = true;
    std::vector<int> peers;
    for (int r = 0; r < size(); ++r) {
      if (r != rank()) peers.push_back(world_ranks_[static_cast<std::size_t>(r)]);
    }
    // "stall RANK SEQUENCE HASH DESCRIPTION"
    runtime.send_notice(
        options_.notice_key, peers,
        fmt::format("stall {} {} {} {}", rank(), header.sequence, mine, comm::describe(header)));
  }
  for (const std::string& text : runtime.notices(options_.notice_key)) {
    if (text.rfind("stall ", 0) != 0) {
      return problem(notice_kind(text),
                     fmt::format("rank {} of group '{}' (mpi backend): {} cannot complete: {}",
                                 rank(), name(), comm::describe(header), text));
    }
    int peer = -1;
    unsigned long long sequence = 0;
    unsigned long long hash = 0;
    int consumed = 0;
    if (std::sscanf(text.c_str(), "stall %d %llu %llu %n", &peer, &sequence, &hash, &consumed) <
            3 ||
        sequence != header.sequence || hash == mine) {
      continue;
    }
    return problem(
        CommErrorKind::kMismatch,
        fmt::format(
            "collective mismatch in group '{}': rank {} called {} but rank {} called {}; every "
            "rank "
            "must issue the same collectives in the same order with the same count, dtype, op and "
            "root",
            name(), rank(), comm::describe(header), peer,
            text.substr(static_cast<std::size_t>(consumed))));
  }
  return std::nullopt;
}

// Every rank saw the same combined fingerprint, so every rank gets here for this call: gather all
// headers (bounded by the deadline) and name each rank's call. With `fallback` (an MPI error that
// may be a mismatch: MPI_ERR_TRUNCATE on the rank that got the longer message, whose peer sees a
// marked result) the gather waits 2 s at most, and `fallback` is thrown when it finds no
// difference.
void MpiProcessGroup::fail_mismatch(const Call& op, Clock::time_point deadline,
                                    const CommError* fallback) {
  constexpr std::size_t kHeaderBytes = sizeof(comm::OpHeader);
  // On the heap and kept until exit on a timeout: MPI may still write it later.
  auto headers = std::make_unique<comm::OpHeader[]>(static_cast<std::size_t>(size()) + 1);
  headers[0] = op.header;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc;
  {
    auto lock = MpiRuntime::instance().lock();
    rc = MPI_Iallgather(&headers[0], kHeaderBytes, MPI_BYTE, &headers[1], kHeaderBytes, MPI_BYTE,
                        check_, &request);
  }
  const std::string generic = fmt::format(
      "collective mismatch in group '{}': rank {} called {}, but not every rank of the group "
      "called the same; every rank must issue the same collectives in the same order with the "
      "same count, dtype, op and root",
      name(), rank(), op.description());
  const CommError unknown = fallback ? *fallback
                                     : CommError(CommErrorKind::kMismatch, generic, name(),
                                                 op.description(), op.header.sequence, -1);
  if (rc != MPI_SUCCESS) throw unknown;
  const auto limit = std::min(deadline, Clock::now() + std::chrono::seconds(fallback ? 2 : 10));
  if (!wait_request(request, limit, rc) || rc != MPI_SUCCESS) {
    MpiRuntime::instance().keep_until_exit(std::shared_ptr<void>(std::move(headers)));
    throw unknown;
  }
  // Group the ranks by the call they issued: "rank 1 called broadcast(...) #3".
  std::vector<std::pair<std::string, std::vector<int>>> calls;
  int first_other = -1;
  for (int r = 0; r < size(); ++r) {
    const comm::OpHeader& theirs = headers[static_cast<std::size_t>(r) + 1];
    if (theirs == op.header) continue;
    if (first_other < 0) first_other = r;
    const std::string call = comm::describe(theirs);
    auto it =
        std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == call; });
    if (it == calls.end()) {
      calls.push_back({call, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  if (calls.empty()) throw unknown;
  std::vector<std::string> others;
  for (const auto& [call, ranks] : calls) {
    others.push_back(fmt::format("rank{} {} called {}", ranks.size() > 1 ? "s" : "",
                                 fmt::join(ranks, ", "), call));
  }
  throw CommError(CommErrorKind::kMismatch,
                  fmt::format("collective mismatch in group '{}': rank {} called {} but {}; every "
                              "rank must issue the same collectives in the same order with the "
                              "same count, dtype, op and root",
                              name(), rank(), op.description(), fmt::join(others, " and ")),
                  name(), op.description(), op.header.sequence, first_other);
}

}  // namespace ddp::comm::mpi
