// Point to point of the tensor-level API, and monitored_barrier (built on it).
#include <chrono>
#include <cstdint>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/torch/api/distributed.h"
#include "torch/core/distributed_checks.h"
#include "torch/core/host_staging.h"

namespace ddp {

using detail::check_tensor;
using detail::dtype_of;
using detail::element_count;
using detail::must_stage;
using detail::run_on_host;
using Tensors = std::vector<torch::Tensor>;

namespace {

// Reserved for monitored_barrier's messages (below MPI's guaranteed minimum MPI_TAG_UB, 32767).
constexpr int kMonitoredBarrierTag = 32761;

std::shared_ptr<Work> with_result(std::shared_ptr<Work> work, const torch::Tensor& tensor) {
  work->set_result(std::vector<torch::Tensor>{tensor});
  return work;
}

}  // namespace

std::shared_ptr<Work> isend(const torch::Tensor& tensor, int dst, int tag, GroupRef group) {
  ProcessGroup& g = group.get_for(tensor);
  if (must_stage(g, {tensor})) {
    return run_on_host(g, {tensor}, {}, [&](const Tensors& r, const Tensors&, ProcessGroup& on) {
      return isend(r[0], dst, tag, on);
    });
  }
  check_tensor(tensor, "isend: tensor", &g);
  return with_result(g.send(tensor.data_ptr(), element_count(tensor), dtype_of(tensor), dst, tag,
                            detail::device_call_options(g, tensor)),
                     tensor);
}

std::shared_ptr<Work> irecv(const torch::Tensor& tensor, int src, int tag, GroupRef group) {
  ProcessGroup& g = group.get_for(tensor);
  if (must_stage(g, {tensor})) {
    return run_on_host(g, {}, {tensor}, [&](const Tensors&, const Tensors& w, ProcessGroup& on) {
      return irecv(w[0], src, tag, on);
    });
  }
  check_tensor(tensor, "irecv: tensor", &g);
  return with_result(g.recv(tensor.data_ptr(), element_count(tensor), dtype_of(tensor), src, tag,
                            detail::device_call_options(g, tensor)),
                     tensor);
}

void send(const torch::Tensor& tensor, int dst, int tag, GroupRef group) {
  isend(tensor, dst, tag, group)->wait();
}

int recv(const torch::Tensor& tensor, int src, int tag, GroupRef group) {
  irecv(tensor, src, tag, group)->wait();
  return src;
}

int recv_any_source(const torch::Tensor& tensor, int tag, GroupRef group) {
  ProcessGroup& routed = GroupRef(group).get_for(tensor);
  ProcessGroup& g = group.get();
  if (&g != &routed) {
    throw ConfigError(
        "recv_any_source: the tensor is on a CUDA device and no group was passed; under "
        "DDP_BACKEND=auto CUDA tensors go to the nccl group, which has no receive from any "
        "source. Receive into a CPU tensor (and send CPU tensors), or pass the default group "
        "(ddp::default_process_group()) to receive through host memory");
  }
  if (must_stage(g, {tensor})) {
    int source = -1;
    run_on_host(
        g, {}, {tensor},
        [&](const Tensors&, const Tensors& w, ProcessGroup& on) {
          source = recv_any_source(w[0], tag, on);
          auto received =
              std::make_shared<Work>("recv_any_source (staged)", std::chrono::milliseconds(0));
          received->complete();
          return received;
        },
        /*blocking=*/true);
    return source;
  }
  check_tensor(tensor, "recv_any_source: tensor");
  int source = -1;
  // Blocking: `source` outlives the operation (a failed one is finished with by the engine).
  g.recv_any_source(tensor.data_ptr(), element_count(tensor), dtype_of(tensor), &source, tag)
      ->wait();
  return source;
}

std::vector<std::shared_ptr<Work>> batch_isend_irecv(const std::vector<P2POp>& ops) {
  // Check everything before starting anything, so a bad entry leaves nothing half-posted.
  ProcessGroup* common = nullptr;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    ProcessGroup& g = op.group.get_for(op.tensor);
    if (common != nullptr && common != &g) {
      throw ConfigError(fmt::format(
          "batch_isend_irecv: ops[{}] names another group than ops[0]; all operations of a batch "
          "must use the same group",
          i));
    }
    common = &g;
    detail::check_tensor_on(g, op.tensor, fmt::format("batch_isend_irecv: ops[{}].tensor", i));
    if (op.peer < 0 || op.peer >= g.size() || op.peer == g.rank()) {
      throw ConfigError(fmt::format(
          "batch_isend_irecv: ops[{}].peer is {}; it must be another rank of the group (0..{}, "
          "not this rank {})",
          i, op.peer, g.size() - 1, g.rank()));
    }
  }
  std::vector<std::shared_ptr<Work>> works;
  works.reserve(ops.size());
  for (const auto& op : ops) {
    works.push_back(op.op == P2POp::Kind::kIsend ? isend(op.tensor, op.peer, op.tag, *common)
                                                 : irecv(op.tensor, op.peer, op.tag, *common));
  }
  return works;
}

