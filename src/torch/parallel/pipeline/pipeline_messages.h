// The messages between pipeline stages (internal to pipeline_stage.cc and pipeline_step.cc): a
// tensor as a 12-word header (micro-batch, dtype, shape) followed by its data, and a failure notice
// (a header alone) that tells a neighbour to stop waiting. Activations travel on
// kPipelineActivationTag from stage s to s + 1, gradients on kPipelineGradientTag from s to s - 1,
// so a stage reads each neighbour on one tag and a notice sent there is the next message it reads.
#pragma once

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"
#include "ddp/comm/work.h"

namespace ddp::detail {

// What the message carries, for error texts: "activation" or "gradient".
const char* pipeline_message_name(int tag);

// A neighbour sent a failure notice: stage `origin` failed and the step is over.
class PipelinePeerFailed : public std::runtime_error {
 public:
  PipelinePeerFailed(int origin, const std::string& message)
      : std::runtime_error(message), origin_(origin) {}
  int origin() const { return origin_; }

 private:
  int origin_;
};

// Posts the header and the data of `tensor` (made contiguous here) to `dst`; returns the data's
// Work. The buffers stay alive until the sends complete, whatever the caller keeps. A CUDA tensor
// goes through a host copy over a host group (ring, mpi); over a CUDA group (nccl) it must be on
// the group's GPU, and a CPU tensor is a ConfigError there.
std::shared_ptr<Work> send_pipeline_tensor(ProcessGroup& group, const torch::Tensor& tensor,
                                           int dst, int tag, int micro_batch,
                                           std::chrono::milliseconds timeout);

// Receives the next message from `src` on `tag`: the tensor of `micro_batch` (ConfigError when
// another micro-batch comes: the stages run different schedules), or PipelinePeerFailed for a
// failure notice. A CommError (timeout, peer gone) is rethrown with the stage's context. The
// tensor is on `device` (the receiving stage's): received there over a CUDA group, else into host
// memory and then copied there.
torch::Tensor recv_pipeline_tensor(ProcessGroup& group, int src, int tag, int micro_batch,
                                   std::chrono::milliseconds timeout, c10::Device device);

// Posts a failure notice naming stage `origin` to `dst` on `tag`; never throws (the connection
// may be the one that failed).
void send_pipeline_failure(ProcessGroup& group, int dst, int tag, int origin,
                           std::chrono::milliseconds timeout) noexcept;

}  // namespace ddp::detail
