// The KL autoencoder of latent diffusion (see autoencoder.h).
#include "model/autoencoder.h"

#include <string>

#include <torch/torch.h>

#include "core/error.h"
#include "model/flops.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

namespace {

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t padding = -1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(padding < 0 ? k / 2 : padding));
}

int64_t level_ch(const AutoencoderShape& s, size_t l) { return s.channels * s.channel_mult[l]; }

}  // namespace

AutoencoderShape autoencoder_shape(const ModelConfig& cfg) {
  AutoencoderShape s;
  s.in_channels = cfg.in_channels;
  s.image_size = cfg.image_size;
  s.channels = cfg.channels;
  s.channel_mult = cfg.channel_mult;
  s.res_blocks = cfg.res_blocks;
  s.latent_channels = cfg.latent_channels;
  s.groups = cfg.groups;
  s.mid_attention = true;
  return s;
}

void validate_autoencoder(const AutoencoderShape& s) {
  DDM_CHECK(s.in_channels >= 1, "model.in_channels must be >= 1, got " << s.in_channels);
  DDM_CHECK(s.channels > 0, "model.channels must be > 0, got " << s.channels);
  DDM_CHECK(!s.channel_mult.empty() && s.channel_mult.size() <= 6,
            "model.channel_mult must list 1 to 6 levels, got " << s.channel_mult.size());
  for (auto m : s.channel_mult) DDM_CHECK(m > 0, "model.channel_mult entries must be > 0, got " << m);
  DDM_CHECK(s.res_blocks >= 1, "model.res_blocks must be >= 1, got " << s.res_blocks);
  DDM_CHECK(s.latent_channels >= 1, "model.latent_channels must be >= 1, got " << s.latent_channels);
  DDM_CHECK(s.groups > 0, "model.groups must be > 0, got " << s.groups);
  for (size_t l = 0; l < s.channel_mult.size(); ++l)
    DDM_CHECK(level_ch(s, l) % s.groups == 0, "model.groups = " << s.groups << " does not divide the "
                                                  << level_ch(s, l) << " channels of level " << l
                                                  << " (model.channels * model.channel_mult[" << l << "])");
  DDM_CHECK(s.image_size >= s.factor() && s.image_size % s.factor() == 0,
            "model.arch = autoencoder: the image size " << s.image_size << " is not divisible by the downsampling factor "
                                           << s.factor() << " (2^(levels - 1), model.channel_mult has "
                                           << s.channel_mult.size() << " levels); use fewer levels");
}

torch::Tensor Posterior::sample(const torch::Tensor& eps) const {
  DDM_CHECK(eps.sizes() == mean.sizes(), "Posterior::sample: noise " << eps.sizes() << " for latents " << mean.sizes());
  return mean + torch::exp(0.5 * logvar) * eps;  // [B, z, h, w]
}

torch::Tensor Posterior::kl() const {
  // KL(N(mu, var) || N(0, 1)) = (mu^2 + var - 1 - log var) / 2 per element, summed per sample.
  return 0.5 * (mean.pow(2) + torch::exp(logvar) - 1.0 - logvar).flatten(1).sum(1);  // [B]
}

ResnetBlockImpl::ResnetBlockImpl(int64_t in_ch, int64_t out_ch, int64_t groups) {
  norm1_ = register_module("norm1", nn::GroupNorm(groups, in_ch));
  conv1_ = register_module("conv1", conv(in_ch, out_ch, 3));
  norm2_ = register_module("norm2", nn::GroupNorm(groups, out_ch));
  conv2_ = register_module("conv2", conv(out_ch, out_ch, 3));
  if (in_ch != out_ch) skip_ = register_module("skip", conv(in_ch, out_ch, 1));
}

torch::Tensor ResnetBlockImpl::forward(const torch::Tensor& x) {
  auto h = conv1_(group_norm_silu(norm1_, x));    // [B, out, H, W]
  h = conv2_(group_norm_silu(norm2_, h));         // [B, out, H, W]
  return (skip_ ? skip_(x) : x) + h;              // [B, out, H, W]
}