// Every rank reports to rank 0 and waits for its release. Rank 0 posts every receive at once and
// waits for them against one deadline, so it can name every rank whose report had not arrived by
// then. Cost: 2 (n - 1) one-byte messages through rank 0.
void monitored_barrier(MonitoredBarrierOptions options, GroupRef group) {
  ProcessGroup& g = group.get();
  using Clock = std::chrono::steady_clock;
  using std::chrono::milliseconds;
  if (options.timeout.count() < 0) {
    throw ConfigError(
        fmt::format("monitored_barrier: the timeout is negative ({} ms)", options.timeout.count()));
  }
  const milliseconds timeout = options.timeout.count() == 0 ? milliseconds(30000) : options.timeout;
  if (g.size() == 1) return;
  // Buffers live as long as the operations that may still write them after a failure here.
  const auto n = static_cast<std::size_t>(g.size());
  auto tokens = std::make_shared<std::vector<std::uint8_t>>(n + 1, 1);
  auto keep = [tokens](Work&) {};
  std::uint8_t* token = &tokens->back();
  if (g.rank() != 0) {
    g.send(token, 1, DType::kUInt8, 0, kMonitoredBarrierTag, {.timeout = timeout})->wait();
    auto release =
        g.recv(token, 1, DType::kUInt8, 0, kMonitoredBarrierTag, {.timeout = 2 * timeout});
    release->then(keep);
    if (!release->wait_for(2 * timeout + milliseconds(1000)) || release->error()) {
      throw TimeoutError(fmt::format(
          "monitored_barrier: rank 0 did not release rank {} within {} ms: some rank did not "
          "arrive (rank 0's error names it)",
          g.rank(), (2 * timeout).count()));
    }
    return;
  }
  std::vector<std::shared_ptr<Work>> reports(n);
  for (int r = 1; r < g.size(); ++r) {
    auto& report = reports[static_cast<std::size_t>(r)];
    report = g.recv(&(*tokens)[static_cast<std::size_t>(r)], 1, DType::kUInt8, r,
                    kMonitoredBarrierTag, {.timeout = timeout});
    report->then(keep);
  }
  const auto deadline = Clock::now() + timeout;
  std::vector<int> missing;
  for (int r = 1; r < g.size(); ++r) {
    auto& report = reports[static_cast<std::size_t>(r)];
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    const bool arrived = report->wait_for(std::max(left, milliseconds(0))) && !report->error();
    if (!arrived) {
      missing.push_back(r);
      if (!options.wait_all_ranks) break;
    }
  }
  if (!missing.empty()) {
    throw TimeoutError(fmt::format(
        "monitored_barrier: {} {} of group of {} did not arrive within {} ms{}",
        missing.size() == 1 ? "rank" : "ranks", fmt::join(missing, ", "), g.size(), timeout.count(),
        options.wait_all_ranks ? "" : " (the first missing rank; wait_all_ranks names them all)"));
  }
  std::vector<std::shared_ptr<Work>> releases;
  for (int r = 1; r < g.size(); ++r) {
    releases.push_back(
        g.send(token, 1, DType::kUInt8, r, kMonitoredBarrierTag, {.timeout = timeout}));
  }
  for (auto& release : releases)
    release->wait();
}

}  // namespace ddp
