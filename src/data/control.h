// Control maps for ControlNet (model/controlnet.h), computed from images on the fly: the
// non-trainable work a ControlNet's training step does before its model runs.
//   edges   Sobel gradient magnitude of the images' mean over channels, |g| / 4 clamped to [0, 1]
//           and mapped to [-1, 1] ([B, 1, H, W]); 4 is the magnitude of a step of 1 (half the [-1, 1] range)
//   lowres  the images averaged over 4x4 blocks (edge blocks of a size not divisible by 4 are
//           partial) and enlarged back by nearest neighbour ([B, C, H, W]): a 7x7 thumbnail of a 28x28 image
// Both are exact functions of the images: no randomness, the same on every machine up to float32
// rounding of a 3x3 or 4x4 sum.
#pragma once
#include <string>

#include <torch/types.h>

namespace ddm {

// images float [B, C, H, W] in [-1, 1] -> the control map of `type` (edges | lowres), float in [-1, 1].
// Throws ddm::Error naming model.control for another type.
torch::Tensor control_map(const std::string& type, const torch::Tensor& images);

// How far samples follow their control maps: the mean squared difference between the control maps of
// the samples [N, C, H, W] and the maps they were given [N, Cc, H, W], per element. 0 = exact.
double control_error(const std::string& type, const torch::Tensor& samples, const torch::Tensor& maps);

}  // namespace ddm