AutoencoderImpl::Middle AutoencoderImpl::make_middle(const std::string& prefix, int64_t ch) {
  Middle m;
  m.res1 = register_module(prefix + "_res1", ResnetBlock(ch, ch, shape_.groups));
  if (shape_.mid_attention) m.attn = register_module(prefix + "_attn", AttentionBlock(ch, 1, shape_.groups));
  m.res2 = register_module(prefix + "_res2", ResnetBlock(ch, ch, shape_.groups));
  return m;
}

torch::Tensor AutoencoderImpl::run_middle(Middle& m, const torch::Tensor& h) {
  auto out = m.res1(h);                 // [B, ch, h, w]
  if (m.attn) out = m.attn(out);        // [B, ch, h, w]
  return m.res2(out);                   // [B, ch, h, w]
}

AutoencoderImpl::AutoencoderImpl(const AutoencoderShape& shape) : shape_(shape) {
  validate_autoencoder(shape);
  const size_t L = shape.channel_mult.size();
  const int64_t z = shape.latent_channels, g = shape.groups;
  // Encoder.
  int64_t cur = level_ch(shape, 0);
  enc_in_ = register_module("enc_in", conv(shape.in_channels, cur, 3));
  enc_blocks_.resize(L);
  for (size_t l = 0; l < L; ++l) {
    for (int64_t j = 0; j < shape.res_blocks; ++j) {
      const auto name = "enc" + std::to_string(l) + "_" + std::to_string(j);
      enc_blocks_[l].push_back(register_module(name, ResnetBlock(cur, level_ch(shape, l), g)));
      cur = level_ch(shape, l);
    }
    if (l + 1 < L) down_.push_back(register_module("down" + std::to_string(l), conv(cur, cur, 3, 2, 0)));
  }
  enc_mid_ = make_middle("enc_mid", cur);
  enc_norm_ = register_module("enc_norm", nn::GroupNorm(g, cur));
  enc_out_ = register_module("enc_out", conv(cur, 2 * z, 3));
  quant_ = register_module("quant", conv(2 * z, 2 * z, 1));
  // Decoder.
  post_quant_ = register_module("post_quant", conv(z, z, 1));
  dec_in_ = register_module("dec_in", conv(z, cur, 3));
  dec_mid_ = make_middle("dec_mid", cur);
  for (size_t i = 0; i < L; ++i) {
    const size_t l = L - 1 - i;  // the level this decoder stage works at
    dec_blocks_.emplace_back();
    for (int64_t j = 0; j <= shape.res_blocks; ++j) {
      const auto name = "dec" + std::to_string(l) + "_" + std::to_string(j);
      dec_blocks_[i].push_back(register_module(name, ResnetBlock(cur, level_ch(shape, l), g)));
      cur = level_ch(shape, l);
    }
    if (l > 0) up_.push_back(register_module("up" + std::to_string(l), conv(cur, cur, 3)));
  }
  dec_norm_ = register_module("dec_norm", nn::GroupNorm(g, cur));
  dec_out_ = register_module("dec_out", conv(cur, shape.in_channels, 3));
}

Posterior AutoencoderImpl::encode(const torch::Tensor& x) {
  const auto& s = shape_;
  DDM_CHECK(x.dim() == 4 && x.size(1) == s.in_channels && x.size(2) == s.image_size && x.size(3) == s.image_size,
            "autoencoder: expected images [B, " << s.in_channels << ", " << s.image_size << ", " << s.image_size
                                                << "], got " << x.sizes());
  auto h = enc_in_(x);                                          // [B, ch*m0, S, S]
  for (size_t l = 0; l < enc_blocks_.size(); ++l) {
    for (auto& b : enc_blocks_[l]) h = b(h);                    // [B, ch*m_l, S/2^l, S/2^l]
    if (l < down_.size())                                       // pad right and bottom by one, then stride 2:
      h = down_[l](torch::constant_pad_nd(h, {0, 1, 0, 1}));    // [B, ch*m_l, S/2^(l+1), S/2^(l+1)]
  }
  h = run_middle(enc_mid_, h);                                  // [B, ch*m_last, S/f, S/f]
  h = quant_(enc_out_(group_norm_silu(enc_norm_, h)));          // [B, 2z, S/f, S/f]
  auto parts = h.chunk(2, 1);                                   // 2 x [B, z, S/f, S/f]
  return {parts[0], parts[1].clamp(-30.0, 20.0)};
}

