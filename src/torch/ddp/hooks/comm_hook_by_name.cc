#include "ddp/torch/ddp/hooks/comm_hook_by_name.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ddp/error.h"

namespace ddp {

const std::vector<std::string>& comm_hook_names() {
  static const std::vector<std::string> names{
      "none", "fp16", "bf16", "powersgd", "batched-powersgd", "int8", "noop"};
  return names;
}

NamedCommHook comm_hook_from_name(const std::string& name, const CommHookByNameOptions& options) {
  if (name == "none") return {};
  if (name == "fp16") return {.hook = fp16_compress_hook()};
  if (name == "bf16") return {.hook = bf16_compress_hook()};
  if (name == "powersgd" || name == "batched-powersgd") {
    auto state = std::make_shared<PowerSGDState>(
        PowerSGDOptions{.matrix_approximation_rank = options.powersgd_rank,
                        .start_powersgd_iter = options.powersgd_start_iter});
    return {.hook = name == "powersgd" ? powersgd_hook(state) : batched_powersgd_hook(state),
            .powersgd_state = state};
  }
  if (name == "int8") {
    auto state = std::make_shared<Int8QuantizeState>();
    return {.hook = int8_quantize_hook(state), .int8_state = state};
  }
  if (name == "noop") return {.hook = noop_hook()};
  throw ConfigError(fmt::format("comm hook '{}' is unknown; use one of {}", name,
                                fmt::join(comm_hook_names(), ", ")));
}

}  // namespace ddp
