#include "ddp/comm/comm_error.h"

namespace ddp {

const char* to_string(CommErrorKind kind) {
  switch (kind) {
    case CommErrorKind::kTimeout:
      return "timeout";
    case CommErrorKind::kMismatch:
      return "mismatch";
    case CommErrorKind::kPeerGone:
      return "peer gone";
    case CommErrorKind::kAborted:
      return "aborted";
    case CommErrorKind::kSetup:
      return "setup";
    case CommErrorKind::kTransport:
      return "transport";
    case CommErrorKind::kInternal:
      return "internal";
  }
  return "unknown";
}

}  // namespace ddp
