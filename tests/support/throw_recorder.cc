// The last exception each thread threw, for run_ranks' crash report (support/multiprocess.cc):
// a rank that crashes while an exception unwinds (a destructor that faults) would otherwise lose
// the exception's message, and with it the reason the test failed (it happened on the GPU
// machine). Every test executable links this object with LINKER:--wrap=__cxa_throw
// (tests/CMakeLists.txt): each throw compiled into the test (its own code, ddp's static
// libraries, GoogleTest) passes here first. Throws inside shared libraries (libtorch's) do not.
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <typeinfo>

namespace {

thread_local char last_thrown[512];

}  // namespace

extern "C" {

[[noreturn]] void __real___cxa_throw(void* object, std::type_info* type, void (*destroy)(void*));

// Records "type: what()" (what() when the type is a std::exception, found as a catch clause for
// std::exception would find it), then throws as usual. Compiled without UBSan's vptr check
// (tests/CMakeLists.txt): in a process out of file descriptors that check cannot read an object's
// type and reports every call on it as one on an invalid vptr (the store's out-of-descriptors
// test throws there).
[[noreturn]] void __wrap___cxa_throw(void* object, std::type_info* type, void (*destroy)(void*)) {
  if (type != nullptr) {
    void* as_exception = object;
    const char* what = "";
    if (typeid(std::exception).__do_catch(type, &as_exception, 1)) {
      what = static_cast<const std::exception*>(as_exception)->what();
    }
    int status = 0;
    char* name = abi::__cxa_demangle(type->name(), nullptr, nullptr, &status);
    std::snprintf(last_thrown, sizeof last_thrown, "%s: %s",
                  status == 0 && name != nullptr ? name : type->name(), what);
    std::free(name);
  }
  __real___cxa_throw(object, type, destroy);
}

// Read by the crash handler (no allocation); empty when this thread threw nothing.
const char* ddp_test_last_thrown_exception() {
  return last_thrown;
}

}  // extern "C"
