// MetricsLog: train-fashion-mnist --metrics FILE.jsonl, one JSON object per line, flushed per
// line so a crashed or running job's file is readable up to its last line.
//
//   {"kind": "step", "epoch": 1, "step": 100, "loss": 0.61, "samples_per_s": 5321.0,
//    "step_time_s": 0.024, "bytes_per_step": 1234, "world_size": 2, "time_s": 3.1}
//   {"kind": "epoch", "epoch": 1, "step": 469, "loss": 0.52, "accuracy": 0.87, ...}
//
// loss: the mean over the rank's batches since the previous line (step) or of the epoch; accuracy:
// the test accuracy, on epoch lines; samples_per_s: over all ranks; step_time_s: the mean time of
// one step since the previous line; bytes_per_step: the payload bytes DDP handed to collectives in
// the last backward (BackwardTimeline::bytes_sent). A number that is not finite is written as null.
// The program's rank 0 writes it; other ranks make no MetricsLog.
//
// The file is opened (truncated) at construction, which throws ddp::ConfigError naming the path
// and the reason when it cannot be; a later write that fails (disk full) throws ddp::Error.
// Not thread-safe: one training thread writes.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>

namespace fmnist {

struct MetricsRecord {
  std::string kind;  // "step" or "epoch"
  int epoch = 0;
  std::int64_t step = 0;  // steps done so far in the run
  double loss = 0.0;
  std::optional<double> accuracy;
  double samples_per_s = 0.0;
  double step_time_s = 0.0;
  std::int64_t bytes_per_step = 0;
  int world_size = 1;
  double time_s = 0.0;  // since the start of training
};

class MetricsLog {
 public:
  explicit MetricsLog(const std::string& path);
  void write(const MetricsRecord& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// One record as a JSON line (no newline).
std::string to_json_line(const MetricsRecord& record);

}  // namespace fmnist
