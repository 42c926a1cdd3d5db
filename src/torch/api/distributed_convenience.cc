// What every training script writes: rank-0 printing and averaging a metric over ranks.
#include <cstdio>

#include "ddp/torch/api/distributed.h"

namespace ddp {

double all_reduce_scalar(double value, ReduceOp op, GroupRef group) {
  group.get().allreduce(&value, 1, DType::kFloat64, op)->wait();
  return value;
}

double average_across_ranks(double value, GroupRef group) {
  return all_reduce_scalar(value, ReduceOp::kAvg, group);
}

void print_main_line(const std::string& line) {
  if (!is_main_process()) return;
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);  // rank 0's lines appear at once, even when stdout is a pipe (ddprun)
}

}  // namespace ddp
