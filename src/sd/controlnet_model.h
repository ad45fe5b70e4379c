// diffusers' ControlNetModel (ControlNet v1.0, Zhang, Rao and Agrawala 2023, as diffusers builds it),
// from the config.json diffusers writes and under diffusers' own parameter names (a diffusers
// controlnet/ folder loads into it key for key):
//   controlnet_cond_embedding  the control image [B, conditioning_channels, H f, W f] -> conv_in 3x3,
//                              SiLU, then per width pair blocks (3x3, SiLU, 3x3 stride 2, SiLU), then
//                              conv_out 3x3 (zero-initialised) -> [B, w0, H, W]; f = 2^(widths - 1)
//   conv_in(sample) + that     -> down_blocks and mid_block, as the UNet's encoder (unet_blocks.h)
//   controlnet_down_blocks[i]  1x1 conv (zero-initialised) on skip i -> the residual of the UNet's skip i
//   controlnet_mid_block       1x1 conv (zero-initialised) on the middle -> the middle's residual
// The locked UNet2DConditionModel adds them (unet_2d_condition.h, UNetResiduals). At initialisation
// every path from the control image to a residual passes a zero-initialised layer, so the UNet's
// output is its own. from_unet: the copy starts as the UNet's encoder (conv_in, time_embedding,
// down_blocks, mid_block), as diffusers' ControlNetModel.from_unet does.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "model/net.h"
#include "sd/unet_2d_condition.h"
#include "sd/unet_blocks.h"

namespace ddm::sd {

struct ControlNetModelConfig {
  UNet2DConditionConfig unet;  // the encoder's keys, as the UNet's (its out_channels, sample_size and up blocks unused)
  int64_t conditioning_channels = 3;
  std::vector<int64_t> conditioning_embedding_out_channels = {16, 32, 96, 256};
  bool bgr = false;  // controlnet_conditioning_channel_order = "bgr": the control image's channels are flipped first

  // How much larger the control image is than the sample: 2^(conditioning widths - 1) (8 for SD's latents).
  int64_t hint_factor() const { return int64_t{1} << (conditioning_embedding_out_channels.size() - 1); }
};

// Reads a ControlNetModel config.json object (`file` names it in errors); keys it does not build are
// refused by name, as for the UNet.
ControlNetModelConfig parse_controlnet_model_config(const nlohmann::json& config, const std::string& file);
nlohmann::json controlnet_model_config_json(const ControlNetModelConfig& c);
// The config diffusers' ControlNetModel.from_unet makes for `unet` (its encoder keys, rgb order).
ControlNetModelConfig controlnet_config_from_unet(const UNet2DConditionConfig& unet, int64_t conditioning_channels,
                                                  std::vector<int64_t> embedding_widths = {16, 32, 96, 256});

// "" when a ControlNet of config `c` fits `unet` (its encoder keys equal the UNet's), else the first
// key that differs, with both values.
std::string controlnet_mismatch(const ControlNetModelConfig& c, const UNet2DConditionConfig& unet);

// ControlNetConditioningEmbedding: conv_in, blocks, conv_out.
class ControlNetConditioningEmbeddingImpl : public torch::nn::Module {
 public:
  ControlNetConditioningEmbeddingImpl(int64_t out, int64_t in, const std::vector<int64_t>& widths);
  torch::Tensor forward(const torch::Tensor& cond);  // [B, in, H f, W f] -> [B, out, H, W]

 private:
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList blocks;
};
TORCH_MODULE(ControlNetConditioningEmbedding);

class ControlNetModelImpl : public torch::nn::Module {
 public:
  explicit ControlNetModelImpl(ControlNetModelConfig c);
  const ControlNetModelConfig& config() const { return c_; }
  // sample [B, in_channels, H, W], timestep [B] (diffusers' scale), context [B, T, cross_attention_dim],
  // cond [B, conditioning_channels, H f, W f] (f = hint_factor()) -> one residual per skip of the UNet
  // ([B, w, h, w] each) and the middle's, each times conditioning_scale.
  UNetResiduals forward(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context,
                        const torch::Tensor& cond, double conditioning_scale = 1.0);
  // forward's encoder as units (model/net.h), for pipeline stages: from NetCarry{h = sample} they leave
  // the features the zero convolutions read (h: the middle's output; skips). A unit reads diffusers'
  // timestep from `timestep` (ddm's t mapped) and the control image from `control` (of the Cond).
  std::vector<NetUnit> units(std::function<torch::Tensor(const torch::Tensor&)> timestep,
                             std::function<torch::Tensor(const Cond&)> control);
  // The zero convolutions: features (skips, the middle's output) -> residuals, each times scale.
  UNetResiduals residuals(const std::vector<torch::Tensor>& skips, const torch::Tensor& mid, double scale = 1.0);
  std::vector<torch::Tensor> zero_parameters() const;  // controlnet_down_blocks' and controlnet_mid_block's
  // diffusers' from_unet: conv_in, time_embedding, down_blocks and mid_block become copies of the
  // UNet's (whose encoder keys must equal this config's); the rest keeps its initialisation.
  void copy_encoder_from(const UNet2DConditionModelImpl& unet);

 private:
  void check_inputs(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context,
                    const torch::Tensor& cond) const;
  // The pieces of the encoder, each a unit's work on the carry.
  void unit_in(NetCarry& k, const torch::Tensor& timestep, const torch::Tensor& cond);

  ControlNetModelConfig c_;
  torch::nn::Conv2d conv_in{nullptr}, controlnet_mid_block{nullptr};
  TimeEmbedding time_embedding{nullptr};
  ControlNetConditioningEmbedding controlnet_cond_embedding{nullptr};
  torch::nn::ModuleList down_blocks, controlnet_down_blocks;
  Level mid_block{nullptr};
};
TORCH_MODULE(ControlNetModel);

// Analytic forward FLOPs of one sample (H x W latents, tokens text states): the encoder copy, the
// conditioning embedding at H f x W f and the zero convolutions (counted as unet_2d_condition_flops).
double controlnet_model_flops(const ControlNetModelConfig& c, int64_t H, int64_t W, int64_t tokens);

// DIR/config.json's architecture (errors name the file).
ControlNetModelConfig load_controlnet_model_config(const std::string& dir);
// A diffusers ControlNetModel directory (config.json and diffusion_pytorch_model.safetensors or its
// sharded index): the model with its weights, on the CPU in float32. Errors name the file and tensor.
ControlNetModel load_controlnet_model(const std::string& dir);
// Writes `model` as diffusers writes it: DIR/config.json and DIR/diffusion_pytorch_model.safetensors.
void save_controlnet_model(ControlNetModel& model, const std::string& dir);

}  // namespace ddm::sd
