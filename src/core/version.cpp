// ddm's version string.
#include "core/version.h"
namespace ddm {
const char* version() { return "0.1.0"; }
}  // namespace ddm
