// Moved to "ddp/torch/api/distributed_objects.h": the torch layer's public headers live in folders by component
// (docs/architecture.md). This path keeps working, without a warning, for at least one more
// release; include "ddp/torch/api/distributed_objects.h" (or the umbrella "ddp/torch.h") instead.
#pragma once

#include "ddp/torch/api/distributed_objects.h"
