// The time vocabulary of ddp: milliseconds for timeouts, and the default one.
#pragma once

#include <chrono>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

using Milliseconds = std::chrono::milliseconds;

// Default deadline of store operations and collectives (DDP_TIMEOUT overrides at init time).
inline constexpr Milliseconds kDefaultTimeout{300'000};

}  // namespace ddp
#pragma GCC visibility pop
