// A process group carried through a custom autograd function's context (its saved_data holds
// IValues, which a shared_ptr is not): the autograd graph keeps the group alive until backward
// has run. For the functions whose backward communicates (all_to_all_rows, ring_attention).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

struct GroupCapsule : torch::CustomClassHolder {
  std::shared_ptr<ProcessGroup> group;
};

inline void save_group(torch::autograd::AutogradContext* ctx, const std::string& key,
                       std::shared_ptr<ProcessGroup> group) {
  auto capsule = c10::make_intrusive<GroupCapsule>();
  capsule->group = std::move(group);
  ctx->saved_data[key] = c10::IValue::make_capsule(std::move(capsule));
}

inline std::shared_ptr<ProcessGroup> saved_group(torch::autograd::AutogradContext* ctx,
                                                 const std::string& key) {
  return c10::static_intrusive_pointer_cast<GroupCapsule>(ctx->saved_data[key].toCapsule())->group;
}

}  // namespace ddp::detail
