// A ControlNet on Stable Diffusion's UNet as a ddm network (model.arch = sd-unet with
// model.controlnet): diffusers' ControlNetModel (controlnet_model.h), trainable, steering a locked
// UNet2DConditionModel, behind ddm's Net interface so that ddm's objectives, samplers, checkpoints,
// data parallelism and guidance drive it as they drive ddm's own ControlNet (model/controlnet.h).
//   forward(x, t, c): the ControlNet reads x, diffusers' timestep t * T - 1, the text states and the
//   control image, then the locked UNet adds its residuals to its skips and middle.
// The control image is c.control, a ddm control map (data/control.h) in [-1, 1] at the images' size:
// it is handed to the ControlNet in [0, 1], as diffusers' ControlNet pipelines give their control
// images, and a 1-channel map (edges) is repeated over the ControlNet's conditioning channels (3, as
// diffusers' canny ControlNets read grey edge images). Only the ControlNet is a registered submodule:
// the UNet's parameters are in no optimizer, EMA, gradient sync or checkpoint; train/network.h loads
// them from model.unet, pinned by model.controlnet_sha256. The ControlNet's parameters keep
// diffusers' names under "controlnet.".
#pragma once
#include <cstdint>

#include <torch/types.h>

#include "model/net.h"
#include "sd/controlnet_model.h"
#include "sd/unet_2d_condition.h"

namespace ddm::sd {

class SdControlNetNetImpl : public NetImpl {
 public:
  SdControlNetNetImpl(UNet2DConditionModel unet, ControlNetModel controlnet, int64_t timesteps);
  // x [B, C, H, W], t [B] in [0, 1], c.context [B, T, cross_attention_dim], c.control [B, Cc, H f, W f]
  // in [-1, 1] -> [B, C, H, W]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // The locked UNet's encoder half (no trainable parameter: the training step's prepare phase runs it,
  // DiffusionPipe's frozen work) into c.frozen: its time embedding, middle output and skips, which
  // forward then decodes instead of recomputing (bit for bit).
  Cond precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // control.in .. control.mid: the ControlNet's encoder (its first unit reads the control image);
  // zero: the zero convolutions, adding the residuals to the locked encoder's features from c.frozen
  // (precompute must have run); locked.up{i}_{j} .. locked.out: the locked UNet's decoder (no
  // trainable parameter of its own: its parameters stay listed, frozen).
  std::vector<NetUnit> units() override;
  // The locked UNet moves with the network (it is not a registered submodule).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  UNet2DConditionModel& unet() { return unet_; }  // locked; loaded by train/network.h (set_unet_loaded after)
  void set_unet_loaded() { unet_loaded_ = true; }
  ControlNetModel& controlnet() { return controlnet_; }
  // ControlNetModel's control image for a ddm control map [B, Cc, S, S] in [-1, 1]: in [0, 1], its
  // channels repeated when Cc = 1.
  torch::Tensor control_image(const torch::Tensor& map) const;
  // diffusers' timestep for ddm's t [B]: t * T - 1, computed in double, float32 [B].
  torch::Tensor timestep(const torch::Tensor& t) const;

 private:
  UNet2DConditionModel unet_;
  ControlNetModel controlnet_;
  int64_t timesteps_;
  bool unet_loaded_ = false;
};

}  // namespace ddm::sd