torch::Tensor AutoencoderImpl::forward(const torch::Tensor& x, const torch::Tensor&, const Cond&) {
  return decode(encode(x).mean);  // [B, C, S, S]
}

torch::Tensor AutoencoderImpl::decode(const torch::Tensor& z) {
  const auto& s = shape_;
  DDM_CHECK(z.dim() == 4 && z.size(1) == s.latent_channels && z.size(2) == s.latent_size() &&
                z.size(3) == s.latent_size(),
            "autoencoder: expected latents [B, " << s.latent_channels << ", " << s.latent_size() << ", "
                                                 << s.latent_size() << "], got " << z.sizes());
  auto h = dec_in_(post_quant_(z));                             // [B, ch*m_last, S/f, S/f]
  h = run_middle(dec_mid_, h);                                  // [B, ch*m_last, S/f, S/f]
  for (size_t i = 0; i < dec_blocks_.size(); ++i) {
    for (auto& b : dec_blocks_[i]) h = b(h);                    // [B, ch*m_l, S/2^l, S/2^l], l = L-1-i
    if (i < up_.size())
      h = up_[i](torch::upsample_nearest2d(h, {2 * h.size(2), 2 * h.size(3)}));  // [B, ch*m_l, S/2^(l-1), S/2^(l-1)]
  }
  return dec_out_(group_norm_silu(dec_norm_, h));               // [B, C, S, S]
}

namespace {

double resnet_flops(int64_t in, int64_t out, int64_t hw) {
  return flops::conv2d(in, out, 3, hw, hw) + flops::conv2d(out, out, 3, hw, hw) +
         (in != out ? flops::conv2d(in, out, 1, hw, hw) : 0.0);
}

double middle_flops(const AutoencoderShape& s, int64_t ch, int64_t hw) {
  double f = 2 * resnet_flops(ch, ch, hw);
  if (s.mid_attention)  // qkv (ch -> 3ch) and proj (ch -> ch) 1x1 convolutions, and the attention matmuls
    f += 4 * flops::conv2d(ch, ch, 1, hw, hw) + flops::attention(hw * hw, ch);
  return f;
}

}  // namespace

double encoder_flops_per_image(const AutoencoderShape& s) {
  validate_autoencoder(s);
  const int64_t z = s.latent_channels;
  int64_t hw = s.image_size, cur = level_ch(s, 0);
  double f = flops::conv2d(s.in_channels, cur, 3, hw, hw);
  for (size_t l = 0; l < s.channel_mult.size(); ++l) {
    for (int64_t j = 0; j < s.res_blocks; ++j) {
      f += resnet_flops(cur, level_ch(s, l), hw);
      cur = level_ch(s, l);
    }
    if (l + 1 < s.channel_mult.size()) {
      hw /= 2;
      f += flops::conv2d(cur, cur, 3, hw, hw);
    }
  }
  return f + middle_flops(s, cur, hw) + flops::conv2d(cur, 2 * z, 3, hw, hw) + flops::conv2d(2 * z, 2 * z, 1, hw, hw);
}

double decoder_flops_per_image(const AutoencoderShape& s) {
  validate_autoencoder(s);
  const int64_t z = s.latent_channels;
  const size_t L = s.channel_mult.size();
  int64_t hw = s.latent_size(), cur = level_ch(s, L - 1);
  double f = flops::conv2d(z, z, 1, hw, hw) + flops::conv2d(z, cur, 3, hw, hw) + middle_flops(s, cur, hw);
  for (size_t i = 0; i < L; ++i) {
    const size_t l = L - 1 - i;
    for (int64_t j = 0; j <= s.res_blocks; ++j) {
      f += resnet_flops(cur, level_ch(s, l), hw);
      cur = level_ch(s, l);
    }
    if (l > 0) {
      hw *= 2;
      f += flops::conv2d(cur, cur, 3, hw, hw);
    }
  }
  return f + flops::conv2d(cur, s.in_channels, 3, hw, hw);
}

}  // namespace ddm
