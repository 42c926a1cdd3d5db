// Writing PyTorch's distributed checkpoint format (torch.distributed.checkpoint, "DCP") from C++:
// a folder that PyTorch 2.x's dcp.load reads at any world size, and ddp's DcpReader
// (distributed_checkpoint.h) reads at any layout.
//
//   ddp::DcpStateDict state;
//   state.add_shard("layers.0.weight", my_rows, {rank * rows, 0}, {world * rows, cols});  // FSDP,
//   TP state.add_tensor("embedding.weight", embedding);   // replicated: every rank holds it whole
//   state.add_value("step", step);                     // a non-tensor entry
//   ddp::save_dcp(state, "ckpt/step_1000");            // collective over the default group
//
// Or a nested state dict as PyTorch's dcp.save takes it (dicts, lists, tensors, values):
// DcpStateDict::flatten(model_and_optimizer) names its entries as PyTorch's flatten_state_dict
// does ("optim.state.0.exp_avg") and records each one's path, so the nested dict comes back.
//
// What a save does, on every rank of the group, as dcp.save's plan / write / finish:
//   1. plan: the ranks exchange what they hold and compute the same global plan: every entry
//      has one dtype and shape on every rank, the shards of a tensor tile it exactly (equal
//      shards on several ranks, HYBRID_SHARD's replicas, are written once), a replicated tensor
//      or a value is written by one of the ranks that hold it (the least loaded so far). A plan
//      that is wrong is refused on every rank before anything is written. The copies of an
//      entry several ranks hold must be equal (check_replicas): compared in step 3, before the
//      commit.
//   2. write: each rank writes its items into one data file of its own, `__<rank>_<n>.distcp`,
//      and syncs it to disk. n is new in the folder: a save into a folder that holds a
//      checkpoint never overwrites a file that checkpoint's metadata names.
//   3. finish: rank 0 writes `.metadata` last, through `.metadata.tmp` synced and renamed over
//      it; once every rank knows it is committed, each removes its own data files of earlier
//      saves (in parallel). A failure or crash before that rename leaves the folder's previous
//      checkpoint loadable.
// Any rank's failure (an unwritable folder, a full disk, a value that cannot be saved) is thrown
// on every rank, naming the ranks and what happened: no rank is left waiting, none returns
// success for a checkpoint that was not committed. Waits are the group's (its timeout).
//
// Versions: what PyTorch's FileSystemWriter writes with its defaults (format version "1.0.0";
// each item a torch.save archive); read back by PyTorch 2.15's dcp.load (tested). Tensors are
// saved from the CPU (others are copied there first).
//
// Errors: ConfigError (the plan is inconsistent across ranks or within one; a folder or file
// that cannot be written), ddp::Error (a value of a kind torch.save cannot hold); the group's
// CommError and TimeoutError pass through.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddp/torch/api/distributed.h"
#include "ddp/torch/checkpoint/distributed_checkpoint.h"

#pragma GCC visibility push(default)
namespace ddp {

// One rank's part of a checkpoint: its entries by fully qualified name, in the order added.
class DcpStateDict {
 public:
  struct Entry {
    enum class Kind { kTensor, kShard, kValue };
    Kind kind = Kind::kValue;
    std::string name;
    std::vector<DcpPathKey> path;            // in the nested state dict; {name} where added by name
    at::Tensor tensor;                       // kTensor: whole; kShard: this rank's part
    std::vector<std::int64_t> offsets;       // kShard: where the part starts
    std::vector<std::int64_t> global_shape;  // kShard: the whole tensor's shape
    c10::IValue value;                       // kValue
  };

  // A tensor this rank holds whole (replicated, as DDP's parameters): every rank that adds the
  // name must hold the same dtype and shape; one of them writes it.
  void add_tensor(const std::string& name, const at::Tensor& tensor);
  // This rank's part [offsets, offsets + local.sizes()) of the tensor `name`, of shape
  // `global_shape` (an FSDP or tensor-parallel shard). The ranks' parts must tile the tensor;
  // equal parts on several ranks are one chunk, written once. A rank may add several parts of
  // one tensor (at different offsets, of one dtype and global shape): each is a chunk.
  void add_shard(const std::string& name, const at::Tensor& local,
                 std::vector<std::int64_t> offsets, std::vector<std::int64_t> global_shape);
  // A non-tensor entry: a value torch.save holds (None, bool, int, float, str, and tuples,
  // lists and dicts of them); read back by torch.load(weights_only=True) and read_value.
  void add_value(const std::string& name, const c10::IValue& value);

