// ddm's version string.
#pragma once
namespace ddm {
const char* version();
}
