// CrossAttention and SpatialTransformer (text_layers.h) in LibTorch's modules and its
// scaled_dot_product_attention.
#include "model/text_layers.h"

#include <torch/torch.h>

#include "core/error.h"
#include "model/layers.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

void check_text_cond(const Cond& c, int64_t B, const ModelConfig& m, const char* net) {
  if (m.text_dim == 0) return;
  DDM_CHECK(c.context.defined() && c.context.dim() == 3 && c.context.size(0) == B && c.context.size(2) == m.text_dim,
            net << ": a text-conditioned model needs each sample's text encoding [B, T, " << m.text_dim << "], got "
                << (c.context.defined() ? c.context.sizes() : torch::IntArrayRef{}));
  DDM_CHECK(m.text_pooled_dim == 0 || c.pooled.defined(),
            net << ": a model with model.text_pooled_dim needs each sample's pooled text embedding");
}

torch::Tensor attention_key_mask(const torch::Tensor& mask) {
  if (!mask.defined()) return {};
  return (mask != 0).view({mask.size(0), 1, 1, mask.size(1)});  // bool [B, 1, 1, T]
}

CrossAttentionImpl::CrossAttentionImpl(int64_t dim, int64_t context_dim, int64_t heads) : heads_(heads) {
  DDM_CHECK(heads > 0 && dim % heads == 0, "CrossAttention: width " << dim << " not divisible by heads " << heads);
  DDM_CHECK(context_dim > 0, "CrossAttention: the context's width must be > 0, got " << context_dim);
  q_ = register_module("q", nn::Linear(nn::LinearOptions(dim, dim).bias(false)));
  k_ = register_module("k", nn::Linear(nn::LinearOptions(context_dim, dim).bias(false)));
  v_ = register_module("v", nn::Linear(nn::LinearOptions(context_dim, dim).bias(false)));
  out_ = register_module("out", nn::Linear(dim, dim));
  zero_init(*out_);
}

torch::Tensor CrossAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& mask) {
  const int64_t B = x.size(0), N = x.size(1), W = x.size(2), T = context.size(1), d = W / heads_;
  DDM_CHECK(context.dim() == 3 && context.size(0) == B,
            "CrossAttention: a context of " << context.sizes() << " for " << B << " samples");
  const auto q = apply_linear(q_, x).view({B, N, heads_, d}).transpose(1, 2);        // [B, h, N, d]
  const auto k = apply_linear(k_, context).view({B, T, heads_, d}).transpose(1, 2);  // [B, h, T, d]
  const auto v = apply_linear(v_, context).view({B, T, heads_, d}).transpose(1, 2);  // [B, h, T, d]
  const auto a = at::scaled_dot_product_attention(q, k, v, attention_key_mask(mask));  // [B, h, N, d]
  return apply_linear(out_, a.transpose(1, 2).reshape({B, N, W}));     // [B, N, W]
}

SpatialTransformerImpl::SpatialTransformerImpl(int64_t ch, int64_t context_dim, int64_t heads, int64_t groups)
    : ch_(ch), heads_(heads) {
  DDM_CHECK(heads > 0 && ch % heads == 0, "SpatialTransformer: channels " << ch << " not divisible by heads " << heads);
  norm_ = register_module("norm", nn::GroupNorm(nn::GroupNormOptions(groups, ch).eps(1e-6)));
  proj_in_ = register_module("proj_in", nn::Linear(ch, ch));
  ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({ch})));
  qkv_ = register_module("qkv", nn::Linear(nn::LinearOptions(ch, 3 * ch).bias(false)));
  attn_out_ = register_module("attn_out", nn::Linear(ch, ch));
  ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({ch})));
  cross_ = register_module("cross", CrossAttention(ch, context_dim, heads));
  ln3_ = register_module("ln3", nn::LayerNorm(nn::LayerNormOptions({ch})));
  ff_in_ = register_module("ff_in", nn::Linear(ch, 8 * ch));  // GEGLU: 4 ch values and 4 ch gates
  ff_out_ = register_module("ff_out", nn::Linear(4 * ch, ch));
  proj_out_ = register_module("proj_out", nn::Linear(ch, ch));
  zero_init(*proj_out_);
}

torch::Tensor SpatialTransformerImpl::forward(const torch::Tensor& x, const torch::Tensor& context, const torch::Tensor& mask) {
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3), N = H * W, d = ch_ / heads_;
  auto h = apply_linear(proj_in_, group_norm_act(norm_, x, /*silu=*/false).flatten(2).transpose(1, 2));  // [B, N, ch]
  const auto qkv = apply_linear(qkv_, ln1_(h)).view({B, N, 3, heads_, d}).permute({2, 0, 3, 1, 4});  // [3, B, h, N, d]
  h = h + apply_linear(attn_out_, at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
                                      .transpose(1, 2)
                                      .reshape({B, N, ch_}));           // [B, N, ch]
  h = h + cross_(ln2_(h), context, mask);                              // [B, N, ch]
  const auto ff = apply_linear(ff_in_, ln3_(h)).chunk(2, -1);          // 2 x [B, N, 4 ch]
  h = h + apply_linear(ff_out_, ff[0] * torch::gelu(ff[1]));           // [B, N, ch]
  return x + apply_linear(proj_out_, h).transpose(1, 2).reshape({B, ch_, H, W});  // [B, ch, H, W]
}

}  // namespace ddm
