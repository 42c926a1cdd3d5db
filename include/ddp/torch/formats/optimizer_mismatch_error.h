// The error every loader of optimizer state throws when a file holds the state of another
// optimizer than the one it is loaded into (checkpoint.h, optimizer_state_dict.h, TrainState).
#pragma once

#include <string>
#include <utility>

#include "ddp/error.h"

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)

namespace ddp {

// The file holds the state of another kind of optimizer (or of one whose options give its state
// another shape, e.g. SGD with and without momentum) than the one it is loaded into.
class OptimizerMismatchError : public Error {
 public:
  OptimizerMismatchError(const std::string& message, std::string stored, std::string current)
      : Error(message), stored_(std::move(stored)), current_(std::move(current)) {}
  // The optimizers as described in the message, e.g. "Adam" and "SGD with momentum".
  const std::string& stored() const { return stored_; }
  const std::string& current() const { return current_; }

 private:
  std::string stored_;
  std::string current_;
};

}  // namespace ddp

#pragma GCC visibility pop
