// The byte-level object collectives below distributed_objects.h. Each first exchanges a status
// and the sizes, so that a rank whose encoder failed tells the others (they throw the same
// ObjectCodecError) instead of leaving them waiting for bytes that never come.
#include <algorithm>
#include <cstdint>
#include <numeric>

#include <fmt/format.h>

#include <torch/serialize.h>

#include "ddp/torch/api/distributed_objects.h"
#include "torch/core/host_values.h"

namespace ddp {

std::string ObjectCodec<c10::IValue>::encode(const c10::IValue& value) {
  const std::vector<char> bytes = torch::pickle_save(value);
  return std::string(bytes.begin(), bytes.end());
}

c10::IValue ObjectCodec<c10::IValue>::decode(const std::string& bytes) {
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
}

std::string ObjectCodec<torch::Tensor>::encode(const torch::Tensor& value) {
  if (value.defined() && !value.device().is_cpu()) {
    throw ObjectCodecError(fmt::format(
        "a tensor on {} cannot be sent as an object; move it to the CPU first (tensor.cpu())",
        value.device().str()));
  }
  return ObjectCodec<c10::IValue>::encode(c10::IValue(value));
}

torch::Tensor ObjectCodec<torch::Tensor>::decode(const std::string& bytes) {
  c10::IValue value = ObjectCodec<c10::IValue>::decode(bytes);
  if (!value.isTensor()) {
    throw ObjectCodecError(fmt::format("expected a pickled tensor, got a {}", value.tagKind()));
  }
  return value.toTensor();
}

namespace detail {
namespace {

using Words = std::vector<std::int64_t>;

Words all_gather_words(ProcessGroup& g, const Words& mine) {
  Words all(mine.size() * static_cast<std::size_t>(g.size()));
  g.allgather(mine.data(), all.data(), mine.size(), DType::kInt64)->wait();
  return all;
}

void broadcast_words(ProcessGroup& g, Words& words, int src) {
  g.broadcast(words.data(), words.size(), DType::kInt64, src)->wait();
}

// Splits `flat` into pieces of `sizes` bytes.
std::vector<std::string> split(const std::string& flat, const std::vector<std::size_t>& sizes) {
  std::vector<std::string> pieces;
  pieces.reserve(sizes.size());
  std::size_t at = 0;
  for (std::size_t size : sizes) {
    pieces.push_back(flat.substr(at, size));
    at += size;
  }
  return pieces;
}

// Every rank's status and size came in `words` (2 per rank); when some failed, every rank gathers
// the failing ranks' messages and throws them.
void throw_if_any_failed(ProcessGroup& g, const Words& words, const Encoded& mine, const char* op) {
  const auto n = static_cast<std::size_t>(g.size());
  std::vector<std::size_t> message_sizes(n, 0);
  bool any = false;
  for (std::size_t r = 0; r < n; ++r) {
    if (words[2 * r] != 0) {
      message_sizes[r] = static_cast<std::size_t>(words[2 * r + 1]);
      any = true;
    }
  }
  if (!any) return;
  const std::string& text = mine.failed ? mine.bytes : std::string();
  std::string all(std::accumulate(message_sizes.begin(), message_sizes.end(), std::size_t{0}),
                  '\0');
  g.allgather_v(text.data(), text.size(), all.data(), message_sizes, DType::kUInt8)->wait();
  const auto messages = split(all, message_sizes);
  std::vector<std::string> parts;
  for (std::size_t r = 0; r < n; ++r) {
    if (words[2 * r] != 0) parts.push_back(fmt::format("rank {}: {}", r, messages[r]));
  }
  throw ObjectCodecError(fmt::format("{}: encoding the object failed on {} (seen from rank {})", op,
                                     fmt::join(parts, "; "), g.rank()));
}

// src announces (status, length) and, when it failed, the message; every rank throws it.
void broadcast_status(ProcessGroup& g, int src, const std::string* failure, const char* op) {
  Words header{failure ? 1 : 0, failure ? static_cast<std::int64_t>(failure->size()) : 0};
  broadcast_words(g, header, src);
  if (header[0] == 0) return;
  std::string message(static_cast<std::size_t>(header[1]), '\0');
  if (g.rank() == src) message = *failure;
  g.broadcast(message.data(), message.size(), DType::kUInt8, src)->wait();
  throw ObjectCodecError(fmt::format("{}: encoding failed on src rank {}: {} (seen from rank {})",
                                     op, src, message, g.rank()));
}

std::string failures_of(const std::vector<Encoded>& objects) {
  std::vector<std::string> parts;
  for (std::size_t i = 0; i < objects.size(); ++i) {
    if (objects[i].failed) parts.push_back(fmt::format("object {}: {}", i, objects[i].bytes));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

}  // namespace

std::vector<std::string> all_gather_bytes(ProcessGroup& group, const Encoded& mine) {
  // A CUDA group reads device memory only: the bytes travel through device copies there.
  detail::HostValues values(group);
  ProcessGroup& g = *values;
  const auto words =
      all_gather_words(g, {mine.failed ? 1 : 0, static_cast<std::int64_t>(mine.bytes.size())});
  throw_if_any_failed(g, words, mine, "all_gather_object");
  std::vector<std::size_t> sizes(static_cast<std::size_t>(g.size()));
  for (std::size_t r = 0; r < sizes.size(); ++r)
    sizes[r] = static_cast<std::size_t>(words[2 * r + 1]);
  std::string all(std::accumulate(sizes.begin(), sizes.end(), std::size_t{0}), '\0');
  g.allgather_v(mine.bytes.data(), mine.bytes.size(), all.data(), sizes, DType::kUInt8)->wait();
  return split(all, sizes);
}

std::vector<std::string> gather_bytes(ProcessGroup& group, const Encoded& mine, int dst) {
  // A CUDA group reads device memory only: the bytes travel through device copies there.
  detail::HostValues values(group);
  ProcessGroup& g = *values;
  if (dst < 0 || dst >= g.size()) {
    // The same verdict on every rank: nothing is sent.
    throw ConfigError(
        fmt::format("gather_object: dst {} is not a rank of the group (0..{})", dst, g.size() - 1));
  }
  const auto words =
      all_gather_words(g, {mine.failed ? 1 : 0, static_cast<std::int64_t>(mine.bytes.size())});
  throw_if_any_failed(g, words, mine, "gather_object");
  const auto n = static_cast<std::size_t>(g.size());
  std::vector<std::size_t> sizes(n);
  for (std::size_t r = 0; r < n; ++r)
    sizes[r] = static_cast<std::size_t>(words[2 * r + 1]);
  // Blocks padded to the largest object: the engine's gather moves equal blocks.
  const std::size_t block = *std::max_element(sizes.begin(), sizes.end());
  std::string padded = mine.bytes;
  padded.resize(block, '\0');
  std::string all(g.rank() == dst ? block * n : 0, '\0');
  g.gather(padded.data(), g.rank() == dst ? all.data() : nullptr, block, DType::kUInt8, dst)
      ->wait();
  if (g.rank() != dst) return {};
  std::vector<std::string> pieces;
  for (std::size_t r = 0; r < n; ++r)
    pieces.push_back(all.substr(r * block, sizes[r]));
  return pieces;
}

std::vector<std::string> broadcast_bytes(ProcessGroup& group, const std::vector<Encoded>& objects,
                                         int src) {
  // A CUDA group reads device memory only: the bytes travel through device copies there.
  detail::HostValues values(group);
  ProcessGroup& g = *values;
  if (src < 0 || src >= g.size()) {
    throw ConfigError(fmt::format(
        "broadcast_object_list: src {} is not a rank of the group (0..{})", src, g.size() - 1));
  }
  const bool is_src = g.rank() == src;
  const std::string failure = is_src ? failures_of(objects) : std::string();
  broadcast_status(g, src, failure.empty() ? nullptr : &failure, "broadcast_object_list");
  Words count{static_cast<std::int64_t>(objects.size())};
  broadcast_words(g, count, src);
  Words sizes(static_cast<std::size_t>(count[0]));
  if (is_src) {
    for (std::size_t i = 0; i < objects.size(); ++i)
      sizes[i] = static_cast<std::int64_t>(objects[i].bytes.size());
  }
  broadcast_words(g, sizes, src);
  std::vector<std::size_t> lengths(sizes.begin(), sizes.end());
  std::string flat;
  if (is_src) {
    for (const auto& object : objects)
      flat += object.bytes;
  } else {
    flat.resize(std::accumulate(lengths.begin(), lengths.end(), std::size_t{0}));
  }
  g.broadcast(flat.data(), flat.size(), DType::kUInt8, src)->wait();
  return split(flat, lengths);
}

std::string scatter_bytes(ProcessGroup& group, const std::vector<Encoded>& objects, int src) {
  // A CUDA group reads device memory only: the bytes travel through device copies there.
  detail::HostValues values(group);
  ProcessGroup& g = *values;
  if (src < 0 || src >= g.size()) {
    throw ConfigError(fmt::format("scatter_object_list: src {} is not a rank of the group (0..{})",
                                  src, g.size() - 1));
  }
  const bool is_src = g.rank() == src;
  const auto n = static_cast<std::size_t>(g.size());
  std::string failure;
  if (is_src) {
    failure = objects.size() != n
                  ? fmt::format(
                        "scatter_object_input_list has {} objects; it needs one per rank "
                        "of the group ({})",
                        objects.size(), n)
                  : failures_of(objects);
  }
  broadcast_status(g, src, failure.empty() ? nullptr : &failure, "scatter_object_list");
  Words sizes(n);
  if (is_src) {
    for (std::size_t i = 0; i < n; ++i)
      sizes[i] = static_cast<std::int64_t>(objects[i].bytes.size());
  }
  broadcast_words(g, sizes, src);
  const std::size_t block = static_cast<std::size_t>(*std::max_element(sizes.begin(), sizes.end()));
  std::string flat;
  if (is_src) {
    flat.assign(block * n, '\0');
    for (std::size_t i = 0; i < n; ++i)
      std::copy(objects[i].bytes.begin(), objects[i].bytes.end(),
                flat.begin() + static_cast<std::ptrdiff_t>(i * block));
  }
  std::string mine(block, '\0');
  g.scatter(is_src ? flat.data() : nullptr, mine.data(), block, DType::kUInt8, src)->wait();
  mine.resize(static_cast<std::size_t>(sizes[static_cast<std::size_t>(g.rank())]));
  return mine;
}

}  // namespace detail
}  // namespace ddp
