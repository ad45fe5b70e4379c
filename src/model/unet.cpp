// Class-conditional U-Net backbone (see unet.h).
#include "model/unet.h"

#include <algorithm>
#include <string>

#include <torch/torch.h>

#include "core/error.h"
#include "model/flops.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

namespace {

int64_t level_channels(const ModelConfig& cfg, size_t l) { return cfg.channels * cfg.channel_mult[l]; }

bool has_attn(const ModelConfig& cfg, size_t l) {
  return std::find(cfg.attn_levels.begin(), cfg.attn_levels.end(), static_cast<int64_t>(l)) !=
         cfg.attn_levels.end();
}

// t in channels-last order where the U-Net runs so on t's device (ops.h), else t as it is; a no-op on
// a tensor already in that order. Every unit applies it to what it reads, so that a pipeline stage,
// whose carry arrives from the wire in NCHW order, runs channels-last too.
torch::Tensor in_order(const torch::Tensor& t) {
  return t.dim() == 4 && channels_last_enabled(t.device()) ? t.contiguous(at::MemoryFormat::ChannelsLast) : t;
}

}  // namespace

void validate_unet(const ModelConfig& cfg) {
  DDM_CHECK(cfg.channels > 0, "model.channels must be > 0, got " << cfg.channels);
  DDM_CHECK(!cfg.channel_mult.empty(), "model.channel_mult must list at least one level, got []");
  for (auto m : cfg.channel_mult)
    DDM_CHECK(m > 0, "model.channel_mult entries must be > 0, got " << m);
  DDM_CHECK(cfg.res_blocks >= 1, "model.res_blocks must be >= 1, got " << cfg.res_blocks);
  DDM_CHECK(cfg.groups > 0, "model.groups must be > 0, got " << cfg.groups);
  const auto levels = static_cast<int64_t>(cfg.channel_mult.size());
  for (size_t l = 0; l < cfg.channel_mult.size(); ++l) {
    const int64_t ch = level_channels(cfg, l);
    DDM_CHECK(ch % cfg.groups == 0, "model.groups = " << cfg.groups << " does not divide the "
                                    << ch << " channels of level " << l
                                    << " (model.channels * model.channel_mult[" << l << "])");
    if (has_attn(cfg, l))
      DDM_CHECK(cfg.heads > 0 && ch % cfg.heads == 0,
                "model.heads = " << cfg.heads << " does not divide the " << ch
                                 << " channels of attention level " << l);
  }
  for (auto a : cfg.attn_levels)
    DDM_CHECK(a >= 0 && a < levels, "model.attn_levels entry " << a << " is out of range [0, "
                                    << levels << ") for " << levels << " levels");
  const int64_t factor = int64_t{1} << (levels - 1);
  DDM_CHECK(cfg.image_size % factor == 0,
            "model.image_size = " << cfg.image_size << " is not divisible by 2^(levels-1) = " << factor
                                  << " needed by the U-Net's " << levels - 1
                                  << " downsamplings; change model.image_size or model.channel_mult");
}

