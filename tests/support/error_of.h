// Test support: the message of the c10::Error a call throws, for asserting what an error names.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace meshddp::test {

// What fn() throws as a c10::Error, without the backtrace; "(no error)" if it returns.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace meshddp::test
