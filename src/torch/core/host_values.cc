#include "torch/core/host_values.h"

#include <atomic>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "ddp/error.h"
#include "torch/core/device_staging.h"

namespace ddp::detail {
namespace {

std::atomic<int> cpu_as_cuda_group_memory{0};
std::atomic<std::size_t> relayed_calls_count{0};

torch::Tensor host_bytes(const void* values, std::size_t bytes) {
  return torch::from_blob(const_cast<void*>(values), {static_cast<std::int64_t>(bytes)},
                          torch::kUInt8);
}

bool pretend_cpu_is_cuda() {
  return cpu_as_cuda_group_memory.load() > 0;
}

// Where a CUDA group's memory is: its device, else the current CUDA device; the CPU in tests.
torch::Device device_of(const ProcessGroup& group) {
  if (pretend_cpu_is_cuda()) return torch::kCPU;
  const int index = group.cuda_device();
  return index >= 0 ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index))
                    : torch::Device(torch::kCUDA);
}

void* data_of(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr() : nullptr;
}

// The device memory the call writes into, and where its bytes go back to on the host.
struct Output {
  torch::Tensor copy;
  void* host = nullptr;
  std::size_t bytes = 0;
};

// Relays each call of a CUDA group through device copies (see host_values.h).
class HostValueRelay final : public ProcessGroup {
 public:
  explicit HostValueRelay(ProcessGroup& group)
      : ProcessGroup(group.rank(), group.size()), group_(group), device_(device_of(group)) {}

