// The KL-regularized convolutional autoencoder of latent diffusion (Rombach et al. 2022, Stable
// Diffusion's AutoencoderKL), at Fashion-MNIST's scale: an encoder maps images [B, C, S, S] to a
// diagonal Gaussian posterior over latents [B, z, S/f, S/f], a decoder maps latents back to images.
// Frozen once trained, its encoder is the non-trainable work of every step of a latent model.
//
// Encoder: conv3x3(C -> ch) -> per level l: res_blocks ResnetBlocks to ch * mult[l], then a stride-2
// conv (right/bottom zero padding, as SD's Downsample) on every level but the last -> middle
// (ResnetBlock, single-head self-attention, ResnetBlock) -> GroupNorm, SiLU, conv3x3 -> 2z channels
// (mean and log-variance) -> 1x1 conv. Decoder, mirrored: 1x1 conv -> conv3x3(z -> ch * mult[-1]) ->
// middle -> per level from the last: res_blocks + 1 ResnetBlocks, then nearest 2x upsampling + conv3x3
// on every level but the first -> GroupNorm, SiLU, conv3x3 -> C. f = 2^(levels - 1).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "core/config.h"
#include "model/layers.h"
#include "model/net.h"

namespace ddm {

struct AutoencoderShape {
  int64_t in_channels = 1;
  int64_t image_size = 28;
  int64_t channels = 32;                          // width of the first level
  std::vector<int64_t> channel_mult = {1, 2, 2};  // one entry per resolution level: f = 2^(levels - 1)
  int64_t res_blocks = 1;                         // ResnetBlocks per encoder level (decoder: + 1)
  int64_t latent_channels = 4;                    // z
  int64_t groups = 8;                             // GroupNorm groups
  bool mid_attention = true;                      // self-attention in the middle blocks

  int64_t factor() const { return int64_t{1} << (channel_mult.size() - 1); }
  int64_t latent_size() const { return image_size / factor(); }
};
// The shape of a model config with arch = autoencoder (in_channels and image_size resolved).
AutoencoderShape autoencoder_shape(const ModelConfig& cfg);

// Throws ddm::Error naming the field when the shape cannot be built (a zero width, groups that do not
// divide a level's channels, an image size the downsamplings do not divide).
void validate_autoencoder(const AutoencoderShape& s);

// The encoder's output: a diagonal Gaussian over latents, mean and log-variance [B, z, h, w]; the
// log-variance is clamped to [-30, 20] (as SD's DiagonalGaussianDistribution) so exp() stays finite.
struct Posterior {
  torch::Tensor mean, logvar;
  // mean + exp(logvar / 2) * eps, eps [B, z, h, w] standard normal noise from the caller (keyed, so
  // that a batch split over ranks draws what one process draws).
  torch::Tensor sample(const torch::Tensor& eps) const;
  // KL(q || N(0, I)) per sample, summed over latent elements: [B].
  torch::Tensor kl() const;
};

// GroupNorm -> SiLU -> conv3x3 -> GroupNorm -> SiLU -> conv3x3, plus a 1x1 shortcut when the channel
// count changes (no time embedding: unlike the U-Net's ResBlock).
class ResnetBlockImpl : public torch::nn::Module {
 public:
  ResnetBlockImpl(int64_t in_ch, int64_t out_ch, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);  // [B, in_ch, H, W] -> [B, out_ch, H, W]

 private:
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, skip_{nullptr};
};
TORCH_MODULE(ResnetBlock);

// A Net so that `ddm train` machinery (checkpoints, EMA, data parallelism) trains it as any model:
// forward(x, t, y) reconstructs x through the posterior mean and ignores t and y; training itself
// samples the posterior (diffusion/objective.h, AutoencoderObjective).
class AutoencoderImpl : public NetImpl {
 public:
  explicit AutoencoderImpl(const AutoencoderShape& shape);
  // x: float [B, C, S, S] -> decode(encode(x).mean) [B, C, S, S].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  // x: float [B, C, S, S] in [-1, 1] -> the posterior over latents [B, z, S/f, S/f].
  Posterior encode(const torch::Tensor& x);
  // z: float [B, z, S/f, S/f] -> images [B, C, S, S] (not clamped).
  torch::Tensor decode(const torch::Tensor& z);
  const AutoencoderShape& shape() const { return shape_; }

 private:
  // ResnetBlock, self-attention (if shape.mid_attention), ResnetBlock at the lowest resolution.
  struct Middle {
    ResnetBlock res1{nullptr}, res2{nullptr};
    AttentionBlock attn{nullptr};
  };
  Middle make_middle(const std::string& prefix, int64_t ch);
  static torch::Tensor run_middle(Middle& m, const torch::Tensor& h);

  AutoencoderShape shape_;
  torch::nn::Conv2d enc_in_{nullptr}, enc_out_{nullptr}, quant_{nullptr};
  torch::nn::Conv2d post_quant_{nullptr}, dec_in_{nullptr}, dec_out_{nullptr};
  torch::nn::GroupNorm enc_norm_{nullptr}, dec_norm_{nullptr};
  std::vector<std::vector<ResnetBlock>> enc_blocks_, dec_blocks_;  // [level][block]; dec_blocks_ from the last level
  std::vector<torch::nn::Conv2d> down_, up_;                       // down_[l]: after encoder level l; up_[i]: after decoder stage i
  Middle enc_mid_, dec_mid_;
};
TORCH_MODULE(Autoencoder);

// Analytic forward FLOPs per image of the encoder and of the decoder (2 x multiply-accumulates of
// convolutions and attention matmuls), as net.h's forward_flops_per_image counts them.
double encoder_flops_per_image(const AutoencoderShape& s);
double decoder_flops_per_image(const AutoencoderShape& s);

}  // namespace ddm
