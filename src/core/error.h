// ddm::Error, the one exception type for user-facing failures, and the DDM_CHECK macro.
// Messages name the file / key / value at fault and say what to do; the CLI prints them and exits 1.
//
// InputError is an Error raised while ddm reads what it was asked to do, before anything runs: the
// config (file + --set: parse and validation) and a training job's preparation from it (data,
// partition, model, teacher). Running the same command again fails the same way, so the CLI exits
// with kExitBadInput instead of 1 (also for a command line it cannot parse), and supervisors that
// restart failed processes (`ddm launch`, `ddm islands run`) do not restart it. Catch it as Error.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace ddm {

struct Error : std::runtime_error {
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

struct InputError : Error {
  explicit InputError(const std::string& what) : Error(what) {}
};

// The exit status of a ddm command whose input (command line, config) was refused: retrying will not help.
constexpr int kExitBadInput = 2;

// Returns f(); an Error it throws comes out as an InputError with the same message.
template <class F>
decltype(auto) as_input_error(F&& f) {
  try {
    return f();
  } catch (const InputError&) {
    throw;
  } catch (const Error& e) {
    throw InputError(e.what());
  }
}

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
