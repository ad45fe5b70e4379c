// diffusers' UNet2DConditionModel as Stable Diffusion 1.x and 2.x configure it, built from the
// config.json diffusers writes and holding its parameters under diffusers' own names (a diffusers
// unet/ folder loads into it key for key):
//   time_proj (sinusoidal, cos first) -> time_embedding (linear_1, SiLU, linear_2): temb [B, 4 * w0]
//   conv_in -> down_blocks[i]: layers_per_block x (ResnetBlock2D with the time embedding, then for
//   CrossAttnDownBlock2D a Transformer2DModel), then a stride-2 conv except on the last level; every
//   output kept for the skips -> mid_block (resnet, transformer, resnet) -> up_blocks over the widths
//   reversed: layers_per_block + 1 x (concatenate a skip, resnet, transformer for
//   CrossAttnUpBlock2D), then nearest 2x upsampling and a conv except on the last -> GroupNorm,
//   SiLU, conv_out.
// The blocks (and the encoder half a ControlNet copies) are in unet_blocks.h.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "model/net.h"
#include "sd/unet_blocks.h"

namespace ddm::sd {

// Reads a config.json object (`file` names it in errors). A key that changes the network in a way
// ddm does not build (class or time embeddings, other block types, a time-conditioning projection,
// more than one transformer layer per block, ...) is refused by name unless it holds diffusers'
// default; a key diffusers' UNet2DConditionModel does not have is refused.
UNet2DConditionConfig parse_unet_2d_condition_config(const nlohmann::json& config, const std::string& file);
nlohmann::json unet_2d_condition_config_json(const UNet2DConditionConfig& c);

// What a ControlNet adds (diffusers' down_block_additional_residuals and mid_block_additional_residual):
// one tensor per skip, shaped as it, and one shaped as the middle block's output.
struct UNetResiduals {
  std::vector<torch::Tensor> down;
  torch::Tensor mid;
};

class UNet2DConditionModelImpl : public torch::nn::Module {
 public:
  explicit UNet2DConditionModelImpl(UNet2DConditionConfig c);
  const UNet2DConditionConfig& config() const { return c_; }
  // sample [B, in_channels, H, W] (H, W multiples of 2^(levels - 1)), timestep [B] on diffusers'
  // scale (0..999, any float), context [B, T, cross_attention_dim] -> [B, out_channels, H, W]. With
  // residuals, each is added to its skip after the down blocks and to the middle block's output.
  torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context,
                        const UNetResiduals* residuals = nullptr);
  // forward's two halves, bit for bit: encode runs conv_in, the down blocks and the middle (the carry's
  // h is the middle's output [B, w[-1], H / f, W / f], emb the time embedding [B, 4 w0], skips every
  // down block output); decode adds the residuals and runs the up blocks and the output.
  NetCarry encode(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context);
  torch::Tensor decode(NetCarry k, const torch::Tensor& context, const UNetResiduals* residuals = nullptr);
  // forward as units (model/net.h), for pipeline stages and their profiler: from NetCarry{h = sample}
  // they leave forward's output in h, bit for bit. A unit reads ddm's time t, which `timestep` maps to
  // diffusers' scale, and the context from Cond::context. The carry's emb is the time embedding.
  std::vector<NetUnit> units(std::function<torch::Tensor(const torch::Tensor&)> timestep);
  // The units of decode alone (up blocks, upsamplers, output), from encode's carry: a ControlNet's
  // locked decoder.
  std::vector<NetUnit> decoder_units();

 private:
  void check_inputs(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context) const;
  // The pieces of forward, each a unit: k.h is the running activation, k.emb the time embedding, k.skips the skips.
  void unit_in(NetCarry& k, const torch::Tensor& timestep);
  void unit_down(NetCarry& k, size_t level, size_t j, const torch::Tensor& context);
  void unit_downsample(NetCarry& k, size_t level);
  void unit_mid(NetCarry& k, const torch::Tensor& context);
  void add_residuals(NetCarry& k, const UNetResiduals& r) const;  // after unit_mid
  void unit_up(NetCarry& k, size_t level, size_t j, const torch::Tensor& context);
  void unit_upsample(NetCarry& k, size_t level);
  void unit_out(NetCarry& k);

  UNet2DConditionConfig c_;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  TimeEmbedding time_embedding{nullptr};
  Level mid_block{nullptr};
  torch::nn::ModuleList down_blocks, up_blocks;
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(UNet2DConditionModel);

// Analytic forward FLOPs of one sample of H x W latents attending to `tokens` text states (2 x the
// multiply-accumulates of convolutions, linear layers and attention matmuls; norms and elementwise
// ops ignored, as model/net.h's forward_flops_per_image counts ddm's own networks).
double unet_2d_condition_flops(const UNet2DConditionConfig& c, int64_t H, int64_t W, int64_t tokens);

// DIR/config.json's architecture (errors name the file).
UNet2DConditionConfig load_unet_2d_condition_config(const std::string& dir);
// A diffusers UNet2DConditionModel directory (config.json and diffusion_pytorch_model.safetensors or
// its sharded index): the model with its weights, on the CPU in float32. Errors name the file and
// the key or tensor.
UNet2DConditionModel load_unet_2d_condition(const std::string& dir);
// Writes `model` as diffusers writes it: DIR/config.json and DIR/diffusion_pytorch_model.safetensors.
void save_unet_2d_condition(UNet2DConditionModel& model, const std::string& dir);

}  // namespace ddm::sd