  std::string_view backend() const override { return group_.backend(); }
  int local_rank() const override { return group_.local_rank(); }
  int local_size() const override { return group_.local_size(); }

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op, CallOptions options) override {
    const std::size_t bytes = count * dtype_size(dtype);
    auto in = copy_to_group(send, bytes);
    Output out{send == recv ? in : group_memory(bytes), recv, bytes};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.allreduce(data_of(in), data_of(out.copy), count, dtype, op, o);
    });
  }

  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root,
                                  CallOptions options) override {
    const std::size_t bytes = count * dtype_size(dtype);
    Output out{copy_to_group(buf, bytes), buf, bytes};
    return relay(options, {}, {out}, [&](CallOptions o) {
      return group_.broadcast(data_of(out.copy), count, dtype, root, o);
    });
  }

  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root, CallOptions options) override {
    const std::size_t bytes = count * dtype_size(dtype);
    auto in = copy_to_group(send, bytes);
    Output out{rank() == root && recv != nullptr ? group_memory(bytes) : torch::Tensor(),
               rank() == root ? recv : nullptr, bytes};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.reduce(data_of(in), data_of(out.copy), count, dtype, op, root, o);
    });
  }

  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count_per_rank,
                                  DType dtype, CallOptions options) override {
    const std::size_t bytes = count_per_rank * dtype_size(dtype);
    auto in = copy_to_group(send, bytes);
    Output out{group_memory(bytes * world()), recv, bytes * world()};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.allgather(data_of(in), data_of(out.copy), count_per_rank, dtype, o);
    });
  }

  std::shared_ptr<Work> gather(const void* send, void* recv, std::size_t count_per_rank,
                               DType dtype, int root, CallOptions options) override {
    const std::size_t bytes = count_per_rank * dtype_size(dtype);
    auto in = copy_to_group(send, bytes);
    const bool receives = rank() == root && recv != nullptr;
    Output out{receives ? group_memory(bytes * world()) : torch::Tensor(),
               receives ? recv : nullptr, bytes * world()};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.gather(data_of(in), data_of(out.copy), count_per_rank, dtype, root, o);
    });
  }

  std::shared_ptr<Work> scatter(const void* send, void* recv, std::size_t count_per_rank,
                                DType dtype, int root, CallOptions options) override {
    const std::size_t bytes = count_per_rank * dtype_size(dtype);
    auto in = rank() == root ? copy_to_group(send, bytes * world()) : torch::Tensor();
    Output out{group_memory(bytes), recv, bytes};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.scatter(data_of(in), data_of(out.copy), count_per_rank, dtype, root, o);
    });
  }

  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t count_per_rank,
                                       DType dtype, ReduceOp op, CallOptions options) override {
    const std::size_t bytes = count_per_rank * dtype_size(dtype);
    auto in = copy_to_group(send, bytes * world());
    Output out{group_memory(bytes), recv, bytes};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.reduce_scatter(data_of(in), data_of(out.copy), count_per_rank, dtype, op, o);
    });
  }

  std::shared_ptr<Work> alltoall(const void* send, void* recv, std::size_t count_per_rank,
                                 DType dtype, CallOptions options) override {
    const std::size_t bytes = count_per_rank * dtype_size(dtype) * world();
    auto in = copy_to_group(send, bytes);
    Output out{group_memory(bytes), recv, bytes};
    return relay(options, {in}, {out}, [&](CallOptions o) {
      return group_.alltoall(data_of(in), data_of(out.copy), count_per_rank, dtype, o);
    });
  }

  std::shared_ptr<Work> barrier(CallOptions options) override { return group_.barrier(options); }

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int dst, int tag,
                             CallOptions options) override {
    auto in = copy_to_group(buf, count * dtype_size(dtype));
    return relay(options, {in}, {}, [&](CallOptions o) {
      return group_.send(data_of(in), count, dtype, dst, tag, o);
    });
  }

  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int src, int tag,
                             CallOptions options) override {
    const std::size_t bytes = count * dtype_size(dtype);
    Output out{group_memory(bytes), buf, bytes};
    return relay(options, {}, {out}, [&](CallOptions o) {
      return group_.recv(data_of(out.copy), count, dtype, src, tag, o);
    });
  }

  std::shared_ptr<ProcessGroup> new_group(std::vector<int>) override {
    throw ConfigError(
        "new_group on the host-value relay of a CUDA group: make the subgroup on the group "
        "itself");
  }

 private:
  std::size_t world() const { return static_cast<std::size_t>(size()); }

  // `bytes` of the group's memory.
  torch::Tensor group_memory(std::size_t bytes) const {
    return torch::empty({static_cast<std::int64_t>(bytes)},
                        torch::TensorOptions().dtype(torch::kUInt8).device(device_));
  }

  // A copy of host `values` in the group's memory, queued on the device's current stream (which
  // the call then follows); undefined for a null pointer (a rooted call's unused buffer).
  torch::Tensor copy_to_group(const void* values, std::size_t bytes) const {
    if (values == nullptr) return {};
    auto copy = group_memory(bytes);
    copy.copy_(host_bytes(values, bytes));
    return copy;
  }

  // Runs `call` ordered after the current stream (where the copies were queued), then copies the
  // outputs back to the host as the Work's last step; `inputs` live until then.
  template <typename Call>
  std::shared_ptr<Work> relay(CallOptions options, std::vector<torch::Tensor> inputs,
                              std::vector<Output> outputs, const Call& call) {
    ++relayed_calls_count;
    const bool blocking = options.blocking;
    options.blocking = false;  // the copy back is chained to the call's own Work
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda()) options.cuda_stream = detail::current_cuda_stream(t.device());
    }
    for (const auto& out : outputs) {
      if (out.copy.defined() && out.copy.is_cuda())
        options.cuda_stream = detail::current_cuda_stream(out.copy.device());
    }
    auto work = call(options)->and_then(
        [inputs = std::move(inputs), outputs = std::move(outputs)](Work&) -> std::shared_ptr<Work> {
          torch::NoGradGuard no_grad;
          for (const auto& out : outputs) {
            if (out.copy.defined() && out.host != nullptr && out.host != out.copy.data_ptr())
              host_bytes(out.host, out.bytes).copy_(out.copy);
          }
          return nullptr;
        });
    if (!blocking) return work;
    work->wait();
    return Work::completed_blocking_call();
  }

  ProcessGroup& group_;
  const torch::Device device_;
};

}  // namespace

HostValues::HostValues(ProcessGroup& group)
    : relay_(group.memory_space() == MemorySpace::kHost ? nullptr
                                                        : std::make_unique<HostValueRelay>(group)),
      group_(relay_ ? relay_.get() : &group) {}

HostValues::~HostValues() = default;

ScopedCpuAsCudaGroupMemoryForTests::ScopedCpuAsCudaGroupMemoryForTests() {
  ++cpu_as_cuda_group_memory;
  relayed_calls_count = 0;
}

ScopedCpuAsCudaGroupMemoryForTests::~ScopedCpuAsCudaGroupMemoryForTests() {
  --cpu_as_cuda_group_memory;
}

std::size_t ScopedCpuAsCudaGroupMemoryForTests::relayed_calls() const {
  return relayed_calls_count.load();
}

bool takes_as_is(const ProcessGroup& group, const c10::Device& device) {
  if (group.memory_space() == MemorySpace::kHost) return device.is_cpu();
  return device.is_cuda() || (device.is_cpu() && pretend_cpu_is_cuda());
}

}  // namespace ddp::detail
