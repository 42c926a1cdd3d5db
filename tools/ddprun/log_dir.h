// LogDir: the files of `ddprun --log-dir DIR`, one folder per restart attempt and rank, as
// torchrun lays them out (with the global rank, so that the nodes of a job can share DIR):
//
//   DIR/<run_id>/attempt_<k>/<rank>/stdout.log     what the worker wrote, byte for byte
//   DIR/<run_id>/attempt_<k>/<rank>/stderr.log
//   DIR/<run_id>/attempt_<k>/                      the workers' DDP_DUMP_DIR (flight recorder)
//
// <run_id> is --rdzv-id (default "none", torchrun's). Files of an earlier run with the same run id
// are replaced when an attempt starts (ddprun says so). Plain values and functions; any thread.
//
// Errors: ConfigError naming the path and what to do, when a folder or file cannot be made.
#pragma once

#include <string>

namespace ddp::ddprun {

class LogDir {
 public:
  LogDir() = default;
  // `root` is DIR as given; it is made absolute (workers may change their directory).
  LogDir(const std::string& root, const std::string& run_id);

  bool enabled() const { return !run_dir_.empty(); }
  const std::string& run_dir() const { return run_dir_; }
  std::string attempt_dir(int attempt) const;
  std::string rank_dir(int attempt, int rank) const;

  // Creates DIR/<run_id> and proves that a file can be written there (then removes it), so that
  // an unusable --log-dir is an error before any worker starts.
  void check_writable() const;
  // Creates rank_dir(attempt, rank) and opens `name` in it for writing (truncated). Returns the
  // descriptor (close-on-exec).
  int open_file(int attempt, int rank, const std::string& name) const;

 private:
  std::string run_dir_;
};

}  // namespace ddp::ddprun
