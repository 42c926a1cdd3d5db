// Object collectives: PyTorch's broadcast_object_list, all_gather_object, gather_object and
// scatter_object_list for any C++ type with a codec.
//
//   std::vector<std::string> names{"a", "b"};                  // filled on src, resized elsewhere
//   ddp::broadcast_object_list(names, /*src=*/0);
//   std::vector<double> losses;
//   ddp::all_gather_object(losses, my_loss);                    // losses[r] = rank r's my_loss
//
// A codec is a specialisation of ddp::ObjectCodec<T> with
//   static std::string encode(const T&);          // bytes; may throw
//   static T decode(const std::string& bytes);    // may throw
// Built in: std::string, arithmetic types (their bytes: every rank must share the byte order,
// as ranks of one job do), torch::Tensor and c10::IValue (libtorch's pickler, torch::pickle_save;
// tensors must be on the CPU), and nlohmann::json (include ddp/torch/api/json_codec.h).
//
// Calls are collective over the group (default: the default group, as in distributed.h), made by
// every rank in the same order. Each first exchanges every contributing rank's status and size:
// when an encoder throws on some rank, every rank throws ObjectCodecError naming the ranks and
// their messages, and nothing else is sent (no rank is left waiting). A decoder that throws fails
// on the rank that decodes only (the data has already moved). Errors of the group (CommError,
// TimeoutError) pass through. Blocking; thread-safety as for ProcessGroup.
#pragma once

#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// An object could not be encoded (on some rank: the message names it) or decoded (on this rank).
class ObjectCodecError : public Error {
 public:
  using Error::Error;
};

template <class T, class Enable = void>
struct ObjectCodec;  // specialise for your types

template <>
struct ObjectCodec<std::string> {
  static std::string encode(const std::string& value) { return value; }
  static std::string decode(const std::string& bytes) { return bytes; }
};

template <class T>
struct ObjectCodec<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  static std::string encode(const T& value) {
    std::string bytes(sizeof(T), '\0');
    std::memcpy(bytes.data(), &value, sizeof(T));
    return bytes;
  }
  static T decode(const std::string& bytes) {
    if (bytes.size() != sizeof(T)) {
      throw ObjectCodecError("an arithmetic object of " + std::to_string(sizeof(T)) +
                             " bytes arrived as " + std::to_string(bytes.size()) +
                             " bytes: the ranks disagree on the object type");
    }
    T value;
    std::memcpy(&value, bytes.data(), sizeof(T));
    return value;
  }
};

template <>
struct ObjectCodec<c10::IValue> {
  static std::string encode(const c10::IValue& value);
  static c10::IValue decode(const std::string& bytes);
};

template <>
struct ObjectCodec<torch::Tensor> {
  static std::string encode(const torch::Tensor& value);
  static torch::Tensor decode(const std::string& bytes);
};

namespace detail {

// What one rank contributes: the encoded bytes, or the message of its encoder's exception.
struct Encoded {
  std::string bytes;
  bool failed = false;
};

template <class T>
Encoded encode_object(const T& value) {
  try {
    return {ObjectCodec<T>::encode(value), false};
  } catch (const std::exception& e) {
    return {e.what(), true};
  } catch (...) {
    return {"an exception that is not a std::exception", true};
  }
}

template <class T>
T decode_object(const std::string& bytes, const char* op, std::size_t index) {
  try {
    return ObjectCodec<T>::decode(bytes);
  } catch (const ObjectCodecError&) {
    throw;
  } catch (const std::exception& e) {
    throw ObjectCodecError(std::string(op) + ": decoding object " + std::to_string(index) +
                           " failed: " + e.what());
  }
}

// The byte-level collectives below the templates (distributed_objects.cc). Each throws
// ObjectCodecError on every rank when an entry of some rank has failed = true.
std::vector<std::string> all_gather_bytes(ProcessGroup& group, const Encoded& mine);
// On dst: every rank's bytes; elsewhere: empty.
std::vector<std::string> gather_bytes(ProcessGroup& group, const Encoded& mine, int dst);
// `objects` matters on src only; returns src's list on every rank.
std::vector<std::string> broadcast_bytes(ProcessGroup& group, const std::vector<Encoded>& objects,
                                         int src);
// `objects` (one per rank) matters on src only; returns this rank's entry.
std::string scatter_bytes(ProcessGroup& group, const std::vector<Encoded>& objects, int src);

}  // namespace detail

// object_list on every rank becomes src's (resized to its length).
template <class T>
void broadcast_object_list(std::vector<T>& object_list, int src = 0, GroupRef group = {}) {
  ProcessGroup& g = group.get();
  std::vector<detail::Encoded> encoded;
  if (g.rank() == src) {
    for (const auto& object : object_list)
      encoded.push_back(detail::encode_object(object));
  }
  const auto bytes = detail::broadcast_bytes(g, encoded, src);
  if (g.rank() == src) return;
  std::vector<T> decoded;
  decoded.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    decoded.push_back(detail::decode_object<T>(bytes[i], "broadcast_object_list", i));
  }
  object_list = std::move(decoded);
}

// object_list = every rank's `object`, in rank order (resized to the group's size).
template <class T>
void all_gather_object(std::vector<T>& object_list, const T& object, GroupRef group = {}) {
  ProcessGroup& g = group.get();
  const auto bytes = detail::all_gather_bytes(g, detail::encode_object(object));
  std::vector<T> decoded;
  decoded.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    decoded.push_back(detail::decode_object<T>(bytes[i], "all_gather_object", i));
  }
  object_list = std::move(decoded);
}

// On dst, object_gather_list = every rank's `object` in rank order; untouched elsewhere.
template <class T>
void gather_object(const T& object, std::vector<T>& object_gather_list, int dst = 0,
                   GroupRef group = {}) {
  ProcessGroup& g = group.get();
  const auto bytes = detail::gather_bytes(g, detail::encode_object(object), dst);
  if (g.rank() != dst) return;
  std::vector<T> decoded;
  decoded.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    decoded.push_back(detail::decode_object<T>(bytes[i], "gather_object", i));
  }
  object_gather_list = std::move(decoded);
}

// scatter_object_output_list becomes {input_list[rank] of src} on every rank. On src,
// scatter_object_input_list has one object per rank (a wrong length is an ObjectCodecError on
// every rank); elsewhere it is ignored.
template <class T>
void scatter_object_list(std::vector<T>& scatter_object_output_list,
                         const std::vector<T>& scatter_object_input_list, int src = 0,
                         GroupRef group = {}) {
  ProcessGroup& g = group.get();
  std::vector<detail::Encoded> encoded;
  if (g.rank() == src) {
    for (const auto& object : scatter_object_input_list) {
      encoded.push_back(detail::encode_object(object));
    }
  }
  const auto bytes = detail::scatter_bytes(g, encoded, src);
  scatter_object_output_list.clear();
  scatter_object_output_list.push_back(
      detail::decode_object<T>(bytes, "scatter_object_list", static_cast<std::size_t>(g.rank())));
}

}  // namespace ddp
#pragma GCC visibility pop
