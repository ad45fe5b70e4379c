// Building blocks shared by the U-Net and the DiT: sinusoidal timestep embedding, the time MLP,
// the class embedding with a null row (classifier-free guidance), the U-Net residual and spatial
// self-attention blocks, the adaLN-Zero DiT block and its final layer, patchify / unpatchify and
// the fixed 2-D sin-cos position embedding.
//
// Every block is written so that the same module is a few lines of plain PyTorch (nn.Conv2d,
// nn.Linear, nn.GroupNorm, nn.LayerNorm, F.silu, F.gelu). The DiT MLP uses the exact (erf) GELU.
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "model/text_layers.h"

namespace ddm {

// Sinusoidal embedding of the noise level t (float [B], t in [0, 1]) -> float [B, dim].
// t is first scaled by 1000 so that the usual transformer frequencies (which expect integer-like
// timesteps 0..1000 as in DDPM) see the same range: with s = 1000 t, half = dim / 2 and
// f_i = max_period^(-i / half) for i in [0, half), the output is [cos(s f_0..f_{half-1}),
// sin(s f_0..f_{half-1})], zero-padded by one column when dim is odd.
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period = 10000.0);

// Fixed 2-D sin-cos position embedding for a grid x grid token layout (row-major tokens):
// float [grid * grid, dim]. The first dim/2 columns encode the row, the last dim/2 the column; each
// half is [sin(p w_0..), cos(p w_0..)] with w_i = 10000^(-i / (dim / 4)). dim must be divisible by 4.
torch::Tensor pos_embed_2d(int64_t dim, int64_t grid);

// Splits images into non-overlapping p x p patches: x [B, C, H, W] -> [B, (H/p)(W/p), C p p]
// with tokens in row-major order and features ordered (c, py, px) -- the same order a
// Conv2d(C, D, kernel p, stride p) uses for its weight, so linear-on-patches == that conv.
torch::Tensor patchify(const torch::Tensor& x, int64_t p);
// Inverse of patchify: tokens [B, (H/p)(W/p), C p p] -> [B, C, H, W].
torch::Tensor unpatchify(const torch::Tensor& tokens, int64_t p, int64_t channels, int64_t height,
                         int64_t width);

// t -> sinusoidal(freq_dim) -> Linear(freq_dim, dim) -> SiLU -> Linear(dim, dim).
class TimeEmbedderImpl : public torch::nn::Module {
 public:
  TimeEmbedderImpl(int64_t freq_dim, int64_t dim);
  torch::Tensor forward(const torch::Tensor& t);  // t [B] -> [B, dim]
  int64_t freq_dim() const { return freq_dim_; }

 private:
  int64_t freq_dim_;
  torch::nn::Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(TimeEmbedder);

// Class label embedding with num_classes + 1 rows; row num_classes is the learned null class used
// for label dropout and classifier-free guidance. Only built when num_classes > 0.
class LabelEmbedderImpl : public torch::nn::Module {
 public:
  LabelEmbedderImpl(int64_t num_classes, int64_t dim);
  torch::Tensor forward(const torch::Tensor& y);  // y int64 [B] in [0, num_classes] -> [B, dim]
  int64_t num_classes() const { return num_classes_; }

 private:
  int64_t num_classes_;
  torch::nn::Embedding table_{nullptr};
};
TORCH_MODULE(LabelEmbedder);

// U-Net residual block: h = conv3x3(SiLU(GN(x))); h = GN(h) * (1 + scale) + shift with
// (scale, shift) = Linear(SiLU(emb)); h = conv3x3(SiLU(h)); out = skip(x) + h, where skip is a 1x1
// conv when the channel count changes. The second conv is zero-initialized, so the block starts as
// (a projection of) the identity. No dropout.
class ResBlockImpl : public torch::nn::Module {
 public:
  ResBlockImpl(int64_t in_ch, int64_t out_ch, int64_t emb_dim, int64_t groups);
  // x [B, in_ch, H, W]; emb_act = SiLU(embedding) [B, emb_dim] (computed once by the caller).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& emb_act);

 private:
  int64_t out_ch_;
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Conv2d conv1_{nullptr}, conv2_{nullptr}, skip_{nullptr};
  torch::nn::Linear emb_{nullptr};
};
TORCH_MODULE(ResBlock);

// Multi-head self-attention over the H*W spatial positions of a feature map:
// out = x + proj(attention(qkv(GN(x)))), qkv and proj 1x1 convs, proj zero-initialized.
class AttentionBlockImpl : public torch::nn::Module {
 public:
  AttentionBlockImpl(int64_t ch, int64_t heads, int64_t groups);
  torch::Tensor forward(const torch::Tensor& x);  // [B, ch, H, W] -> [B, ch, H, W]

 private:
  int64_t heads_;
  torch::nn::GroupNorm norm_{nullptr};
  torch::nn::Conv2d qkv_{nullptr}, proj_{nullptr};
};
TORCH_MODULE(AttentionBlock);

// LayerNorm epsilon of the DiT blocks and final layer (as in DiT).
constexpr double kDiTNormEps = 1e-6;

// DiT block with adaLN-Zero conditioning (Peebles & Xie 2023). One Linear(width, 6 width) on
// SiLU(c) yields (shift, scale, gate) for the attention and the MLP branch; it is zero-initialized,
// so every block is the identity at init. Attention uses one fused qkv Linear. LayerNorm has no
// affine parameters (epsilon kDiTNormEps) and runs fused with the modulation (ops.h).
//
// With context_dim > 0 the block is PixArt-α's: after the self-attention, x += CrossAttention(x,
// context) (model/text_layers.h; its output linear zero-initialized, no modulation, no norm).
class DiTBlockImpl : public torch::nn::Module {
 public:
  DiTBlockImpl(int64_t width, int64_t heads, double mlp_ratio, int64_t context_dim = 0);
  // x [B, N, width]; c_act = SiLU(c) [B, width] (computed once for all blocks by the caller);
  // context [B, T, context_dim] and its mask [B, T] (or undefined) when the block has cross-attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& c_act, const torch::Tensor& context = {},
                        const torch::Tensor& context_mask = {});
  torch::nn::Linear& modulation() { return ada_; }

 private:
  int64_t width_, heads_;
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr}, ada_{nullptr};
  CrossAttention cross_{nullptr};  // with context_dim > 0
};
TORCH_MODULE(DiTBlock);

// DiT output head: LayerNorm, adaLN (shift, scale) from Linear(width, 2 width) on SiLU(c), then
// Linear(width, out_dim). Both linears are zero-initialized, so the head outputs exactly 0 at init.
class DiTFinalLayerImpl : public torch::nn::Module {
 public:
  DiTFinalLayerImpl(int64_t width, int64_t out_dim);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& c_act);  // -> [B, N, out_dim]

 private:
  torch::nn::Linear ada_{nullptr}, linear_{nullptr};
};
TORCH_MODULE(DiTFinalLayer);

// Sets a module's weight (and bias, if any) to zero. Works for Linear and Conv2d.
void zero_init(torch::nn::Module& m);

}  // namespace ddm
