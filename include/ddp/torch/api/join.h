// Join: training with uneven inputs, where ranks run out of data at different steps.
//
//   ddp::Join join({*model}, {.divide_by_initial_world_size = true});
//   for (auto& batch : my_batches) {          // ranks may have different numbers of batches
//     optimizer.zero_grad(); model->forward(batch.x)...backward(); optimizer.step();
//   }
//   join.finish();                            // or let the destructor do it
//
// As PyTorch's torch.distributed.algorithms.Join. Inside the scope, every training step of a
// joinable first announces that this rank is still training (one small allreduce). A rank that
// leaves its loop and reaches finish() "joins": until every rank has joined it shadows each step
// that the others still make, i.e. makes the same collectives with neutral contributions (for
// DistributedDataParallel: gradient buckets of zeros, buffer broadcasts, the unused map, the
// bucket rebuild), so no rank waits for a partner that has no data. When every rank has joined,
// each joinable's post hook runs (DistributedDataParallel copies the parameters and buffers of
// the last rank to join to every rank, so the model ends identical everywhere) and all leave.
//
// Options: `enable` = false turns Join off (no collectives; uneven inputs then fail with the
// group's timeout). `throw_on_early_termination`: instead of shadowing, the first rank to run out
// makes every rank throw ddp::Error at its next step. `divide_by_initial_world_size` (DDP): true
// averages gradients over all ranks (joined ranks count as zeros), false over the ranks still
// training in that step.
//
// Construction is collective (every rank passes joinables of the same kinds in the same order;
// otherwise every rank gets an Error naming them). finish() is collective. The destructor calls
// finish() unless it ran already or the scope is left by an exception (then nothing waits).
// Threads: use a Join from the thread that trains. Joinables must outlive the Join and share one
// process group. Errors: ddp::Error and the group's CommError/TimeoutError, on every rank.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddp/comm/process_group.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct JoinOptions {
  bool enable = true;
  bool throw_on_early_termination = false;
  // For DistributedDataParallel (PyTorch passes it as a keyword argument to Join).
  bool divide_by_initial_world_size = true;
};

struct JoinState;

// Something that takes part in collectives each training step and can shadow them once its rank
// has no more data (DistributedDataParallel; a sharded optimizer).
class Joinable {
 public:
  virtual ~Joinable() = default;

  // One step's collectives, with neutral contributions, on a rank that has joined.
  virtual void join_main_hook() = 0;
  // After every rank joined. `is_last_joiner`: this rank was among the last to join.
  virtual void join_post_hook(bool is_last_joiner) = 0;
  virtual ProcessGroup& join_process_group() = 0;
  // What this joinable is, for the check that every rank joins the same kinds, e.g.
  // "DistributedDataParallel(10 parameters)".
  virtual std::string join_description() const = 0;
  // Ordering: a joinable whose main hook uses the averaged gradients of the shadowed step (a
  // sharded optimizer) needs one that leaves them (DistributedDataParallel) before it in the
  // Join; otherwise the Join is a ConfigError, since it would step with stale gradients.
  virtual bool join_leaves_gradients() const { return false; }
  virtual bool join_needs_gradients() const { return false; }

  // The Join this joinable is in, or null. Joinables call Join::notify_join_context at the start
  // of each training step when it is set.
  const std::shared_ptr<JoinState>& join_state() const { return join_state_; }

 private:
  friend class Join;
  std::shared_ptr<JoinState> join_state_;
  bool first_joinable_ = false;
};

// What a Join tells its joinables (read-only for them).
struct JoinState {
  JoinOptions options;
  int initial_world_size = 0;
  // Ranks still training in the current step, as counted by the last notify (this one
  // included); during shadowing, the ranks still training.
  int nonjoined = 0;
};

class Join {
 public:
  Join(std::vector<std::reference_wrapper<Joinable>> joinables, JoinOptions options = {});
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Joins: shadows the other ranks' steps until every rank has joined, then runs the post hooks.
  void finish();

  // Called by a joinable at the start of each training step inside a Join. The first joinable
  // counts the ranks still training (an allreduce; with throw_on_early_termination a second one
  // that throws on every rank once some rank has run out). Returns the number of ranks still
  // training, or 0 when the joinable is in no enabled Join.
  static int notify_join_context(Joinable& joinable);

 private:
  void detach() noexcept;

  std::vector<std::reference_wrapper<Joinable>> joinables_;
  std::shared_ptr<JoinState> state_;
  ProcessGroup* group_ = nullptr;
  bool finished_ = false;
  int uncaught_at_start_ = 0;
};

}  // namespace ddp
#pragma GCC visibility pop
