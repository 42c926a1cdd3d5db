// ObjectCodec for nlohmann::json (distributed_objects.h): the value travels as its JSON text.
// Separate from distributed_objects.h so that only programs that use JSON need nlohmann/json.
//
//   nlohmann::json config = rank == 0 ? load() : nlohmann::json{};
//   std::vector<nlohmann::json> box{config};
//   ddp::broadcast_object_list(box, 0);
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "ddp/torch/api/distributed_objects.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

template <>
struct ObjectCodec<nlohmann::json> {
  static std::string encode(const nlohmann::json& value) { return value.dump(); }
  static nlohmann::json decode(const std::string& bytes) { return nlohmann::json::parse(bytes); }
};

}  // namespace ddp
#pragma GCC visibility pop