UNetImpl::UNetImpl(const ModelConfig& cfg, bool encoder_only) : cfg_(cfg), encoder_only_(encoder_only) {
  validate_unet(cfg);
  const size_t L = cfg.channel_mult.size();
  const int64_t emb_dim = 4 * cfg.channels;
  time_ = register_module("time", TimeEmbedder(cfg.channels, emb_dim));
  if (cfg.num_classes > 0) label_ = register_module("label", LabelEmbedder(cfg.num_classes, emb_dim));
  if (cfg.embed_dim > 0) embed_ = register_module("embed", EmbedProjector(cfg.embed_dim, emb_dim));
  if (cfg.text_pooled_dim > 0) pooled_ = register_module("pooled", nn::Linear(cfg.text_pooled_dim, emb_dim));

  auto make_stage = [&](const std::string& name, int64_t in, int64_t out, size_t l) {
    Stage s;
    s.res = register_module(name, ResBlock(in, out, emb_dim, cfg.groups));
    if (has_attn(cfg, l) && cfg.text_dim > 0)
      s.xattn = register_module(name + "_xattn", SpatialTransformer(out, cfg.text_dim, cfg.heads, cfg.groups));
    else if (has_attn(cfg, l))
      s.attn = register_module(name + "_attn", AttentionBlock(out, cfg.heads, cfg.groups));
    return s;
  };
  auto conv3 = [](int64_t in, int64_t out, int64_t stride) {
    return nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1));
  };

  int64_t cur = level_channels(cfg, 0);
  in_conv_ = register_module("in_conv", conv3(cfg.in_channels * (cfg.self_cond ? 2 : 1), cur, 1));
  std::vector<std::vector<int64_t>> skip_ch(L);
  for (size_t l = 0; l + 1 < L; ++l) {
    const int64_t ch = level_channels(cfg, l);
    enc_.emplace_back();
    for (int64_t j = 0; j < cfg.res_blocks; ++j) {
      enc_[l].push_back(make_stage("enc" + std::to_string(l) + "_" + std::to_string(j), cur, ch, l));
      cur = ch;
      skip_ch[l].push_back(ch);
      skip_channels_.push_back(ch);
    }
    down_.push_back(register_module("down" + std::to_string(l), conv3(ch, ch, 2)));
  }
  for (int64_t j = 0; j < cfg.res_blocks; ++j) {
    const int64_t ch = level_channels(cfg, L - 1);
    mid_.push_back(make_stage("mid_" + std::to_string(j), cur, ch, L - 1));
    cur = ch;
  }
  if (encoder_only) return;
  up_.assign(L - 1, nn::Conv2d(nullptr));
  dec_.resize(L - 1);
  for (size_t l = L - 1; l-- > 0;) {
    const int64_t ch = level_channels(cfg, l);
    up_[l] = register_module("up" + std::to_string(l), conv3(cur, ch, 1));
    cur = ch;
    for (int64_t j = 0; j < cfg.res_blocks; ++j) {
      const int64_t skip = skip_ch[l][cfg.res_blocks - 1 - j];
      dec_[l].push_back(make_stage("dec" + std::to_string(l) + "_" + std::to_string(j), cur + skip, ch, l));
      cur = ch;
    }
  }
  out_norm_ = register_module("out_norm", nn::GroupNorm(cfg.groups, cur));
  out_conv_ = register_module("out_conv", conv3(cur, cfg.in_channels, 1));
  zero_init(*out_conv_);
}

torch::Tensor UNetImpl::run(Stage& s, const torch::Tensor& h, const torch::Tensor& emb_act, const Cond& c) {
  auto out = s.res->forward(h, emb_act);                                          // [B, ch, H, W]
  if (s.xattn) return s.xattn->forward(out, c.context, c.context_mask);           // [B, ch, H, W]
  return s.attn ? s.attn->forward(out) : out;                                     // [B, ch, H, W]
}

int64_t UNetImpl::mid_channels() const { return level_channels(cfg_, cfg_.channel_mult.size() - 1); }

