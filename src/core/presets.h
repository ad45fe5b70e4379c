// Named model presets sized for CPU training on 28x28 images.
#pragma once
#include <string>
#include <vector>

#include "core/config.h"

namespace ddm {

// Names of all presets (e.g. unet-tiny, unet-small, dit-tiny, dit-small).
std::vector<std::string> preset_names();
// Overwrites the architecture fields of cfg with the preset's values (keeps in_channels,
// image_size, num_classes, preset). Throws ddm::Error listing the valid names if unknown.
void apply_preset(const std::string& name, ModelConfig& cfg);

}  // namespace ddm
