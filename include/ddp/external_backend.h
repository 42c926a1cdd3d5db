// Moved to "ddp/comm/external_backend.h".
// The engine's public headers live in folders by layer (docs/architecture.md): ddp/store,
// ddp/launch, ddp/comm and ddp/runtime. This path keeps working, without a warning, for at least
// one more release; include the new path instead.
#pragma once

#include "ddp/comm/external_backend.h"
