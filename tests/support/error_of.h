// error_of(f): the message of what f() threw (std::exception::what()), or "(nothing thrown)":
// for asserting on an error's words, EXPECT_THAT(error_of([&] { ... }), HasSubstr("...")).
#pragma once

#include <exception>
#include <string>

namespace ddp::test {

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

}  // namespace ddp::test
