// The public description of a distributed checkpoint (DcpCheckpointInfo) made from what the
// archive layer parsed: shared by the reader and the writer of the format.
#pragma once

#include <string>

#include <torch/torch.h>

#include "archive/dcp_metadata.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"

namespace ddp::detail {

// PyTorch's dtype name ("float32") to libtorch's type; StateDictFormatError for a name ddp does
// not read (float8: not in every libtorch ddp builds against).
at::ScalarType dcp_scalar_type(const std::string& name);
// The reverse; ConfigError for a type the format cannot hold here.
std::string dcp_dtype_name(at::ScalarType type);

// `parsed` as DcpCheckpointInfo; `file` names the metadata in errors.
DcpCheckpointInfo dcp_checkpoint_info(archive::DcpMetadata parsed, const std::string& file);

}  // namespace ddp::detail
