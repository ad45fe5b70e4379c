// The pieces diffusers' UNet2DConditionModel (unet_2d_condition.h) and ControlNetModel
// (controlnet_model.h) build alike, under diffusers' own parameter names: the architecture keys of
// their config.json, the time embedding, ResnetBlock2D, the attention blocks, and the encoder half
// (down_blocks and mid_block), which a ControlNet copies from its UNet key for key.
//   Transformer2DModel: GroupNorm (eps 1e-6), proj_in (1x1 conv, or a linear with
//   use_linear_projection), one BasicTransformerBlock (LayerNorm + self-attention, LayerNorm +
//   cross-attention on the context, LayerNorm + GEGLU feed-forward of 4x, each residual; q, k, v
//   without bias), proj_out, added to the input.
// Heads per level: attention_head_dim, which in these configs counts heads (diffusers' legacy name).
#pragma once
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "model/net.h"

namespace ddm::sd {

// diffusers' convolutions (padding k / 2) and group norms, as every block here makes them.
torch::nn::Conv2d sd_conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1);
torch::nn::GroupNorm sd_group_norm(int64_t groups, int64_t ch, double eps);

// config.json's keys that shape the network, as diffusers names them. A ControlNetModel has no
// out_channels, sample_size or up_block_types: they keep these defaults there.
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

// Reads the architecture keys of a config.json object of diffusers class `class_name` (`file` names
// it in errors). A key of `fixed` must hold the value given there (diffusers' default: ddm builds only
// that) and is refused by name otherwise; a key neither in `fixed`, nor read here, nor in `extra` is
// refused as unknown. up_block_types is read only when `extra` lists it.
UNet2DConditionConfig parse_unet_config_keys(const nlohmann::json& j, const std::string& file,
                                             const std::string& class_name, const std::set<std::string>& extra,
                                             const std::map<std::string, nlohmann::json>& fixed);
// The keys parse_unet_config_keys reads, as diffusers writes them (no up_block_types, out_channels or
// sample_size: the caller adds its own).
nlohmann::json unet_config_keys_json(const UNet2DConditionConfig& c);

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

// CrossAttnDownBlock2D / DownBlock2D / UNetMidBlock2DCrossAttn / CrossAttnUpBlock2D / UpBlock2D:
// resnets, attentions (none in the plain blocks) and a resampler (downsamplers.0.conv, a stride-2 conv;
// upsamplers.0.conv after nearest 2x upsampling).
class LevelImpl : public torch::nn::Module {
 public:
  enum class Kind { kDown, kMid, kUp };
  explicit LevelImpl(Kind k);
  void add_resampler(int64_t ch);
  torch::Tensor resnet(size_t i, const torch::Tensor& x, const torch::Tensor& temb);       // [B, in, h, w] -> [B, out, h, w]
  torch::Tensor attend(size_t i, const torch::Tensor& x, const torch::Tensor& context);    // the identity without attention

  Kind kind;
  torch::nn::ModuleList resnets, attentions, samplers;
  torch::nn::Conv2d resample{nullptr};
};
TORCH_MODULE(Level);

// TimestepEmbedding: linear_1, SiLU, linear_2.
class TimeEmbeddingImpl : public torch::nn::Module {
 public:
  TimeEmbeddingImpl(int64_t in, int64_t dim);
  // diffusers' timestep [B] (any float) -> the time embedding [B, dim], computed in `dtype`.
  torch::Tensor forward(const torch::Tensor& timestep, torch::ScalarType dtype);

  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimeEmbedding);

// The encoder half, as both models build it: down_blocks (one Level per width, a resampler on all but
// the last) and mid_block (resnet, transformer, resnet).
torch::nn::ModuleList make_down_blocks(const UNet2DConditionConfig& c);
Level make_mid_block(const UNet2DConditionConfig& c);
// The mid block's forward: [B, w[-1], h, w] -> the same.
torch::Tensor mid_forward(LevelImpl& mid, const torch::Tensor& h, const torch::Tensor& emb, const torch::Tensor& context);

// For NetUnits (model/net.h): the parameters of the given modules (null ones skipped), and the j-th
// module of a list (null past its end).
std::vector<torch::Tensor> params_of(std::initializer_list<const torch::nn::Module*> modules);
const torch::nn::Module* item_or_null(const torch::nn::ModuleList& list, size_t j);

// A down level's j-th resnet (and its transformer, if the level has them) on the carry k (k.h the
// activation, k.emb the time embedding), and the level's downsampler: each keeps its output as a skip.
void down_step(LevelImpl& level, NetCarry& k, size_t j, const torch::Tensor& context);
void downsample_step(LevelImpl& level, NetCarry& k);

// The multiply-accumulate counts, doubled, that unet_2d_condition_flops and controlnet_model_flops add up.
namespace flops_of {
double conv(double in, double out, double k, double pixels);
double resnet(double in, double out, double temb, double pixels);
double transformer(double ch, double pixels, double tokens, double context_dim);
// conv_in, the time embedding, down_blocks and mid_block at H x W; appends each skip's width to `skips`
// and leaves the pixels at the lowest level in `pixels`.
double encoder(const UNet2DConditionConfig& c, int64_t H, int64_t W, int64_t tokens, std::vector<int64_t>& skips,
               double& pixels);
}  // namespace flops_of

}  // namespace ddm::sd
