// pipeline-bubble: each stage's idle fraction in ddp::Pipeline against the schedule's theory,
// (p - 1) / (m + p - 1) for GPipe and 1F1B (issue 29), (p - 1) / (v m + p - 1) for the interleaved
// schedule of v = --virtual-stages chunks per rank (issue 54).
//
//   ddprun --standalone --nproc-per-node 2 pipeline-bubble --micro-batches 4,8 --steps 5
//
// Every stage does the same work, as the theory assumes: each holds --layers-per-stage
// Linear(width, width) + Tanh (interleaved: in v chunks of --layers-per-stage / v), the input
// requires its gradient (so stage 0's first layer computes one, as every other layer does), and the
// loss is a sum (no work to speak of). Each step's idle fraction is 1 - busy / wall from
// Pipeline::last_step_stats() (the stage's forward and backward compute against the step's wall
// time); the first --warmup steps are left out. Each stage prints one line per (schedule, m):
// `bubble schedule=<s> p=<p> m=<m> stage=<s> idle=<median over steps> theory=<t>
//  busy_ms=<median> wall_ms=<median> v=<chunks per rank>`.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>
#include <CLI/CLI.hpp>

#include "ddp/error.h"
#include "ddp/runtime/init.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/parallel/pipeline/pipeline.h"

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> micro_batches{4, 8};
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved"};
  int steps = 5, warmup = 2, layers_per_stage = 2, width = 256, rows = 1024, threads = 1;
  int virtual_stages = 2;
  CLI::App app{"pipeline-bubble: each stage's idle fraction against (p-1)/(m+p-1)"};
  app.add_option("--micro-batches", micro_batches, "m values")->delimiter(',');
  app.add_option("--schedules", schedules, "gpipe, 1f1b, interleaved")->delimiter(',');
  app.add_option("--virtual-stages", virtual_stages,
                 "chunks per rank of the interleaved schedule (divides --layers-per-stage)")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--layers-per-stage", layers_per_stage, "Linear + Tanh pairs per stage")
      ->check(CLI::PositiveNumber);
  app.add_option("--width", width, "features of each Linear")->check(CLI::PositiveNumber);
  app.add_option("--rows", rows, "rows of the batch")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "torch threads per rank")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(threads);
    auto group = ddp::init_process_group();
    const int p = group->size();
    for (const auto& schedule_name : schedules) {
      const auto schedule = ddp::pipeline_schedule_from_name(schedule_name);
      const int v = schedule == ddp::PipelineSchedule::kInterleaved1F1B ? virtual_stages : 1;
      if (layers_per_stage % v != 0) {
        throw ddp::ConfigError(fmt::format(
            "--layers-per-stage {} does not split into --virtual-stages {} equal chunks",
            layers_per_stage, v));
      }
      for (const int m : micro_batches) {
        torch::manual_seed(3);
        torch::nn::Sequential model;
        for (int k = 0; k < p * layers_per_stage; ++k) {
          model->push_back(torch::nn::Linear(width, width));
          model->push_back(torch::nn::Tanh());
        }
        ddp::Pipeline pipe(model, group,
                           [](const torch::Tensor& out, const torch::Tensor&) { return out.sum(); },
                           {.schedule = schedule, .micro_batches = m, .virtual_stages = v});
        const auto x = torch::randn({rows, width}).requires_grad_(true);
        const auto y = torch::zeros({rows, width});
        std::vector<double> idle, busy_ms, wall_ms;
        for (int step = 0; step < warmup + steps; ++step) {
          pipe.step(x, y);
          if (step < warmup) continue;
          const auto& stats = pipe.last_step_stats();
          idle.push_back(stats.idle_fraction);
          busy_ms.push_back(std::chrono::duration<double, std::milli>(stats.busy).count());
          wall_ms.push_back(std::chrono::duration<double, std::milli>(stats.wall).count());
        }
        fmt::print(
            "bubble schedule={} p={} m={} stage={} idle={:.3f} theory={:.3f} busy_ms={:.1f} "
            "wall_ms={:.1f} v={}\n",
            schedule_name, p, m, pipe.stage(), median(idle),
            static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1), median(busy_ms),
            median(wall_ms), v);
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "pipeline-bubble: {}\n", e.what());
    return 1;
  }
}