  // The entries of a nested state dict (a dict of dicts, lists, tensors and values), named and
  // pathed as PyTorch's flatten_state_dict does: dict keys (strings, or integers written in
  // decimal) joined by '.', a list descended into only where it holds a tensor or a dict, a
  // tensor a replicated entry, anything else one value. ConfigError: not a dict at the top, a key
  // of another kind, two entries of the same name ("a.b" as a key and as a path).
  static DcpStateDict flatten(const c10::IValue& nested);

  // An entry as entries() lists it (a copy of another state dict's), checked as add_* check it.
  void add_entry(Entry entry);

  const std::vector<Entry>& entries() const { return entries_; }

 private:
  void add(Entry entry);
  std::vector<Entry> entries_;
  std::map<std::string, std::vector<std::size_t>> names_;  // name -> its entries' indices
};

struct DcpSaveOptions {
  // The ranks that save together: null means the default group where init_process_group made
  // one, and this process alone where none was made (as dcp.save's no_dist).
  std::shared_ptr<ProcessGroup> group;
  // This process alone, even in a job (a converter run by one rank).
  bool no_dist = false;
  // Whether an entry several ranks hold (a replicated tensor, a value, an equal shard) must hold
  // the same bytes on each: they compare CRC-32s of their copies (during the write, so an
  // asynchronous save's stall does not grow) and a difference is refused before the metadata is
  // committed, naming the entry and which ranks hold what. Off: one rank's copy is written,
  // whichever the plan picks (what PyTorch's dcp.save does). The check reads every replica once
  // (about 6 GB/s per rank here).
  bool check_replicas = true;
};

// Saves `state` (this rank's part) into `folder` (created if missing), collectively. Returns the
// checkpoint's description as DcpReader(folder).info() would read it.
DcpCheckpointInfo save_dcp(const DcpStateDict& state, const std::filesystem::path& folder,
                           const DcpSaveOptions& options = {});

// A save whose data this rank writes in the background (save_dcp_async).
class DcpAsyncSave {
 public:
  struct State;  // internal
  explicit DcpAsyncSave(std::shared_ptr<State> state);
  DcpAsyncSave(DcpAsyncSave&&) noexcept;
  DcpAsyncSave& operator=(DcpAsyncSave&&) noexcept;
  ~DcpAsyncSave();

  // Waits for this rank's writer, then finishes the save with the other ranks: a collective
  // every rank of the group makes (or makes through its next save, which calls it). Returns the
  // checkpoint's description, or throws the save's failure (any rank's), as save_dcp does; later
  // calls return or throw the same.
  DcpCheckpointInfo wait();
  const std::filesystem::path& folder() const;

 private:
  std::shared_ptr<State> state_;
};

// save_dcp with the writing off the training loop: returns once the ranks have agreed on the
// plan (refused, as save_dcp refuses it, before anything is copied) and this rank's tensors are
// copied to host memory (pinned where they live on a GPU) and its values deep-copied; a
// background thread writes the data file while training goes on (and changes the originals),
// and the metadata is committed at wait(). A save (sync or async) started while an earlier
// async save is unfinished first finishes that one, on every rank in the same order: its
// failure is thrown there and the new save does not start, so a failed background write is
// reported at wait() or at the next save, never lost. A handle dropped without wait() leaves
// the save pending until the next save (or the process's exit, which writes no metadata and
// says so on stderr). One pending save per process. The host copy's buffers are kept after the
// save for the next one (host memory the size of this rank's tensors; the next save's copy then
// runs into memory already touched, a tenth of the stall of fresh pages at 768 MiB a rank).
DcpAsyncSave save_dcp_async(const DcpStateDict& state, const std::filesystem::path& folder,
                            const DcpSaveOptions& options = {});

// What PyTorch's torch.distributed.checkpoint.format_utils.torch_save_to_dcp writes for `file`:
// the torch.save file's dict, flattened (DcpStateDict::flatten), saved by this process alone.
// The file is read with ddp's restricted reader (torch.load(weights_only=True)'s kinds).
DcpCheckpointInfo torch_save_to_dcp(const std::filesystem::path& file,
                                    const std::filesystem::path& folder);

}  // namespace ddp
#pragma GCC visibility pop
