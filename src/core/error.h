// ddm::Error, the one exception type for user-facing failures, and the DDM_CHECK macro.
// Messages name the file / key / value at fault and say what to do; the CLI prints them and exits 1.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ddm {

struct Error : std::runtime_error {
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace ddm

// DDM_CHECK(cond, "batch_size must be > 0, got " << b): throws ddm::Error with the streamed message.
#define DDM_CHECK(cond, msg)                      \
  do {                                            \
    if (!(cond)) {                                \
      std::ostringstream ddm_check_os_;           \
      ddm_check_os_ << msg;                       \
      throw ::ddm::Error(ddm_check_os_.str());    \
    }                                             \
  } while (0)

#define DDM_FAIL(msg) DDM_CHECK(false, msg)
