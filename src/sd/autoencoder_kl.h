// diffusers' AutoencoderKL (the VAE of Stable Diffusion 1.x / 2.x, sd-vae-ft-mse, SDXL and the
// 16-channel ones), built from the config.json diffusers writes and holding its parameters under
// diffusers' own names, so that a diffusers directory's diffusion_pytorch_model.safetensors loads
// into it key for key and nothing is converted. The same design as ddm's own autoencoder
// (model/autoencoder.h), in diffusers' layout:
//   encoder  conv_in -> down_blocks[i] (layers_per_block ResnetBlock2Ds to block_out_channels[i],
//            then a stride-2 conv after zero padding right and bottom, except on the last) ->
//            mid_block (resnet, single-head self-attention, resnet) -> GroupNorm, SiLU, conv_out to
//            2z -> quant_conv (1x1, where use_quant_conv)
//   decoder  post_quant_conv (1x1, where use_post_quant_conv) -> conv_in -> mid_block ->
//            up_blocks[i] over the widths reversed (layers_per_block + 1 resnets, then nearest 2x
//            upsampling and a conv, except on the last) -> GroupNorm, SiLU, conv_out
// Every GroupNorm has eps 1e-6, as diffusers builds them. Latents for a diffusion model are
// (sample - shift_factor) * scaling_factor.
#pragma once
#include <cstdint>
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

namespace ddm::sd {

// config.json's keys, as diffusers names them.
struct AutoencoderKLConfig {
  int64_t in_channels = 3, out_channels = 3, latent_channels = 4;
  std::vector<int64_t> block_out_channels = {64};
  int64_t layers_per_block = 1, norm_num_groups = 32, sample_size = 32;
  double scaling_factor = 0.18215, shift_factor = 0;  // shift_factor null in the file: 0
  bool force_upcast = true, use_quant_conv = true, use_post_quant_conv = true, mid_block_add_attention = true;

  int64_t factor() const { return int64_t{1} << (block_out_channels.size() - 1); }  // image side / latent side
};

// Reads a config.json object (`file` names it in errors). Refuses, naming the key and the value: a
// _class_name other than AutoencoderKL, block types other than DownEncoderBlock2D / UpDecoderBlock2D,
// act_fn other than silu, latents_mean / latents_std (models that normalize per channel: not yet),
// a key diffusers' AutoencoderKL does not have, widths the groups do not divide.
AutoencoderKLConfig parse_autoencoder_kl_config(const nlohmann::json& config, const std::string& file);
nlohmann::json autoencoder_kl_config_json(const AutoencoderKLConfig& c);

// diffusers' ResnetBlock2D without a time embedding: GroupNorm, SiLU, conv3x3, GroupNorm, SiLU,
// conv3x3, plus conv_shortcut (1x1) when the widths differ.
class VaeResnetImpl : public torch::nn::Module {
 public:
  VaeResnetImpl(int64_t in, int64_t out, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);  // [B, in, H, W] -> [B, out, H, W]

 private:
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
};
TORCH_MODULE(VaeResnet);

// diffusers' Attention as the VAE's mid block has it: one head over the pixels, group_norm before
// to_q / to_k / to_v (linears with bias), to_out.0, added to the input.
class VaeAttentionImpl : public torch::nn::Module {
 public:
  VaeAttentionImpl(int64_t ch, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);  // [B, ch, H, W] -> [B, ch, H, W]

 private:
  torch::nn::GroupNorm group_norm{nullptr};
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out;
};
TORCH_MODULE(VaeAttention);

// UNetMidBlock2D without a time embedding: resnets.0, attentions.0 (unless mid_block_add_attention
// is false), resnets.1.
class VaeMidBlockImpl : public torch::nn::Module {
 public:
  VaeMidBlockImpl(int64_t ch, int64_t groups, bool attention);
  torch::Tensor forward(const torch::Tensor& x);  // [B, ch, H, W] -> [B, ch, H, W]

 private:
  torch::nn::ModuleList resnets, attentions;
};
TORCH_MODULE(VaeMidBlock);

// DownEncoderBlock2D (resnets, downsamplers.0.conv) or UpDecoderBlock2D (resnets, upsamplers.0.conv).
class VaeBlockImpl : public torch::nn::Module {
 public:
  enum class Resample { kNone, kDown, kUp };
  VaeBlockImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, Resample resample);
  torch::Tensor forward(const torch::Tensor& x);  // [B, in, H, W] -> [B, out, H', W'] (H/2, H or 2H)

 private:
  Resample resample_;
  torch::nn::ModuleList resnets, samplers;
  torch::nn::Conv2d conv{nullptr};  // the resampler's (registered under samplers.0)
};
TORCH_MODULE(VaeBlock);

class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const AutoencoderKLConfig& c);
  torch::Tensor forward(const torch::Tensor& x);  // [B, in_channels, S, S] -> [B, 2z, S/f, S/f]

 private:
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down_blocks;
  VaeMidBlock mid_block{nullptr};
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeEncoder);

class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const AutoencoderKLConfig& c);
  torch::Tensor forward(const torch::Tensor& z);  // [B, z, h, w] -> [B, out_channels, h*f, w*f]

 private:
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  VaeMidBlock mid_block{nullptr};
  torch::nn::ModuleList up_blocks;
  torch::nn::GroupNorm conv_norm_out{nullptr};
};
TORCH_MODULE(VaeDecoder);

class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(AutoencoderKLConfig c);
  const AutoencoderKLConfig& config() const { return c_; }
  // x float [B, in_channels, S, S] in [-1, 1] -> the posterior's mean and log-variance (clamped to
  // [-30, 20], as diffusers' DiagonalGaussianDistribution), each [B, z, S/f, S/f].
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& x);
  // z [B, z, h, w] (unscaled: a sample of the posterior) -> images [B, out_channels, h*f, w*f].
  torch::Tensor decode(const torch::Tensor& z);

 private:
  AutoencoderKLConfig c_;
  VaeEncoder encoder{nullptr};
  VaeDecoder decoder{nullptr};
  torch::nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};
};
TORCH_MODULE(AutoencoderKL);

// A diffusers AutoencoderKL directory (config.json and diffusion_pytorch_model.safetensors, or its
// sharded index): the model with its weights, on the CPU in float32. Throws ddm::Error naming the
// file and the tensor: a tensor missing, one of another shape than the config makes, one the model
// has no place for.
AutoencoderKL load_autoencoder_kl(const std::string& dir);

// Writes `model` as diffusers writes it: DIR/config.json and DIR/diffusion_pytorch_model.safetensors.
void save_autoencoder_kl(AutoencoderKL& model, const std::string& dir);

}  // namespace ddm::sd
