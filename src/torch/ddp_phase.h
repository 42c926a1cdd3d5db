// Names the DistributedDataParallel phase in errors that come from a collective.
//
// A CommError from the engine names the collective ("broadcast(int64 x 1, root 0) #46"); a user
// needs to know which part of DDP issued it ("gradient bucket 3 of 7 (parameters fc1.weight …
// fc2.bias)"). in_ddp_phase runs `body` and rethrows CommError and TimeoutError with the phase in
// front of the message, keeping the type and the CommError's fields.
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>

#include "ddp/comm_error.h"
#include "ddp/error.h"

namespace ddp::detail {

// `phase` is called only when there is an error (building the text may cost).
template <typename Body, typename Phase>
decltype(auto) in_ddp_phase(Phase&& phase, Body&& body) {
  try {
    return std::forward<Body>(body)();
  } catch (const CommError& e) {
    throw CommError(e.kind(), fmt::format("DistributedDataParallel, {}: {}", phase(), e.what()),
                    e.group(), e.op(), e.sequence(), e.peer());
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("DistributedDataParallel, {}: {}", phase(), e.what()));
  }
}

}  // namespace ddp::detail
