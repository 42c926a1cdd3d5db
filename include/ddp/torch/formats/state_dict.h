// State dicts that cross between Python and C++: files Python's
// `torch.load(path, weights_only=True)` reads as a dict of names to tensors, and files Python's
// `torch.save(model.state_dict(), path)` wrote, loaded into a libtorch module.
//
//   ddp::save_state_dict(*net, "net.pt");                  // Python: m.load_state_dict(torch.load(
//                                                          //   "net.pt", weights_only=True))
//   ddp::load_state_dict(*net, "from_python.pt");          // strict: every name, shape and dtype
//   auto report = ddp::load_state_dict(*net, path, {.strict = false});   // what matched
//
// Names are Python's: the dotted paths of parameters and buffers (`0.weight`, `bn.running_mean`,
// `bn.num_batches_tracked`), in the order Python's state_dict() lists them (each module's
// parameters, then its buffers, then its children). For a DistributedDataParallel model save
// its module() (no "module." prefix); for FullyShardedDataParallel pass full_state_dict() on the
// rank that gathered it; a ZeroRedundancyOptimizer's model is not sharded (save it directly).
//
// Format: PyTorch's zip archive (data.pkl, data/<storage>, version, byteorder), the pickle
// written at protocol 2 as torch.save does. Reading accepts what PyTorch 1.13 and 2.x write
// (tested: Debian's 1.13 and 2.15); the legacy non-zip format is a StateDictFormatError.
//
// Security: reading never runs code from the file. The pickle is read by ddp's own restricted
// unpickler, which accepts only dicts (and OrderedDict), lists, tuples, strings, numbers, None,
// booleans, storages and tensors (torch._utils._rebuild_tensor_v2 and its relatives), and refuses
// any other global (a pickled model class, os.system, ...) with UnsafePickleError before it builds
// anything from it, like `weights_only=True`. Nor can a file crash the reader or exhaust it:
// every zip record's CRC-32 is verified (a flipped byte is a StateDictFormatError naming the
// record), declared sizes are checked against what the tensors need before anything is inflated,
// and the pickle is read in linear time and memory with a nesting limit (docs/interop.md,
// "Reading a file a stranger sent").
//
// Loading validates every name, shape and dtype before it copies anything: a failed load leaves
// the module unchanged. Tensors are loaded to the CPU and copied into the module's tensors
// (whatever device they are on).
//
// Threads: each call is independent; do not write one path from two threads or processes.
// Errors (ddp::Error subclasses): ConfigError (file missing or unreadable, an I/O failure while
// writing), StateDictFormatError (not a state dict ddp can read), UnsafePickleError, and
// StateDictMismatchError (names, shapes or dtypes differ, strict loads).
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/jit/api/module.h>
#include <torch/torch.h>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

// The file is not a state dict ddp can read: not a zip archive, PyTorch's legacy format, a
// TorchScript archive, truncated or corrupted, a pickle of something else than a dict of tensors.
class StateDictFormatError : public Error {
 public:
  using Error::Error;
};

// The pickle names a global outside the allowlist (e.g. "__main__.Net", "posix.system"): loading
// it would mean running code from the file, which ddp never does.
class UnsafePickleError : public StateDictFormatError {
 public:
  UnsafePickleError(const std::string& message, std::string global_name)
      : StateDictFormatError(message), global_name_(std::move(global_name)) {}
  // "module.name" as the pickle spells it.
  const std::string& global_name() const { return global_name_; }

 private:
  std::string global_name_;
};

// What a load found beside what it expected. `mismatched` entries read e.g.
// "fc.weight: shape [3, 8] float in the file, [4, 8] float in the module".
struct StateDictLoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     // in the module, not in the file
  std::vector<std::string> unexpected;  // in the file, not in the module
  std::vector<std::string> mismatched;  // in both, another shape or dtype
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

// A strict load found missing, unexpected or mismatched names (listed in the message, like
// Python's load_state_dict(strict=True)); nothing was loaded.
class StateDictMismatchError : public Error {
 public:
  StateDictMismatchError(const std::string& message, StateDictLoadReport report)
      : Error(message), report_(std::move(report)) {}
  const StateDictLoadReport& report() const { return report_; }

 private:
  StateDictLoadReport report_;
};

struct StateDictLoadOptions {
  // true: any missing, unexpected or mismatched name throws StateDictMismatchError and nothing is
  // loaded. false: the names whose shape and dtype match are loaded, the rest reported.
  bool strict = true;
};

// Names to tensors, in order (what FullyShardedDataParallelImpl::full_state_dict returns).
using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

// The module's parameters and buffers under Python's names, in Python's order. The tensors are
// the module's own (not copies).
StateDict state_dict(const torch::nn::Module& module);
StateDict state_dict(const torch::jit::Module& module);

// Writes `tensors` as a Python state dict (an OrderedDict of names to tensors) to `path`, through
// PATH.tmp renamed over it, so a failed write leaves `path` as it was. Tensors on other devices are
// copied to the CPU; tensors that share a storage are written once, as Python does.
void save_state_dict(const StateDict& tensors, const std::filesystem::path& path);
void save_state_dict(const torch::nn::Module& module, const std::filesystem::path& path);
void save_state_dict(const torch::jit::Module& module, const std::filesystem::path& path);

// Reads a state dict (from Python or save_state_dict) as CPU tensors. The top-level value must be
// a dict of strings to tensors.
StateDict read_state_dict(const std::filesystem::path& path);

// Copies `source` into the tensors of `target` (which keep their identity, device and dtype)
// after checking every name, shape and dtype; `source_name` names the source in errors.
StateDictLoadReport load_state_dict(const StateDict& target, const StateDict& source,
                                    StateDictLoadOptions options = {},
                                    const std::string& source_name = "the state dict");
StateDictLoadReport load_state_dict(torch::nn::Module& module, const std::filesystem::path& path,
                                    StateDictLoadOptions options = {});
StateDictLoadReport load_state_dict(torch::jit::Module& module, const std::filesystem::path& path,
                                    StateDictLoadOptions options = {});

}  // namespace ddp
#pragma GCC visibility pop
