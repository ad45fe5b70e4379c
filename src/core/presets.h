// Named model presets: sized for CPU training on 28x28 images (unet-tiny, dit-small, ...), and for
// your own RGB images at 32, 64, 128 and 256 px (unet-32 ... unet-256; latent-unet-128 and -256 on an
// f8 autoencoder's latents).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config.h"

namespace ddm {

// The input a preset is sized for: what `ddm presets` measures it at.
struct PresetShape {
  int64_t channels = 1, side = 28;
  std::string what;  // "64 px RGB"
};
PresetShape preset_shape(const std::string& name);

// Names of all presets (e.g. unet-tiny, unet-small, dit-tiny, dit-small).
std::vector<std::string> preset_names();
// Overwrites the architecture fields of cfg with the preset's values (keeps in_channels,
// image_size, num_classes, preset). Throws ddm::Error listing the valid names if unknown.
void apply_preset(const std::string& name, ModelConfig& cfg);

}  // namespace ddm
