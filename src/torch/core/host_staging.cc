#include "torch/core/host_staging.h"

#include "torch/core/host_values.h"

#include <atomic>

namespace ddp::detail {

namespace {

// Set on the thread that runs a staged call's inner call, which gets host tensors (or, in tests,
// CPU clones that must not be staged again).
thread_local bool staging_inner_call_running = false;
thread_local int staging_cpu_tensors_for_tests = 0;
std::atomic<std::size_t> copies_to_host_count{0}, copies_back_count{0};

bool is_staged_tensor(const torch::Tensor& t) {
  return t.defined() && (t.is_cuda() || (staging_cpu_tensors_for_tests > 0 && t.device().is_cpu()));
}

torch::Tensor staged_host_copy(const torch::Tensor& t) {
  if (!is_staged_tensor(t)) return t;
  ++copies_to_host_count;
  // Synchronous: after the work queued on the current stream, as the caller sees the tensor.
  return t.is_cuda() ? t.to(torch::kCPU) : t.clone();
}

}  // namespace

bool must_stage(ProcessGroup& group, const std::vector<torch::Tensor>& tensors,
                bool packs_on_host) {
  if (staging_inner_call_running) return false;
  if (group.memory_space() != MemorySpace::kHost && !packs_on_host) return false;
  for (const auto& t : tensors) {
    if (is_staged_tensor(t)) return true;
  }
  return false;
}

std::shared_ptr<Work> run_on_host(ProcessGroup& group, const std::vector<torch::Tensor>& read,
                                  const std::vector<torch::Tensor>& written, const StagedCall& call,
                                  bool blocking, const std::vector<torch::Tensor>* result) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> host_read, host_written;
  host_read.reserve(read.size());
  host_written.reserve(written.size());
  for (const auto& t : read)
    host_read.push_back(staged_host_copy(t));
  for (const auto& t : written)
    host_written.push_back(staged_host_copy(t));
  // A CUDA group's relay lives until the call's Work completes (the chain below holds it).
  auto on = std::make_shared<detail::HostValues>(group);
  std::shared_ptr<Work> work;
  staging_inner_call_running = true;
  try {
    work = call(host_read, host_written, **on);
  } catch (...) {
    staging_inner_call_running = false;
    throw;
  }
  staging_inner_call_running = false;
  // The inner Work's own callbacks (unpacking a list) run before this step: it was chained last.
  auto chain =
      work->and_then([on, host_read, host_written, written,
                      outputs = result != nullptr ? *result : written](Work& done) mutable {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < written.size(); ++i) {
          if (host_written[i].unsafeGetTensorImpl() == written[i].unsafeGetTensorImpl()) continue;
          written[i].copy_(host_written[i]);
          ++copies_back_count;
        }
        done.set_result(outputs);
        return std::shared_ptr<Work>();
      });
  if (!blocking) return chain;
  chain->wait();
  return Work::completed_blocking_call();
}

ScopedStagingOfCpuTensorsForTests::ScopedStagingOfCpuTensorsForTests() {
  ++staging_cpu_tensors_for_tests;
  copies_to_host_count = 0;
  copies_back_count = 0;
}
ScopedStagingOfCpuTensorsForTests::~ScopedStagingOfCpuTensorsForTests() {
  --staging_cpu_tensors_for_tests;
}
std::size_t ScopedStagingOfCpuTensorsForTests::copies_to_host() const {
  return copies_to_host_count;
}
std::size_t ScopedStagingOfCpuTensorsForTests::copies_back() const {
  return copies_back_count;
}

}  // namespace ddp::detail
