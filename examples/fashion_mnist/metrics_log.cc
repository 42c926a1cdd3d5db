#include "metrics_log.h"

#include <cerrno>
#include <cmath>
#include <system_error>

#include <fmt/format.h>

#include "ddp/error.h"

namespace fmnist {
namespace {

std::string number(double value) {
  return std::isfinite(value) ? fmt::format("{}", value) : std::string("null");
}

}  // namespace

std::string to_json_line(const MetricsRecord& r) {
  std::string line = fmt::format(R"({{"kind": "{}", "epoch": {}, "step": {}, "loss": {})", r.kind,
                                 r.epoch, r.step, number(r.loss));
  if (r.accuracy) line += fmt::format(R"(, "accuracy": {})", number(*r.accuracy));
  line += fmt::format(
      R"(, "samples_per_s": {}, "step_time_s": {}, "bytes_per_step": {}, "world_size": {}, )"
      R"("time_s": {}}})",
      number(r.samples_per_s), number(r.step_time_s), r.bytes_per_step, r.world_size,
      number(r.time_s));
  return line;
}

MetricsLog::MetricsLog(const std::string& path) : path_(path) {
  out_.open(path, std::ios::out | std::ios::trunc);
  if (!out_) {
    throw ddp::ConfigError(fmt::format("--metrics {}: cannot open the file for writing ({})", path,
                                       std::generic_category().message(errno)));
  }
}

void MetricsLog::write(const MetricsRecord& record) {
  out_ << to_json_line(record) << '\n';
  out_.flush();
  if (!out_) {
    throw ddp::Error(fmt::format("--metrics {}: writing a line failed (disk full?)", path_));
  }
}

}  // namespace fmnist