// The units, each a piece of forward on the carry k (h, emb = SiLU(embedding), open skips); encode,
// decode and units() all run these, so a pipeline of units computes exactly forward.
void UNetImpl::unit_in(NetCarry& k, const torch::Tensor& t, const Cond& c, const torch::Tensor& in_add) {
  const torch::Tensor x = k.h;
  DDM_CHECK(x.dim() == 4 && x.size(1) == cfg_.in_channels && x.size(2) == cfg_.image_size &&
                x.size(3) == cfg_.image_size,
            "UNet: expected x [B, " << cfg_.in_channels << ", " << cfg_.image_size << ", "
                                    << cfg_.image_size << "], got " << x.sizes());
  auto emb = time_(t);                                           // [B, E]
  if (label_) {
    DDM_CHECK(c.y.defined(), "UNet: class labels y are required (model.num_classes = " << cfg_.num_classes << ")");
    emb = emb + label_(c.y);                                     // [B, E]
  }
  if (embed_) emb = emb + embed_(c, x.size(0));                  // [B, E]
  check_text_cond(c, x.size(0), cfg_, "UNet");
  if (pooled_) emb = emb + apply_linear(pooled_, c.pooled);      // [B, E]
  k.emb = torch::silu(emb);                                      // [B, E]
  k.h = in_conv_(with_self_cond(x, c, cfg_.self_cond));         // [B, c0, S, S]
  if (in_add.defined()) k.h = k.h + in_add;                      // [B, c0, S, S]
  // The activations in channels-last order from here to unit_out where enabled (ops.h): convolutions,
  // GroupNorm, the elementwise ops, the skips' concatenation and the upsampling keep it.
  k.h = in_order(k.h);                                           // [B, c0, S, S]
}

void UNetImpl::unit_enc(NetCarry& k, size_t l, size_t j, const Cond& c) {
  k.h = run(enc_[l][j], in_order(k.h), k.emb, c);                  // [B, c_l, S_l, S_l]
  k.skips.push_back(k.h);
}

void UNetImpl::unit_down(NetCarry& k, size_t l) { k.h = down_[l](in_order(k.h)); }  // [B, c_l, S_l / 2, S_l / 2]

void UNetImpl::unit_mid(NetCarry& k, size_t j, const Cond& c) {
  k.h = run(mid_[j], in_order(k.h), k.emb, c);                   // [B, c_{L-1}, S_{L-1}, S_{L-1}]
}

void UNetImpl::unit_up(NetCarry& k, size_t l) {
  k.h = torch::upsample_nearest2d(in_order(k.h), {k.h.size(2) * 2, k.h.size(3) * 2});  // [B, c_{l+1}, S_l, S_l]
  k.h = up_[l](k.h);                                             // [B, c_l, S_l, S_l]
}

void UNetImpl::unit_dec(NetCarry& k, size_t l, size_t j, const Cond& c) {
  k.h = torch::cat({in_order(k.h), in_order(k.skips.back())}, 1);  // [B, c + c_l, S_l, S_l]
  k.skips.pop_back();
  k.h = run(dec_[l][j], k.h, k.emb, c);                             // [B, c_l, S_l, S_l]
}

void UNetImpl::unit_out(NetCarry& k) {
  k.h = out_conv_(group_norm_silu(out_norm_, in_order(k.h))).contiguous();  // [B, C, S, S], in NCHW order again
  k.emb = torch::Tensor();
}

UNetImpl::Features UNetImpl::encode(const torch::Tensor& x, const torch::Tensor& t, const Cond& c,
                                    const torch::Tensor& in_add) {
  NetCarry k{x, {}, {}};
  unit_in(k, t, c, in_add);
  for (size_t l = 0; l < enc_.size(); ++l) {
    for (size_t j = 0; j < enc_[l].size(); ++j) unit_enc(k, l, j, c);
    unit_down(k, l);
  }
  for (size_t j = 0; j < mid_.size(); ++j) unit_mid(k, j, c);
  Cond text;
  text.context = c.context;
  text.context_mask = c.context_mask;
  return Features{k.emb, std::move(k.skips), k.h, std::move(text)};
}

torch::Tensor UNetImpl::decode(Features f, const std::vector<torch::Tensor>& residuals) {
  DDM_CHECK(!encoder_only_, "UNet: an encoder-only U-Net (a ControlNet's copy) has no decoder");
  if (!residuals.empty()) {
    DDM_CHECK(residuals.size() == f.skips.size() + 1,
              "UNet: " << residuals.size() << " control residuals for " << f.skips.size() << " skips + the middle");
    for (size_t i = 0; i < f.skips.size(); ++i) f.skips[i] = f.skips[i] + residuals[i];  // [B, c_l, S_l, S_l]
    f.h = f.h + residuals.back();                                // [B, c_{L-1}, S_{L-1}, S_{L-1}]
  }
  NetCarry k{f.h, f.emb_act, std::move(f.skips)};
  for (size_t l = dec_.size(); l-- > 0;) {
    unit_up(k, l);
    for (size_t j = 0; j < dec_[l].size(); ++j) unit_dec(k, l, j, f.text);
  }
  unit_out(k);
  return k.h;                                                    // [B, C, S, S]
}

