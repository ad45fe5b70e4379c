// Where the files ddm ships live (assets/ in the checkout: the feature network, CLIP's vocabulary).
// Only assets.cpp is compiled with the checkout's path, so that one small file is all a fresh
// clone at another path compiles afresh (ccache serves the rest).
#pragma once
#include <string>

namespace ddm {

// "<the checkout's assets/>/<relative>".
std::string asset_path(const std::string& relative);

}  // namespace ddm
