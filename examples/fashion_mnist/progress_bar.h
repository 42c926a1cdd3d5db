// ProgressBar: one self-rewriting line with a bar, throughput and ETA, for a terminal.
//
//   epoch 2 [##########..........]  50%  30000/60000  loss 0.4312  5321 samples/s  ETA 0:05
//
// train-fashion-mnist uses it on rank 0 when stdout is a terminal (isatty); otherwise it prints
// its plain progress lines, unchanged, so logs and parsers keep working. Redraws at most ten
// times a second. Not thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace fmnist {

class ProgressBar {
 public:
  explicit ProgressBar(std::FILE* out = stdout) : out_(out) {}
  // Starts a new bar of `total` samples (redrawn from 0).
  void start(int epoch, std::int64_t total);
  // `done` samples of the total so far; `loss` the latest mean loss.
  void update(std::int64_t done, double loss);
  // Ends the line (so the next print starts on a fresh one).
  void finish();

  // The bar's text for the given state (for tests and redraws).
  static std::string render(int epoch, std::int64_t done, std::int64_t total, double loss,
                            double samples_per_s, double eta_s, int width = 20);

 private:
  std::FILE* out_;
  int epoch_ = 0;
  std::int64_t total_ = 0;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point started_{};
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace fmnist