torch::Tensor UNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  return decode(encode(x, t, c), c.residuals);  // [B, C, S, S]
}

std::vector<NetUnit> UNetImpl::encoder_units(std::function<torch::Tensor(const Cond&)> in_add) {
  auto mod = [](const auto& holder) -> const torch::nn::Module* { return holder.is_empty() ? nullptr : holder.get(); };
  auto params = [](std::initializer_list<const torch::nn::Module*> ms) {
    std::vector<torch::Tensor> out;
    for (const torch::nn::Module* m : ms)
      if (m)
        for (const torch::Tensor& p : m->parameters()) out.push_back(p);
    return out;
  };
  std::vector<NetUnit> u;
  u.push_back({"in", [this, in_add](NetCarry& k, const torch::Tensor& t, const Cond& c) {
                 DDM_CHECK(c.residuals.empty(), "UNet: a pipeline stage takes no ControlNet residuals");
                 unit_in(k, t, c, in_add ? in_add(c) : torch::Tensor());
               },
               params({mod(time_), mod(label_), mod(embed_), mod(pooled_), mod(in_conv_)})});
  auto add = [&](std::string name, std::function<void(NetCarry&, const Cond&)> f, std::vector<torch::Tensor> p) {
    u.push_back({std::move(name), [f](NetCarry& k, const torch::Tensor&, const Cond& c) { f(k, c); }, std::move(p)});
  };
  for (size_t l = 0; l < enc_.size(); ++l) {
    for (size_t j = 0; j < enc_[l].size(); ++j)
      add("enc" + std::to_string(l) + "_" + std::to_string(j), [this, l, j](NetCarry& k, const Cond& c) { unit_enc(k, l, j, c); },
          params({mod(enc_[l][j].res), mod(enc_[l][j].attn), mod(enc_[l][j].xattn)}));
    add("down" + std::to_string(l), [this, l](NetCarry& k, const Cond&) { unit_down(k, l); }, params({mod(down_[l])}));
  }
  for (size_t j = 0; j < mid_.size(); ++j)
    add("mid" + std::to_string(j), [this, j](NetCarry& k, const Cond& c) { unit_mid(k, j, c); },
        params({mod(mid_[j].res), mod(mid_[j].attn), mod(mid_[j].xattn)}));
  return u;
}

std::vector<NetUnit> UNetImpl::decoder_units() {
  DDM_CHECK(!encoder_only_, "UNet: an encoder-only U-Net (a ControlNet's copy) has no decoder units");
  auto mod = [](const auto& holder) -> const torch::nn::Module* { return holder.is_empty() ? nullptr : holder.get(); };
  auto params = [](std::initializer_list<const torch::nn::Module*> ms) {
    std::vector<torch::Tensor> out;
    for (const torch::nn::Module* m : ms)
      if (m)
        for (const torch::Tensor& p : m->parameters()) out.push_back(p);
    return out;
  };
  std::vector<NetUnit> u;
  auto add = [&](std::string name, std::function<void(NetCarry&, const Cond&)> f, std::vector<torch::Tensor> p) {
    u.push_back({std::move(name), [f](NetCarry& k, const torch::Tensor&, const Cond& c) { f(k, c); }, std::move(p)});
  };
  for (size_t l = dec_.size(); l-- > 0;) {
    add("up" + std::to_string(l), [this, l](NetCarry& k, const Cond&) { unit_up(k, l); }, params({mod(up_[l])}));
    for (size_t j = 0; j < dec_[l].size(); ++j)
      add("dec" + std::to_string(l) + "_" + std::to_string(j), [this, l, j](NetCarry& k, const Cond& c) { unit_dec(k, l, j, c); },
          params({mod(dec_[l][j].res), mod(dec_[l][j].attn), mod(dec_[l][j].xattn)}));
  }
  add("out", [this](NetCarry& k, const Cond&) { unit_out(k); }, params({mod(out_norm_), mod(out_conv_)}));
  return u;
}

