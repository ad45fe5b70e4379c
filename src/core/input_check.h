// DDM_INPUT_CHECK: DDM_CHECK (core/error.h) for what a command was asked to do (its flags, the files,
// runs and directories they name, a config that does not fit the job): it throws ddm::InputError, so
// the process exits kExitBadInput (2) and supervisors (`ddm launch`, `ddm islands run`) do not
// restart what would fail again the same way. (A header of its own so that core/error.h, which every
// file includes, stays as it is.)
#pragma once
#include <sstream>

#include "core/error.h"

#define DDM_INPUT_CHECK(cond, msg)                   \
  do {                                               \
    if (!(cond)) {                                   \
      std::ostringstream ddm_check_os_;              \
      ddm_check_os_ << msg;                          \
      throw ::ddm::InputError(ddm_check_os_.str());  \
    }                                                \
  } while (0)

#define DDM_INPUT_FAIL(msg) DDM_INPUT_CHECK(false, msg)
