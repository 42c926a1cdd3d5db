// Exceptions thrown by ddp.
//
// Every error names what went wrong and, where there is one, what to do about it. The hierarchy
// lets callers separate mistakes in configuration (fix the launch) from failures at run time
// (a peer died, a deadline passed).
//
//   Error                 base of everything ddp throws
//   ├── ConfigError       bad options or environment variables; nothing was started
//   ├── TimeoutError      a deadline passed (connect, store wait, collective)
//   ├── StoreError        the rendezvous store failed or refused a request
//   ├── ProtocolError     a peer sent bytes that break the wire protocol
//   └── CommError         a collective failed (see process_group.h); carries its context
#pragma once

#include <stdexcept>
#include <string>

// Exported by ddp's shared libraries, which hide the rest (src/CMakeLists.txt).
#pragma GCC visibility push(default)
namespace ddp {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ConfigError : public Error {
 public:
  using Error::Error;
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

class StoreError : public Error {
 public:
  using Error::Error;
};

class ProtocolError : public Error {
 public:
  using Error::Error;
};

}  // namespace ddp
#pragma GCC visibility pop