std::vector<NetUnit> UNetImpl::units() {
  DDM_CHECK(!encoder_only_, "UNet: an encoder-only U-Net (a ControlNet's copy) cannot be split into pipeline stages");
  std::vector<NetUnit> u = encoder_units();
  for (NetUnit& d : decoder_units()) u.push_back(std::move(d));
  return u;
}

double unet_forward_flops(const ModelConfig& cfg, bool encoder_only) {
  validate_unet(cfg);
  const size_t L = cfg.channel_mult.size();
  const int64_t E = 4 * cfg.channels;
  auto res = [&](int64_t in, int64_t out, int64_t s) {
    double f = flops::conv2d(in, out, 3, s, s) + flops::linear(E, 2 * out) + flops::conv2d(out, out, 3, s, s);
    if (in != out) f += flops::conv2d(in, out, 1, s, s);
    return f;
  };
  auto attn = [&](int64_t c, int64_t s) {
    return flops::conv2d(c, 3 * c, 1, s, s) + flops::attention(s * s, c) + flops::conv2d(c, c, 1, s, s);
  };
  // SD's transformer (text_layers.h): projections in and out, self-attention, cross-attention on T
  // tokens of width D, and the GEGLU feed-forward (c -> 8c, 4c -> c).
  auto xattn = [&](int64_t c, int64_t s) {
    const int64_t n = s * s, T = cfg.text_tokens;
    return flops::linear(c, c, n) * 2 + flops::linear(c, 3 * c, n) + flops::attention(n, c) + flops::linear(c, c, n) +
           flops::linear(c, c, n) * 2 + flops::linear(cfg.text_dim, c, T) * 2 + flops::cross_attention(n, T, c) +
           flops::linear(c, 8 * c, n) + flops::linear(4 * c, c, n);
  };
  auto stage = [&](int64_t in, int64_t out, int64_t s, size_t l) {
    return res(in, out, s) + (has_attn(cfg, l) ? (cfg.text_dim > 0 ? xattn(out, s) : attn(out, s)) : 0.0);
  };
  double f = flops::linear(cfg.channels, E) + flops::linear(E, E);  // time MLP
  if (cfg.text_pooled_dim > 0) f += flops::linear(cfg.text_pooled_dim, E);
  int64_t s = cfg.image_size, cur = level_channels(cfg, 0);
  f += flops::conv2d(cfg.in_channels * (cfg.self_cond ? 2 : 1), cur, 3, s, s);
  for (size_t l = 0; l + 1 < L; ++l) {
    const int64_t ch = level_channels(cfg, l);
    for (int64_t j = 0; j < cfg.res_blocks; ++j, cur = ch) f += stage(cur, ch, s, l);
    s /= 2;
    f += flops::conv2d(ch, ch, 3, s, s);
  }
  for (int64_t j = 0; j < cfg.res_blocks; ++j, cur = level_channels(cfg, L - 1))
    f += stage(cur, level_channels(cfg, L - 1), s, L - 1);
  if (encoder_only) return f;
  for (size_t l = L - 1; l-- > 0;) {
    s *= 2;
    const int64_t ch = level_channels(cfg, l);
    f += flops::conv2d(cur, ch, 3, s, s);
    cur = ch;
    for (int64_t j = 0; j < cfg.res_blocks; ++j, cur = ch) f += stage(cur + ch, ch, s, l);
  }
  f += flops::conv2d(cur, cfg.in_channels, 3, s, s);
  return f;
}

}  // namespace ddm
