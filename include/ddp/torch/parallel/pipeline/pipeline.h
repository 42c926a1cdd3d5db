// Pipeline parallelism (PyTorch's torch.distributed.pipelining): a torch::nn::Sequential split
// into stages, one stage per rank of a "pp" group; each step splits the batch into micro-batches,
// runs them through the stages by a schedule (GPipe or 1F1B), sends activations forward and
// their gradients backward by point to point, and computes the loss on the last stage
// (docs/pipeline-parallel.md).
//
//   torch::manual_seed(42);                               // the same seed on every rank, so that
//   auto net = make_model();                              // every rank builds the same Sequential
//   ddp::Pipeline pipe(net, pp_group, [](const torch::Tensor& out, const torch::Tensor& y) {
//                        return torch::mse_loss(out, y); },
//                      {.schedule = ddp::PipelineSchedule::k1F1B, .micro_batches = 8});
//   torch::optim::SGD opt(pipe.parameters(), 0.1);        // this stage's parameters only
//   for (...) { opt.zero_grad(); double loss = pipe.step(x, y); opt.step(); }
//
// Stages. Given the whole model, rank s of the group keeps children [first, first + count) of
// it (layer_range()): `balance` gives each stage's child count (torchgpipe's name), else the
// children are split evenly (the first stages take one more when it does not divide). This is
// the simple way to exactness: every rank builds the whole model from the same seed and keeps
// its part, so the stages hold exactly the parameters one process would (the memory of the whole
// model is needed once, at construction; the other stages' layers are dropped with `net`).
// Or pass PipelineStageModule{this rank's layers}: the caller builds only its stage.
//
// A step. step(input, target) splits `input` (used on stage 0) and `target` (on the last stage)
// into micro_batches equal chunks along dim 0; the batch must divide (else ConfigError). The
// loss function runs on the last stage per micro-batch and must reduce to a mean over the
// micro-batch (as torch::mse_loss's default): the step backpropagates loss_i / m for each
// micro-batch i, so the gradients equal those of the whole batch's mean loss. Gradients are
// added to the stage's parameters' .grad (zero them, and run the optimizer over parameters(),
// yourself). step returns the whole batch's loss (the mean of the micro-batch losses) on every
// stage: every step ends with one small allreduce over the group that carries it from the last
// stage, and that tells every stage whether some stage failed. When stage 0's input requires
// grad (a leaf, or the output of layers before the pipeline), it gets its gradient as in one
// process: one backward into it after the schedule, with or without recomputation.
//
// Schedules (a stage's order of actions: pipeline_actions()). kGPipe: every forward, then every
// backward; a stage stores up to m micro-batches' activations. k1F1B: stage s runs
// min(p - s - 1, m) forwards, then alternates one forward and one backward, then the remaining
// backwards; it stores at most p - s activations (needs m >= p, else ConfigError). Both have
// the same bubble, (p - 1) / (m + p - 1) of a step idle per stage when every micro-batch's
// forward and backward take the same time on every stage. kInterleaved1F1B (Megatron's
// interleaved schedule, PyTorch's ScheduleInterleaved1F1B): the model is cut into p x v chunks
// (v = options.virtual_stages) and rank s holds chunks s, s + p, ..., s + (v - 1) p, so a
// micro-batch passes every rank v times (rank p - 1 hands chunk c's output to rank 0's chunk
// c + 1); each rank warms up with 2 (p - s - 1) + (v - 1) p chunk forwards and then alternates,
// which divides the bubble by v: (p - 1) / (v m + p - 1). It needs the whole-model constructor,
// p >= 2, and m a multiple of p; a rank stores up to 2 (p - s - 1) + (v - 1) p + 1 chunk
// activations. kZeroBubble (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", 2023;
// PyTorch's zero-bubble schedules split backward the same way): each backward is split into B,
// the input's gradient (what the previous stage waits for), and W, the parameters' gradients,
// run later where the stage would otherwise wait. The order comes from simulating every stage
// with equal F, B and W times and a stage holding at most p - s micro-batches, as 1F1B: a stage
// runs a ready B first, else a ready F, else a pending W. It needs m >= p.
//
// Messages. Each activation and gradient is a contiguous CPU tensor sent to the neighbouring
// stage after a 12-word header (its micro-batch, dtype and shape; at most 7 dimensions), so
// stages need not be told the activation shapes and a micro-batch out of order is caught. Tags
// kPipelineActivationTag and kPipelineGradientTag on the group are reserved for it. Every
// receive has a deadline (options.timeout, else the group's).
//
// Recomputation (options.recompute): a stage keeps only each micro-batch's input between its
// forward and its backward, and runs the forward again (with the CPU generator's state of the
// first run, so dropout draws the same mask) before the backward.
//
// Errors. Construction is collective over the group: the options and the split are compared
// across ranks by one small allgather of a hash; bad options (more stages than layers, a balance
// that does not add up, m < p for 1F1B, ...) or ranks that disagree throw ConfigError on every
// rank naming the problem (or the first difference). When a stage fails during a step (a bad
// batch, its layers throw, a receive times out), it tells its neighbours, who stop and tell
// theirs, and every stage throws from step(): ConfigError where the failure was one, else the
// failing stage rethrows its exception and the others throw CommError (kind kAborted) naming
// it. After a failed step the pipeline refuses further steps (ConfigError): build a new one.
//
// Threads: use one Pipeline from one thread. Lifetime: keeps the group alive.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

