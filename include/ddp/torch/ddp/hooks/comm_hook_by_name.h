// Comm hooks chosen by name, for programs whose users pick the hook on the command line
// (ddp-train-bench, train-fashion-mnist: `--comm-hook NAME --powersgd-rank R`). The one place
// that maps the names to the hooks of comm_hooks.h, powersgd_hook.h and quantized_hook.h.
//
//   auto choice = ddp::comm_hook_from_name("powersgd", {.powersgd_rank = 4});
//   if (choice.hook) ddp_model->register_comm_hook(*choice.hook, "powersgd");  // name:
//   logging_data
//
//   none              no hook: DDP's own reduction (allreduce, average; DdpOptions::reduce_dtype)
//   fp16, bf16        fp16_compress_hook(), bf16_compress_hook()
//   powersgd          powersgd_hook() with PowerSGDOptions{.matrix_approximation_rank =
//                     powersgd_rank, .start_powersgd_iter = powersgd_start_iter}
//   batched-powersgd  batched_powersgd_hook() with the same options
//   int8              int8_quantize_hook() (error feedback on)
//   noop              noop_hook(): no communication (the step's bound; replicas drift apart)
//
// Each call makes a fresh hook state: register the result with one DDP model only. Thread-safe
// (no shared state). Throws ConfigError for a name not in comm_hook_names() (the message lists
// them) and for PowerSGD options that PowerSGDState refuses (e.g. powersgd_rank < 1).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddp/torch/ddp/hooks/comm_hooks.h"
#include "ddp/torch/ddp/hooks/powersgd_hook.h"
#include "ddp/torch/ddp/hooks/quantized_hook.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

struct CommHookByNameOptions {
  int powersgd_rank = 1;                 // PowerSGD's matrix_approximation_rank (PyTorch's default)
  std::int64_t powersgd_start_iter = 2;  // plain allreduce for the iterations before (>= 2)
};

struct NamedCommHook {
  std::optional<CommHook> hook;  // empty for "none": keep DDP's own reduction
  // The hook's state, for checkpoints and statistics; null unless the hook has one.
  std::shared_ptr<PowerSGDState> powersgd_state;
  std::shared_ptr<Int8QuantizeState> int8_state;
};

// The accepted names, in the order of the table above ("none" first).
const std::vector<std::string>& comm_hook_names();

NamedCommHook comm_hook_from_name(const std::string& name,
                                  const CommHookByNameOptions& options = {});

}  // namespace ddp
#pragma GCC visibility pop
