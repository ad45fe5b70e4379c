// Text conditioning in the backbones: image tokens attending to a frozen text encoder's token
// states (Cond::context), as Stable Diffusion's U-Net and PixArt-α's DiT do.
//   CrossAttention      q from the image tokens, k and v from the context (linears without bias,
//                       as SD's attention), heads, an output linear (zero-initialized: a new
//                       cross-attention adds nothing at first); a key mask leaves padding out
//   SpatialTransformer  SD's transformer at a U-Net level: GroupNorm, a linear projection to
//                       tokens, one block of self-attention, cross-attention and a GEGLU
//                       feed-forward (each pre-LayerNorm, residual), a zero-initialized projection
//                       back, added to its input: the level starts as the identity
// The pooled embedding of the text goes through a linear into the time embedding (unet.h, dit.h).
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "core/config.h"
#include "model/net.h"

namespace ddm {

class CrossAttentionImpl : public torch::nn::Module {
 public:
  CrossAttentionImpl(int64_t dim, int64_t context_dim, int64_t heads);
  // x [B, N, dim], context [B, T, context_dim], mask [B, T] (nonzero: attend; undefined: all) ->
  // [B, N, dim], the attention's output (not added to x).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& mask);

 private:
  int64_t heads_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, out_{nullptr};
};
TORCH_MODULE(CrossAttention);

class SpatialTransformerImpl : public torch::nn::Module {
 public:
  SpatialTransformerImpl(int64_t ch, int64_t context_dim, int64_t heads, int64_t groups);
  // x [B, ch, H, W], context [B, T, context_dim], mask [B, T] or undefined -> [B, ch, H, W].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& mask);

 private:
  int64_t ch_, heads_;
  torch::nn::GroupNorm norm_{nullptr};
  torch::nn::Linear proj_in_{nullptr}, qkv_{nullptr}, attn_out_{nullptr}, ff_in_{nullptr}, ff_out_{nullptr},
      proj_out_{nullptr};
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr}, ln3_{nullptr};
  CrossAttention cross_{nullptr};
};
TORCH_MODULE(SpatialTransformer);

// Checks that c carries what a text-conditioned net of model `m` takes for a batch of B (the token
// states [B, T, text_dim]; the pooled embedding when text_pooled_dim > 0): a ddm::Error naming `net`.
void check_text_cond(const Cond& c, int64_t B, const ModelConfig& m, const char* net);

// A key mask [B, T] (nonzero: attend) as scaled_dot_product_attention's boolean mask [B, 1, 1, T];
// undefined stays undefined.
torch::Tensor attention_key_mask(const torch::Tensor& mask);

}  // namespace ddm
