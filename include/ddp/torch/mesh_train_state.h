// Moved to "ddp/torch/parallel/mesh/mesh_train_state.h".
// The torch layer's public headers live in folders by component (docs/architecture.md). This
// path keeps working, without a warning, for at least one more release; include the new path
// (or the umbrella "ddp/torch.h") instead.
#pragma once

#include "ddp/torch/parallel/mesh/mesh_train_state.h"
