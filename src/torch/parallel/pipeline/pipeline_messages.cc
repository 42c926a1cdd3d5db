#include "torch/parallel/pipeline/pipeline_messages.h"

#include <array>
#include <cstdint>

#include <fmt/format.h>

#include "ddp/comm/comm_error.h"
#include "ddp/error.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"
#include "torch/core/distributed_checks.h"

namespace ddp::detail {

namespace {

constexpr std::int64_t kMagic = 0x5050'0001;  // "PP", version 1
constexpr std::int64_t kData = 0;
constexpr std::int64_t kFailure = 1;
constexpr int kMaxDims = 7;
constexpr int kHeaderWords = 5 + kMaxDims;
// Word indices of the header.
constexpr int kWordMagic = 0, kWordKind = 1, kWordMicroBatch = 2, kWordDtype = 3, kWordDims = 4;

torch::Tensor make_header(std::int64_t kind, std::int64_t micro_batch) {
  auto header = torch::zeros({kHeaderWords}, torch::kInt64);
  auto* words = header.data_ptr<std::int64_t>();
  words[kWordMagic] = kMagic;
  words[kWordKind] = kind;
  words[kWordMicroBatch] = micro_batch;
  return header;
}

std::shared_ptr<Work> post_send(ProcessGroup& group, const torch::Tensor& tensor, int dst, int tag,
                                std::chrono::milliseconds timeout) {
  auto work = group.send(tensor.data_ptr(), detail::element_count(tensor), detail::dtype_of(tensor),
                         dst, tag, {.timeout = timeout});
  // The engine reads the buffer until the send completes, maybe after the caller let go of it.
  work->then([tensor](Work&) {});
  return work;
}

void receive(ProcessGroup& group, const torch::Tensor& tensor, int src, int tag,
             std::chrono::milliseconds timeout, const std::string& what) {
  try {
    group
        .recv(tensor.data_ptr(), detail::element_count(tensor), detail::dtype_of(tensor), src, tag,
              {.timeout = timeout})
        ->wait();
  } catch (const CommError& e) {
    throw CommError(
        e.kind(), fmt::format("pipeline stage {} waiting for {}: {}", group.rank(), what, e.what()),
        e.group(), e.op(), e.sequence(), e.peer());
  }
}

}  // namespace

const char* pipeline_message_name(int tag) {
  return tag == kPipelineActivationTag ? "activation" : "gradient";
}

std::shared_ptr<Work> send_pipeline_tensor(ProcessGroup& group, const torch::Tensor& tensor,
                                           int dst, int tag, int micro_batch,
                                           std::chrono::milliseconds timeout) {
  auto data = tensor.detach().contiguous();
  if (group.memory_space() == MemorySpace::kCuda) {
    if (!data.is_cuda() || data.device().index() != group.cuda_device()) {
      throw ConfigError(fmt::format(
          "pipeline stage {}: the {} of micro-batch {} is on {}, but the pp group ({}) carries "
          "the memory of cuda:{} only",
          group.rank(), pipeline_message_name(tag), micro_batch, data.device().str(),
          group.backend(), group.cuda_device()));
    }
  } else if (data.is_cuda()) {
    data = data.to(torch::kCPU);  // a host group reads host memory: staged (the copy waits)
  } else if (!data.is_cpu()) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: the {} of micro-batch {} is on {}; stages send CPU or CUDA tensors",
        group.rank(), pipeline_message_name(tag), micro_batch, data.device().str()));
  }
  if (data.dim() > kMaxDims) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: the {} of micro-batch {} has {} dimensions; at most {} can be sent "
        "between stages (reshape it)",
        group.rank(), pipeline_message_name(tag), micro_batch, data.dim(), kMaxDims));
  }
  auto header = make_header(kData, micro_batch);
  auto* words = header.data_ptr<std::int64_t>();
  words[kWordDtype] = static_cast<std::int64_t>(data.scalar_type());
  words[kWordDims] = data.dim();
  for (int d = 0; d < data.dim(); ++d)
    words[kWordDims + 1 + d] = data.size(d);
  post_send(group, header, dst, tag, timeout);
  return post_send(group, data, dst, tag, timeout);
}

torch::Tensor recv_pipeline_tensor(ProcessGroup& group, int src, int tag, int micro_batch,
                                   std::chrono::milliseconds timeout, c10::Device device) {
  const std::string what = fmt::format("the {} of micro-batch {} from stage {}",
                                       pipeline_message_name(tag), micro_batch, src);
  auto header = torch::empty({kHeaderWords}, torch::kInt64);
  receive(group, header, src, tag, timeout, what);
  const auto* words = header.data_ptr<std::int64_t>();
  if (words[kWordMagic] != kMagic) {
    throw ConfigError(fmt::format(
        "pipeline stage {}: waiting for {}, a message that is no pipeline header arrived; tags "
        "{} and {} are reserved for the pipeline",
        group.rank(), what, kPipelineActivationTag, kPipelineGradientTag));
  }
  if (words[kWordKind] == kFailure) {
    const auto origin = static_cast<int>(words[kWordMicroBatch]);
    throw PipelinePeerFailed(
        origin, fmt::format("pipeline stage {} stopped: stage {} failed (stage {} told it while "
                            "it waited for {})",
                            group.rank(), origin, src, what));
  }
  if (words[kWordMicroBatch] != micro_batch) {
    throw ConfigError(fmt::format(
        "pipeline stage {} waited for {} but stage {} sent micro-batch {}: the stages run "
        "different schedules or micro-batch counts",
        group.rank(), what, src, words[kWordMicroBatch]));
  }
  const auto dims = words[kWordDims];
  std::vector<std::int64_t> shape(words + kWordDims + 1, words + kWordDims + 1 + dims);
  // Into the stage's device where the group carries it (nccl), else into host memory, then there.
  const bool direct = group.memory_space() == MemorySpace::kCuda;
  auto tensor = torch::empty(shape, torch::TensorOptions()
                                        .dtype(static_cast<torch::ScalarType>(words[kWordDtype]))
                                        .device(direct ? device : c10::Device(c10::kCPU)));
  receive(group, tensor, src, tag, timeout, what);
  return direct || device.is_cpu() ? tensor : tensor.to(device);
}

void send_pipeline_failure(ProcessGroup& group, int dst, int tag, int origin,
                           std::chrono::milliseconds timeout) noexcept {
  try {
    post_send(group, make_header(kFailure, origin), dst, tag, timeout);
  } catch (...) {  // NOLINT: the failure being reported is the error that matters
  }
}

}  // namespace ddp::detail
