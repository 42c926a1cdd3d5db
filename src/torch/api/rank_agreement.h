// Construction-time agreement across ranks, shared by the wrappers whose construction is
// collective (ZeroRedundancyOptimizer, FullyShardedDataParallel): each rank describes what it
// was given as text (one line per item), and one small allgather of a hash tells whether every
// rank gave the same; the texts travel only when they differ, so that every rank can name the
// first difference. A rank that could not build its part sends its error instead, so that no rank
// is left waiting in a later collective.
//
// Collective over `group`; throws what the group throws (CommError, TimeoutError).
#pragma once

#include <string>
#include <string_view>

#include <torch/torch.h>

#include "ddp/comm/process_group.h"

namespace ddp::detail {

// "[2, 3] Float": a tensor's shape and dtype, as the descriptions name them.
std::string shape_text(const torch::Tensor& t);

struct RankAgreement {
  // The lowest rank that reported an error, and its error text; -1 when none did.
  int failed_rank = -1;
  std::string failure;
  // When the descriptions differ (and no rank failed): "rank 0 has <line> but rank r has <line>".
  std::string difference;
};

// `local_error` non-empty: this rank failed with that text (its description is then ignored).
RankAgreement compare_across_ranks(ProcessGroup& group, const std::string& description,
                                   const std::string& local_error);

// compare_across_ranks, then a ConfigError on every rank unless all agree: the refusing rank's
// own text on that rank and "rank R refused <refused_what>: <text>" on the others, or
// `call`: the ranks pass different <what_differs>: <difference>; every rank must pass the same
// <what_differs>".
void require_agreement(ProcessGroup& group, const std::string& description,
                       const std::string& local_error, const std::string& refused_what,
                       const std::string& call, const std::string& what_differs);

// How a wrapper names itself and what it requires when its ranks disagree at construction.
struct AgreementWording {
  std::string_view wrapper;          // "ZeroRedundancyOptimizer"
  std::string_view member = "rank";  // what a failed_rank numbers: "rank", or "stage"
  std::string_view differ = "the ranks differ";
  std::string_view requirement;  // "Every rank must pass the same parameters ..."
};

// compare_across_ranks, then a ConfigError on every rank unless all agree: "<wrapper> could not
// be built on <member> R: <text>" (the lowest failed rank's text), or "<wrapper>: <differ>:
// <difference>. <requirement>". The one agreement check of the collective constructors (ZeRO,
// FSDP, the pipeline).
void agree_or_throw(ProcessGroup& group, const std::string& description,
                    const std::string& local_error, const AgreementWording& wording);

// A step every rank must have done (e.g. writing its file): an Error on every rank, "<what>
// failed on rank R: <text>" (the lowest failed rank's text), when `local_error` is not empty on
// some rank; returns on every rank otherwise.
void raise_if_any_rank_failed(ProcessGroup& group, const std::string& local_error,
                              const std::string& what);

}  // namespace ddp::detail
