#include "torch/api/rank_agreement.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "ddp/error.h"
#include "ddp/torch/api/distributed.h"
#include "ddp/torch/api/distributed_objects.h"
#include "torch/core/fingerprint.h"
#include "torch/core/host_values.h"

namespace ddp::detail {

namespace {

constexpr const char* kErrorPrefix = "error: ";

// The fingerprint as the int64 the collectives exchange.
std::int64_t fingerprint(const std::string& text) {
  return static_cast<std::int64_t>(detail::fingerprint(std::string_view(text)));
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    out.push_back(line);
  return out;
}

// Names the first line at which some rank's text differs from rank 0's.
std::string first_difference(const std::vector<std::string>& texts) {
  const auto reference = lines_of(texts[0]);
  for (std::size_t r = 1; r < texts.size(); ++r) {
    const auto mine = lines_of(texts[r]);
    for (std::size_t i = 0; i < std::max(reference.size(), mine.size()); ++i) {
      const std::string a = i < reference.size() ? reference[i] : "(nothing)";
      const std::string b = i < mine.size() ? mine[i] : "(nothing)";
      if (a != b) return fmt::format("rank 0 has {} but rank {} has {}", a, r, b);
    }
  }
  return "the ranks' descriptions hash differently";
}

}  // namespace

RankAgreement compare_across_ranks(ProcessGroup& group, const std::string& description,
                                   const std::string& local_error) {
  const std::string mine = local_error.empty() ? description : kErrorPrefix + local_error;
  const std::int64_t hash = fingerprint(mine);
  std::vector<std::int64_t> hashes(static_cast<std::size_t>(group.size()));
  HostValues(group)->allgather(&hash, hashes.data(), 1, DType::kInt64)->wait();
  RankAgreement agreement;
  const bool same =
      std::all_of(hashes.begin(), hashes.end(), [&](std::int64_t h) { return h == hashes[0]; });
  if (same && local_error.empty()) return agreement;
  std::vector<std::string> texts;
  all_gather_object(texts, mine, group);
  for (std::size_t r = 0; r < texts.size(); ++r) {
    if (texts[r].rfind(kErrorPrefix, 0) == 0) {
      agreement.failed_rank = static_cast<int>(r);
      agreement.failure = texts[r].substr(std::string(kErrorPrefix).size());
      return agreement;
    }
  }
  agreement.difference = first_difference(texts);
  return agreement;
}

std::string shape_text(const torch::Tensor& t) {
  return fmt::format("[{}] {}", fmt::join(t.sizes(), ", "), c10::toString(t.scalar_type()));
}

void require_agreement(ProcessGroup& group, const std::string& description,
                       const std::string& local_error, const std::string& refused_what,
                       const std::string& call, const std::string& what_differs) {
  const auto agreement = compare_across_ranks(group, description, local_error);
  if (agreement.failed_rank >= 0) {
    throw ConfigError(agreement.failed_rank == group.rank()
                          ? agreement.failure
                          : fmt::format("rank {} refused {}: {}", agreement.failed_rank,
                                        refused_what, agreement.failure));
  }
  if (!agreement.difference.empty()) {
    throw ConfigError(
        fmt::format("{}: the ranks pass different {}: {}; every rank must pass the "
                    "same {}",
                    call, what_differs, agreement.difference, what_differs));
  }
}

void agree_or_throw(ProcessGroup& group, const std::string& description,
                    const std::string& local_error, const AgreementWording& wording) {
  const auto agreement = compare_across_ranks(group, description, local_error);
  if (agreement.failed_rank >= 0) {
    throw ConfigError(fmt::format("{} could not be built on {} {}: {}", wording.wrapper,
                                  wording.member, agreement.failed_rank, agreement.failure));
  }
  if (!agreement.difference.empty()) {
    throw ConfigError(fmt::format("{}: {}: {}. {}", wording.wrapper, wording.differ,
                                  agreement.difference, wording.requirement));
  }
}

void raise_if_any_rank_failed(ProcessGroup& group, const std::string& local_error,
                              const std::string& what) {
  const auto agreement = compare_across_ranks(group, std::string(), local_error);
  if (agreement.failed_rank < 0) return;
  throw Error(
      fmt::format("{} failed on rank {}: {}", what, agreement.failed_rank, agreement.failure));
}

}  // namespace ddp::detail
