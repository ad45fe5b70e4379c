// The asset directory, compiled in (CMakeLists.txt sets DDM_ASSET_DIR for this file alone).
#include "core/assets.h"

#ifndef DDM_ASSET_DIR
#define DDM_ASSET_DIR "assets"
#endif

namespace ddm {

std::string asset_path(const std::string& relative) { return std::string(DDM_ASSET_DIR) + "/" + relative; }

}  // namespace ddm
