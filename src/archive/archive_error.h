// The error of the archive layer: a zip archive or a pickle that cannot be read as it is. The
// layer knows bytes, not files' roles, so its messages say what is wrong with the bytes; the
// caller (the torch layer's state-dict and checkpoint readers) prefixes the file's name and turns
// it into its own error types by kind.
#pragma once

#include <string>

#include "ddp/error.h"

namespace ddp::archive {

class FormatError : public Error {
 public:
  enum class Kind {
    kDamaged,      // the bytes contradict what the format records (a CRC, a size, an offset)
    kUnsupported,  // valid, but a feature this reader leaves out (encryption, another method)
    kTooLarge,     // over one of the reader's limits (depth, size, entries)
    kUnsafe,       // a pickle that names a global outside the allowlist or builds an object
  };
  FormatError(Kind kind, const std::string& what, std::string global_name = {})
      : Error(what), kind_(kind), global_name_(std::move(global_name)) {}
  Kind kind() const { return kind_; }
  // kUnsafe: the refused global ("posix.system"), empty for an opcode that builds an object.
  const std::string& global_name() const { return global_name_; }

 private:
  Kind kind_;
  std::string global_name_;
};

}  // namespace ddp::archive
