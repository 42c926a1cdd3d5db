#include "ddp/torch/ddp_logging_data.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/json_file.h"

namespace ddp {
namespace {

std::string json_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += comm::json_string(items[i]);
  }
  return out + "]";
}

std::string json_list(const std::vector<std::int64_t>& items) {
  return fmt::format("[{}]", fmt::join(items, ", "));
}

const char* json_bool(bool value) {
  return value ? "true" : "false";
}

}  // namespace

std::string DdpLoggingData::to_json() const {
  std::string out = "{";
  const auto field = [&](std::string_view name, const std::string& value) {
    if (out.size() > 1) out += ", ";
    out += fmt::format("\"{}\": {}", name, value);
  };
  field("world_size", std::to_string(world_size));
  field("rank", std::to_string(rank));
  field("backend_name", comm::json_string(backend_name));
  field("bucket_cap_bytes", std::to_string(bucket_cap_bytes));
  field("first_bucket_cap_bytes", std::to_string(first_bucket_cap_bytes));
  field("broadcast_buffers", json_bool(broadcast_buffers));
  field("find_unused_parameters", json_bool(find_unused_parameters));
  field("gradient_as_bucket_view", json_bool(gradient_as_bucket_view));
  field("static_graph", json_bool(static_graph));
  field("comm_hook", comm::json_string(comm_hook));
  field("num_parameter_tensors", std::to_string(num_parameter_tensors));
  field("total_parameter_size_bytes", std::to_string(total_parameter_size_bytes));
  field("dtypes", json_list(dtypes));
  field("bucket_sizes", json_list(bucket_sizes));
  field("bucket_parameter_counts", json_list(bucket_parameter_counts));
  field("has_rebuilt_buckets", json_bool(has_rebuilt_buckets));
  field("unused_parameter_names", json_list(unused_parameter_names));
  field("unused_parameter_size", std::to_string(unused_parameter_size));
  field("iteration", std::to_string(iteration));
  field("forward_passes", std::to_string(forward_passes));
  field("avg_forward_compute_time", std::to_string(avg_forward_compute_time));
  field("avg_backward_compute_time", std::to_string(avg_backward_compute_time));
  field("avg_backward_comm_time", std::to_string(avg_backward_comm_time));
  field("avg_backward_compute_comm_overlap_time",
        std::to_string(avg_backward_compute_comm_overlap_time));
  field("last_bytes_sent", std::to_string(last_bytes_sent));
  return out + "}";
}

}  // namespace ddp
