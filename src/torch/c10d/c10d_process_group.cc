// wrap_c10d (ddp/torch/c10d/c10d_process_group.h): a c10d group behind ddp's front.
#include "ddp/torch/c10d/c10d_process_group.h"

#include <algorithm>

#include <fmt/format.h>

#include "ddp/comm/external_backend.h"
#include "ddp/error.h"
#include "torch/c10d/c10d_backend.h"
#include "torch/c10d/libtorch_compat_c10d.h"

namespace ddp {
namespace {

std::shared_ptr<ProcessGroup> wrap_collectives(
    c10::intrusive_ptr<libtorch_compat::C10dCollectives> collectives, C10dWrapOptions options) {
  const int rank = collectives->getRank();
  const int size = collectives->getSize();
  ExternalGroupOptions group_options{.name = options.name, .timeout = options.timeout};
  return make_external_backend_group(
      std::make_unique<torch_c10d::C10dBackend>(std::move(collectives), std::move(options)), rank,
      size, std::move(group_options));
}

}  // namespace

std::shared_ptr<ProcessGroup> wrap_c10d_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              C10dWrapOptions options) {
  return wrap_collectives(libtorch_compat::c10d_cpu_collectives(group), std::move(options));
}

std::shared_ptr<ProcessGroup> wrap_c10d_backend(c10::intrusive_ptr<c10d::Backend> backend,
                                                C10dWrapOptions options) {
  return wrap_collectives(libtorch_compat::c10d_cpu_collectives(backend), std::move(options));
}

namespace torch_c10d {

std::shared_ptr<ProcessGroup> C10dBackend::new_group(const std::vector<int>& ranks) {
  if (!options_.new_group) {
    throw ConfigError(fmt::format(
        "new_group on group '{}' ({}): a c10d group cannot split itself without a store; set "
        "C10dWrapOptions::new_group to a function that builds the subgroup of those ranks with "
        "libtorch (e.g. a ProcessGroupGloo over a c10d::PrefixStore of the job's store) and "
        "returns it wrapped with ddp::wrap_c10d",
        options_.name, name_));
  }
  if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) return nullptr;
  auto group = options_.new_group(ranks);
  if (group == nullptr || group->size() != static_cast<int>(ranks.size())) {
    throw ConfigError(fmt::format(
        "new_group on group '{}' ({}): C10dWrapOptions::new_group returned {} for {} ranks",
        options_.name, name_, group ? fmt::format("a group of size {}", group->size()) : "null",
        ranks.size()));
  }
  return group;
}

}  // namespace torch_c10d
}  // namespace ddp
