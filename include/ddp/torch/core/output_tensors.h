// The tensors of a wrapped module's forward result, which DistributedDataParallel and
// FullyShardedDataParallel hook (for backward): a Tensor, a std::vector of them, or a std::tuple
// or std::pair of those (nested); numbers carry none. Any other type: with kStrict (FSDP, which
// must see where backward starts) a compile error; otherwise no tensors (DDP: its
// find_unused_parameters then reports every parameter as unused).
#pragma once

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace ddp::detail {

template <bool kStrict>
struct OutputTensors {
  static void collect(const torch::Tensor& t, std::vector<torch::Tensor>& out) { out.push_back(t); }
  static void collect(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
    out.insert(out.end(), ts.begin(), ts.end());
  }
  template <typename... Ts>
  static void collect(const std::tuple<Ts...>& tuple, std::vector<torch::Tensor>& out) {
    std::apply([&](const auto&... items) { (collect(items, out), ...); }, tuple);
  }
  template <typename A, typename B>
  static void collect(const std::pair<A, B>& pair, std::vector<torch::Tensor>& out) {
    collect(pair.first, out);
    collect(pair.second, out);
  }
  template <typename T>
  static void collect(const T&, std::vector<torch::Tensor>&) {
    static_assert(!kStrict || std::is_arithmetic_v<T>,
                  "FullyShardedDataParallel::forward_as: the forward must return a torch::Tensor, "
                  "or a std::vector, std::tuple or std::pair of them, so that the wrapper sees "
                  "where backward starts");
  }
};

}  // namespace ddp::detail
