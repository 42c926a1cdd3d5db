// DdpBackend: ddp's engine (the ring backend: shared memory inside a host, TCP between hosts) as
// a c10d::Backend, registered with torch.distributed as "ddp" by `import torch_ddp`.
//
// One ddp ring group per c10d group: torch.distributed calls the creator once per group
// (init_process_group, new_group, new_subgroups) with that group's ranks and a prefix store of
// its own, and the ring meets its peers through that store (c10d_store_bridge.h).
//
// Every operation gloo implements for CPU tensors is here (sparse allreduce too, and recv from
// any source: ProcessGroup::recv_any_source, its sender in DdpWork::sourceRank()). Calls check
// their tensors before anything is sent (tensor_buffers.h); a call with async_op=False runs on the
// calling thread when the group is idle (CallOptions::blocking); the rest return a DdpWork
// (ddp_work.h). Failures are c10::DistBackendError; argument errors are c10::Error (RuntimeError in
// Python).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include "ddp/comm/process_group.h"
#include "ddp_work.h"
#include "future_completer.h"

namespace torch_ddp {

class DdpBackend : public c10d::Backend {
 public:
  // Creates the group's ring over `store` (blocks until every rank has connected, or throws
  // DistBackendError after `timeout`). `group_name` names it in ddp's messages.
  static c10::intrusive_ptr<c10d::Backend> create(const c10::intrusive_ptr<c10d::Store>& store,
                                                  int rank, int size,
                                                  std::chrono::milliseconds timeout,
                                                  const std::string& group_name);

  DdpBackend(std::shared_ptr<ddp::ProcessGroup> group, std::chrono::milliseconds timeout,
             std::string group_name);
  ~DdpBackend() override;

  const std::string getBackendName() const override { return "ddp"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  uint64_t getSequenceNumberForGroup() override { return sequence_.load(); }
  void setSequenceNumberForGroup() override {}

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // The engine's group (for tests and the transport line in logs).
  const std::shared_ptr<ddp::ProcessGroup>& group() const { return group_; }

 private:
  struct Step;  // one engine operation of a call and what to do after it (ddp_backend.cc)
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, const std::string& call,
                                     std::vector<Step> steps, std::vector<at::Tensor> outputs,
                                     std::shared_ptr<int> source = nullptr);
  ddp::CallOptions call_options(std::chrono::milliseconds timeout, bool async_op) const;
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(at::Tensor& tensor,
                                                  const c10d::AllreduceOptions& opts);
  Step allgather_step(const std::string& call, std::vector<at::Tensor>& outputs,
                      const at::Tensor& input, const ddp::CallOptions& options);
  Step allgather_base_step(const std::string& call, at::Tensor& output, const at::Tensor& input,
                           const ddp::CallOptions& options);
  Step reduce_scatter_base_step(const std::string& call, at::Tensor& output,
                                const at::Tensor& input, const c10d::ReduceOp& op,
                                const ddp::CallOptions& options);

  std::shared_ptr<ddp::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  std::string group_name_;
  std::shared_ptr<FutureCompleter> completer_;
  std::atomic<uint64_t> sequence_{0};
};

}  // namespace torch_ddp
