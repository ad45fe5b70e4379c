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
//   Transformer2DModel: GroupNorm (eps 1e-6), proj_in (1x1 conv, or a linear with
//   use_linear_projection), one BasicTransformerBlock (LayerNorm + self-attention, LayerNorm +
//   cross-attention on the context, LayerNorm + GEGLU feed-forward of 4x, each residual; q, k, v
//   without bias), proj_out, added to the input.
// Heads per level: attention_head_dim, which in these configs counts heads (diffusers' legacy name).
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

namespace ddm::sd {

// config.json's keys that shape the network, as diffusers names them.
struct UNet2DConditionConfig {
  int64_t in_channels = 4, out_channels = 4, sample_size = 64;
  std::vector<std::string> down_block_types = {"CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                               "DownBlock2D"};
  std::vector<std::string> up_block_types = {"UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D",
                                             "CrossAttnUpBlock2D"};
  std::vector<int64_t> block_out_channels = {320, 640, 1280, 1280};
  int64_t layers_per_block = 2, norm_num_groups = 32, cross_attention_dim = 1280;
  double norm_eps = 1e-5;
  std::vector<int64_t> heads = {8, 8, 8, 8};  // attention_head_dim, one per level
  bool use_linear_projection = false, upcast_attention = false;

  int64_t time_embed_dim() const { return 4 * block_out_channels.front(); }
};

// Reads a config.json object (`file` names it in errors). A key that changes the network in a way
// ddm does not build (class or time embeddings, other block types, a time-conditioning projection,
// more than one transformer layer per block, ...) is refused by name unless it holds diffusers'
// default; a key diffusers' UNet2DConditionModel does not have is refused.
UNet2DConditionConfig parse_unet_2d_condition_config(const nlohmann::json& config, const std::string& file);
nlohmann::json unet_2d_condition_config_json(const UNet2DConditionConfig& c);

// ResnetBlock2D with a time embedding: GroupNorm, SiLU, conv3x3, + time_emb_proj(SiLU(temb)),
// GroupNorm, SiLU, conv3x3, plus conv_shortcut (1x1) when the widths differ.
class UnetResnetImpl : public torch::nn::Module {
 public:
  UnetResnetImpl(int64_t in, int64_t out, int64_t temb, int64_t groups, double eps);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb);  // [B, in, H, W], [B, temb] -> [B, out, H, W]

 private:
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  torch::nn::Linear time_emb_proj{nullptr};
};
TORCH_MODULE(UnetResnet);

// diffusers' Attention of a BasicTransformerBlock: to_q, to_k, to_v without bias, to_out.0 with.
class SdAttentionImpl : public torch::nn::Module {
 public:
  SdAttentionImpl(int64_t dim, int64_t context_dim, int64_t heads);
  // x [B, N, dim], context [B, T, context_dim] (self-attention: x) -> [B, N, dim]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context);

 private:
  int64_t heads_;
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out;
};
TORCH_MODULE(SdAttention);

// Transformer2DModel with one BasicTransformerBlock (transformer_blocks.0).
class SdTransformerImpl : public torch::nn::Module {
 public:
  SdTransformerImpl(int64_t ch, int64_t heads, int64_t context_dim, int64_t groups, bool linear_projection);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context);  // [B, ch, H, W], [B, T, C] -> [B, ch, H, W]

 private:
  bool linear_;
  torch::nn::GroupNorm norm{nullptr};
  std::shared_ptr<torch::nn::Module> proj_in, proj_out;  // 1x1 convs, or linears
  torch::nn::ModuleList transformer_blocks;
};
TORCH_MODULE(SdTransformer);

class UNet2DConditionModelImpl : public torch::nn::Module {
 public:
  explicit UNet2DConditionModelImpl(UNet2DConditionConfig c);
  const UNet2DConditionConfig& config() const { return c_; }
  // sample [B, in_channels, H, W] (H, W multiples of 2^(levels - 1)), timestep [B] on diffusers'
  // scale (0..999, any float), context [B, T, cross_attention_dim] -> [B, out_channels, H, W].
  torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context);
  // forward as units (model/net.h), for pipeline stages and their profiler: from NetCarry{h = sample}
  // they leave forward's output in h, bit for bit. A unit reads ddm's time t, which `timestep` maps to
  // diffusers' scale, and the context from Cond::context. The carry's emb is the time embedding.
  std::vector<NetUnit> units(std::function<torch::Tensor(const torch::Tensor&)> timestep);

 private:
  void check_inputs(const torch::Tensor& sample, const torch::Tensor& timestep, const torch::Tensor& context) const;
  // The pieces of forward, each a unit: k.h is the running activation, k.emb the time embedding, k.skips the skips.
  void unit_in(NetCarry& k, const torch::Tensor& timestep);
  void unit_down(NetCarry& k, size_t level, size_t j, const torch::Tensor& context);
  void unit_downsample(NetCarry& k, size_t level);
  void unit_mid(NetCarry& k, const torch::Tensor& context);
  void unit_up(NetCarry& k, size_t level, size_t j, const torch::Tensor& context);
  void unit_upsample(NetCarry& k, size_t level);
  void unit_out(NetCarry& k);

  UNet2DConditionConfig c_;
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  std::shared_ptr<torch::nn::Module> time_embedding, mid_block;
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