enum class PipelineSchedule {
  kGPipe,            // all forwards, then all backwards (PyTorch's ScheduleGPipe)
  k1F1B,             // one forward, one backward in the steady state (PyTorch's Schedule1F1B)
  kInterleaved1F1B,  // 1F1B over v chunks per rank (PyTorch's ScheduleInterleaved1F1B)
  kZeroBubble,       // 1F1B with backward split into input and weight passes (ZB-H1)
};
// "gpipe", "1f1b", "interleaved", "zero-bubble".
const char* to_string(PipelineSchedule schedule);
// "gpipe", "1f1b", "interleaved" or "zero-bubble" (any case); ConfigError naming the choices
// otherwise.
PipelineSchedule pipeline_schedule_from_name(std::string_view name);

inline constexpr int kPipelineActivationTag = 32750;
inline constexpr int kPipelineGradientTag = 32751;

struct PipelineOptions {
  PipelineSchedule schedule = PipelineSchedule::k1F1B;
  int micro_batches = 1;  // m: chunks of each batch (>= the stage count for 1F1B)
  // v: model chunks per rank, for kInterleaved1F1B (1 otherwise). The model's children split
  // into p x v chunks (balance, when given, has p x v entries, in chunk order).
  int virtual_stages = 1;
  // Children per stage when the whole model is given (one entry per stage, each >= 1, adding up
  // to the model's children); empty: an even split.
  std::vector<int> balance;
  bool recompute = false;  // keep only stage inputs; run the forward again in backward
  // Deadline of each receive; 0 = the group's timeout.
  std::chrono::milliseconds timeout{0};
  // Data parallelism over replicas of this pipeline (a mesh's "dp" group: the ranks that run the
  // same stage on other data). After each step's schedule, the stage's parameter gradients are
  // averaged over it in one coalesced allreduce (once per step, not per micro-batch), and step()
  // returns the loss averaged over it: with each replica given its rows of the batch, the same
  // gradients and loss as one pipeline on the whole batch. Construction checks, over this group,
  // that every replica holds the same stage (ConfigError naming the difference). Null: none.
  std::shared_ptr<ProcessGroup> dp_group;
  // Expert parallelism (mixture_of_experts.h): the stage's MoeLayers split over an ep group of
  // more than one rank hold other experts along ep, though their tokens split over dp_group (the
  // dp x ep ranks): their expert parameters' gradients average over this group instead (the ranks
  // holding the same experts: the mesh's "dp"), or not at all when it is null (no replicas). The
  // other parameters, and the loss, average over dp_group.
  std::shared_ptr<ProcessGroup> expert_dp_group;
};

// A stage's own layers, for the constructor that does not split a whole model.
struct PipelineStageModule {
  torch::nn::Sequential module;
};

// loss(output micro-batch, target micro-batch): a scalar, the mean over the micro-batch.
using PipelineLossFn =
    std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// One action of a stage's schedule.
struct PipelineAction {
  // kBackward: the whole backward, or (zero-bubble) its input half; kWeight: its weight half.
  enum class Kind { kForward, kBackward, kWeight };
  Kind kind = Kind::kForward;
  int micro_batch = 0;
  int chunk = 0;  // which of the rank's model chunks (kInterleaved1F1B; 0 otherwise)
  bool operator==(const PipelineAction&) const = default;
};
// The actions of `stage` (0..stages-1) in `schedule` with `micro_batches` (and `virtual_stages`
// chunks per rank for kInterleaved1F1B), in order.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stage, int stages,
                                             int micro_batches, int virtual_stages = 1);

// Where one stage's time went in the last step. Times are from the step's start on this rank;
// "busy" is the compute of forwards and backwards (the loss included), the rest of the step
// (waiting for a neighbour, the bubble) is idle.
struct PipelineStepStats {
  struct Timing {
    PipelineAction action;
    std::chrono::nanoseconds start{0};
    std::chrono::nanoseconds end{0};
  };
  std::vector<Timing> timings;  // one per action, in the order they ran
  // From the step's start to the end of its final allreduce, i.e. until the last stage is done
  // (a failed step: to the end of this stage's schedule).
  std::chrono::nanoseconds wall{0};
  std::chrono::nanoseconds busy{0};  // the sum of the actions' durations
  double idle_fraction = 0.0;        // 1 - busy / wall
  int peak_stored_activations = 0;   // micro-batches whose activations were held at once
};

class Pipeline {
 public:
  // Collective over `group` (the pp group: stage s is rank s). Every rank passes the same model.
  Pipeline(torch::nn::Sequential whole_model, std::shared_ptr<ProcessGroup> group,
           PipelineLossFn loss, PipelineOptions options = {});
  // Collective over `group`; each rank passes its own stage's layers (options.balance unused).
  Pipeline(PipelineStageModule stage, std::shared_ptr<ProcessGroup> group, PipelineLossFn loss,
           PipelineOptions options = {});
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // Runs one batch through the pipeline (collective over the group) and returns its loss on
  // every stage. `input` is read on stage 0 and `target` on the last stage; elsewhere they may
  // be undefined tensors.
  double step(const torch::Tensor& input, const torch::Tensor& target);

  int stage() const;
  int num_stages() const;
  bool is_first_stage() const { return stage() == 0; }
  bool is_last_stage() const { return stage() == num_stages() - 1; }
  // This stage's first child in the whole model and its child count (whole-model constructor;
  // {0, module size} otherwise); interleaved: its first chunk's.
  std::pair<int, int> layer_range() const;
  // This stage's layers (interleaved: every chunk's, in the model's order); their parameter
  // names are the whole model's ("2.weight").
  torch::nn::Sequential& stage_module();
  std::vector<torch::Tensor> parameters() const;
  const PipelineOptions& options() const;
  const PipelineStepStats& last_step_stats() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ddp
#pragma GCC visibility pop
