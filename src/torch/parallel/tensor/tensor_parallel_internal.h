// What the tensor-parallel files share (internal): the group check and the construction-time
// agreement of a layer across the ranks of its group.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

// *group; ConfigError naming `call` when it is null (this rank is not a member).
ProcessGroup& tp_group_or_throw(const std::shared_ptr<ProcessGroup>& group,
                                const std::string& call);

// Collective over `group`: every rank passes its description of what it was given and its own
// error ("" when none). Throws ConfigError on every rank when some rank failed (its message, or
// "rank r could not build <layer>: ...") or when the descriptions differ (naming the first
// difference). `layer` names the layer in messages.
void agree_on_layer(ProcessGroup& group, const std::string& layer, const std::string& description,
                    const std::string& local_error);

// FNV-1a of the tensor's bytes (contiguous copy): to compare full weights across ranks cheaply.
std::uint64_t tensor_fingerprint(const torch::Tensor& tensor);

}  // namespace ddp::detail
