#include "rpc/current_exception.h"

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <typeinfo>

namespace ddp::rpc::transport {

std::pair<std::string, std::string> describe_current_exception() {
  std::string type = "unknown";
  if (const std::type_info* info = abi::__cxa_current_exception_type()) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(info->name(), nullptr, nullptr, &status);
    type = status == 0 && demangled != nullptr ? demangled : info->name();
    std::free(demangled);
  }
  std::string what = "(not a std::exception)";
  try {
    throw;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  return {type, what};
}

}  // namespace ddp::rpc::transport
