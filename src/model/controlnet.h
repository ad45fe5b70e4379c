// ControlNet (Zhang, Rao and Agrawala 2023) on a ddm U-Net: the pretrained base U-Net is locked;
// a trainable copy of its encoder half sees x_t plus a control map and adds its features, each through
// a zero-initialized 1x1 convolution, to the locked decoder's skip features and middle:
//   hint      control [B, Cc, S, S] -> conv3 16, SiLU, conv3 32, SiLU, conv3 c0 (zero-initialized)
//   control   the encoder copy (model/unet.h, encoder_only) on x_t, its in_conv output plus the hint
//   zero[i]   1x1 conv, zero-initialized: control skip i -> residual i; zero.back(): the middle
//   output    base.decode(base.encode(x_t, t, y), residuals)
// Every path from the control map to the output passes a zero-initialized layer, so at
// initialization the output equals the base model's exactly (the residuals are exact zeros).
//
// The base is not a registered submodule: its parameters are in no optimizer, EMA, gradient sync or
// checkpoint. train/controlnet.h loads it from the base run, pinned by sha256, and initializes the
// copy from the base's encoder. Its encoder half depends on no trainable parameter, so precompute
// runs it in the step's prepare phase; its decoder is frozen but on the gradient path (input-gradients
// flow through it to the residuals).
#pragma once
#include <memory>
#include <vector>

#include "core/config.h"
#include "model/net.h"
#include "model/unet.h"

namespace ddm {

class ControlNetImpl : public NetImpl {
 public:
  // cfg: the base U-Net's model config with controlnet set (control selects the map's channels).
  explicit ControlNetImpl(const ModelConfig& cfg);
  // x [B, C, S, S], t [B], c.y [B], c.control [B, Cc, S, S] (required); c.frozen from precompute or empty.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // Runs the locked encoder half (no gradients) into c.frozen.
  Cond precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // control.in (with the hint block) .. control.mid{j}: the trainable copy; zero: the zero
  // convolutions, adding the residuals to the locked encoder's features from c.frozen (precompute
  // must have run); locked.up{l} .. locked.out: the locked decoder (no trainable parameters).
  std::vector<NetUnit> units() override;
  // The locked base moves with the network (it is not a registered submodule).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;

  // The locked base, built with random weights: train/controlnet.h loads it (set_base_loaded after).
  UNetImpl& base() { return *base_; }
  void set_base_loaded() { base_loaded_ = true; }
  // The trainable encoder copy (its parameter names are the base's, so it can be initialized from it).
  UNetImpl& control() { return *control_; }
  // The residuals alone: [skips..., middle], each shaped like the base's feature it is added to.
  std::vector<torch::Tensor> residuals(const torch::Tensor& x, const torch::Tensor& t, const Cond& c);

 private:
  ModelConfig cfg_;
  std::shared_ptr<UNetImpl> base_;  // locked; not registered
  bool base_loaded_ = false;
  std::shared_ptr<UNetImpl> control_;  // trainable, registered as "control"
  torch::nn::Sequential hint_{nullptr};
  std::vector<torch::nn::Conv2d> zero_;  // [skips + 1]
};

// Channels of the control map of model.control (data/control.h): edges 1, lowres the images'.
int64_t control_channels(const ModelConfig& cfg);
// Analytic forward FLOPs per image: the base, the encoder copy, the hint block and the zero convolutions.
double controlnet_forward_flops(const ModelConfig& cfg);

}  // namespace ddm
