#include "torch/checkpoint/dcp_info.h"

#include <array>
#include <utility>

#include <fmt/format.h>

namespace ddp::detail {
namespace {

struct DtypeName {
  std::string_view name;
  at::ScalarType type;
};

// float8: not in every libtorch ddp builds against (1.13 has none); refused by name.
constexpr std::array<DtypeName, 12> kDtypes = {{
    {"float32", at::kFloat},
    {"float64", at::kDouble},
    {"float16", at::kHalf},
    {"bfloat16", at::kBFloat16},
    {"int64", at::kLong},
    {"int32", at::kInt},
    {"int16", at::kShort},
    {"int8", at::kChar},
    {"uint8", at::kByte},
    {"bool", at::kBool},
    {"complex64", at::kComplexFloat},
    {"complex128", at::kComplexDouble},
}};

DcpStorageInfo storage_info(archive::DcpStorage s) {
  return {std::move(s.file), s.offset, s.length};
}

}  // namespace

at::ScalarType dcp_scalar_type(const std::string& name) {
  for (const DtypeName& d : kDtypes) {
    if (d.name == name) return d.type;
  }
  throw StateDictFormatError(fmt::format("the dtype torch.{} is not one ddp reads", name));
}

std::string dcp_dtype_name(at::ScalarType type) {
  for (const DtypeName& d : kDtypes) {
    if (d.type == type) return std::string(d.name);
  }
  throw ConfigError(fmt::format(
      "a tensor of dtype {} cannot be saved in a distributed checkpoint here (ddp writes "
      "float16/32/64, bfloat16, int8/16/32/64, uint8, bool and complex64/128)",
      c10::toString(type)));
}

DcpCheckpointInfo dcp_checkpoint_info(archive::DcpMetadata parsed, const std::string& file) {
  DcpCheckpointInfo info;
  info.version = std::move(parsed.version);
  info.order = std::move(parsed.order);
  for (auto& [name, keys] : parsed.paths) {
    std::vector<DcpPathKey> path;
    for (auto& key : keys)
      path.push_back({std::move(key.name), key.index});
    info.paths.emplace(name, std::move(path));
  }
  for (auto& [name, entry] : parsed.tensors) {
    DcpTensorInfo tensor;
    try {
      tensor.dtype = dcp_scalar_type(entry.dtype);
    } catch (const StateDictFormatError& e) {
      throw StateDictFormatError(fmt::format("{}: the entry '{}': {}", file, name, e.what()));
    }
    tensor.shape = std::move(entry.shape);
    for (auto& chunk : entry.chunks) {
      tensor.chunks.push_back({std::move(chunk.offsets), std::move(chunk.sizes),
                               storage_info(std::move(chunk.storage))});
    }
    info.tensors.emplace(name, std::move(tensor));
  }
  for (auto& [name, storage] : parsed.values)
    info.values.emplace(name, storage_info(std::move(storage)));
  return info;
}

}  // namespace ddp::detail
