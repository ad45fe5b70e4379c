// Stable Diffusion's UNet as a ddm network (model.arch = sd-unet): diffusers' UNet2DConditionModel
// behind ddm's Net interface (model/net.h), so that ddm's objectives, samplers, checkpoints, data
// parallelism and guidance drive it as they drive ddm's own networks. ddm's time t in [0, 1] becomes
// diffusers' timestep t * T - 1 (T = diffusion.timesteps), which on the discrete path
// (diffusion/path.h) is the timestep k at its training time (k + 1) / T. The UNet attends to every
// token state of the text encoder, the padding included, as Stable Diffusion's pipelines do (its
// attention mask is not used). Its parameters keep diffusers' names under "unet.".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

#include "model/net.h"
#include "sd/unet_2d_condition.h"

namespace ddm::sd {

class SdUNetNetImpl : public NetImpl {
 public:
  SdUNetNetImpl(UNet2DConditionModel unet, int64_t timesteps);
  // x [B, C, H, W], t [B] in [0, 1], c.context [B, T, cross_attention_dim] -> [B, C, H, W]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // The UNet's units (UNet2DConditionModelImpl::units): pipeline stages and `ddm plan` split it.
  std::vector<NetUnit> units() override;
  UNet2DConditionModel& unet() { return unet_; }
  // diffusers' timestep for ddm's t [B]: t * T - 1, computed in double, float32 [B].
  torch::Tensor timestep(const torch::Tensor& t) const;

 private:
  UNet2DConditionModel unet_;
  int64_t timesteps_;
};

// The UNet folder that `path` names: the folder itself, or a pipeline directory's unet/ (model_index.json).
std::string unet_folder(const std::string& path);

}  // namespace ddm::sd
