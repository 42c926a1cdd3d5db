// What the exception being handled is, for a failure that travels back to a caller (internal;
// agent.h): its type, demangled ("std::out_of_range"), and its text. Call only inside a catch.
#pragma once

#include <string>
#include <utility>

namespace ddp::rpc::transport {

// {type, what()}; {"unknown" or the type, "(not a std::exception)"} for other thrown values.
std::pair<std::string, std::string> describe_current_exception();

}  // namespace ddp::rpc::transport
