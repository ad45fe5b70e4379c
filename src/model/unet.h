// Class-conditional U-Net backbone (DDPM / ADM family, sized for small images).
//
// Levels l = 0..L-1 (L = channel_mult.size()) run at resolution image_size / 2^l with
// channels * channel_mult[l] channels. Layout, mirrored around the lowest level:
//   in_conv 3x3
//   encoder, l = 0..L-2: res_blocks x (ResBlock [+ attention]) each pushing a skip; conv 3x3 stride 2
//   bottleneck, l = L-1: res_blocks x (ResBlock [+ attention])
//   decoder, l = L-2..0: nearest x2 upsample + conv 3x3 to the level's channels (cheaper at full
//                        resolution than keeping the coarser level's width); res_blocks x
//                        (concat skip, ResBlock [+ attention])
//   out: GroupNorm, SiLU, conv 3x3 (zero-initialized, so the net outputs exactly 0 at init)
// Attention is added at the levels listed in attn_levels, with cfg.heads heads; with text
// conditioning (text_dim > 0) it is SD's transformer there instead (self-attention, cross-attention
// on Cond::context, feed-forward: model/text_layers.h). Conditioning: emb = TimeEmbedder(t)
// (+ LabelEmbedder(y) when num_classes > 0, + Linear(Cond::pooled) when text_pooled_dim > 0),
// emb_dim = 4 * channels; each ResBlock turns SiLU(emb) into a GroupNorm scale/shift.
//
// A ControlNet (model/controlnet.h) splits the U-Net at its middle: encode (in_conv, encoder and
// bottleneck) and decode (decoder and out), with residuals added to every skip feature and to the
// bottleneck's output in between; and builds a trainable copy of the encoder half alone.
#pragma once
#include <functional>
#include <vector>

#include "core/config.h"
#include "model/layers.h"
#include "model/net.h"
#include "model/text_layers.h"

namespace ddm {

class UNetImpl : public NetImpl {
 public:
  // cfg must be validated (make_net does it): throws ddm::Error on invalid shapes.
  // encoder_only: in_conv, encoder and bottleneck only (a ControlNet's trainable copy); such a net
  // has no forward, only encode.
  explicit UNetImpl(const ModelConfig& cfg, bool encoder_only = false);
  // Adds c.residuals (when given) to the skips and the bottleneck: decode(encode(x, t, c), c.residuals).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;

  // The encoder half's outputs.
  struct Features {
    torch::Tensor emb_act;             // SiLU(time + label embedding) [B, E]
    std::vector<torch::Tensor> skips;  // in push order: skips[i] [B, skip_channels()[i], S_l, S_l]
    torch::Tensor h;                   // the bottleneck's output [B, c_{L-1}, S_{L-1}, S_{L-1}]
    Cond text{};                       // the text conditioning the decoder attends to (context, mask)
  };
  // x [B, C, S, S], t [B], c.y [B] (and c.self_cond under model.self_cond); in_add (optional)
  // [B, c0, S, S] is added to in_conv's output (a ControlNet's control features).
  Features encode(const torch::Tensor& x, const torch::Tensor& t, const Cond& c, const torch::Tensor& in_add = {});
  // The decoder on f, adding residuals[i] to skip i and residuals.back() to h when residuals is not
  // empty (then it has skips.size() + 1 entries shaped like them). Returns [B, C, S, S].
  torch::Tensor decode(Features f, const std::vector<torch::Tensor>& residuals = {});
  // The channels of each skip feature in push order, and of the bottleneck's output.
  const std::vector<int64_t>& skip_channels() const { return skip_channels_; }
  int64_t mid_channels() const;
  const ModelConfig& config() const { return cfg_; }
  bool self_conditioned() const override { return cfg_.self_cond; }
  // in (embedding + in_conv), enc{l}_{j}, down{l}, mid{j}, up{l}, dec{l}_{j}, out.
  std::vector<NetUnit> units() override;
  // The encoder half's units (in .. mid; in_add(c), when given, is added to in_conv's output, as
  // encode's in_add) and the decoder half's (up .. out).
  std::vector<NetUnit> encoder_units(std::function<torch::Tensor(const Cond&)> in_add = {});
  std::vector<NetUnit> decoder_units();

 private:
  struct Stage {  // one ResBlock and its optional attention: self-attention, or SD's transformer with text
    ResBlock res{nullptr};
    AttentionBlock attn{nullptr};
    SpatialTransformer xattn{nullptr};
  };
  torch::Tensor run(Stage& s, const torch::Tensor& h, const torch::Tensor& emb_act, const Cond& c);
  // The units' bodies (see units()); encode and decode are made of them.
  void unit_in(NetCarry& k, const torch::Tensor& t, const Cond& c, const torch::Tensor& in_add = {});
  void unit_enc(NetCarry& k, size_t l, size_t j, const Cond& c);
  void unit_down(NetCarry& k, size_t l);
  void unit_mid(NetCarry& k, size_t j, const Cond& c);
  void unit_up(NetCarry& k, size_t l);
  void unit_dec(NetCarry& k, size_t l, size_t j, const Cond& c);
  void unit_out(NetCarry& k);

  ModelConfig cfg_;
  TimeEmbedder time_{nullptr};
  LabelEmbedder label_{nullptr};
  EmbedProjector embed_{nullptr};  // model.embed
  torch::nn::Linear pooled_{nullptr};  // the text's pooled embedding (model.text_pooled_dim)
  torch::nn::Conv2d in_conv_{nullptr}, out_conv_{nullptr};
  torch::nn::GroupNorm out_norm_{nullptr};
  std::vector<std::vector<Stage>> enc_;  // [L-1][res_blocks]
  std::vector<torch::nn::Conv2d> down_;  // [L-1]
  std::vector<Stage> mid_;               // [res_blocks]
  std::vector<torch::nn::Conv2d> up_;    // [L-1], up_[l] brings level l+1 to level l
  std::vector<std::vector<Stage>> dec_;  // [L-1][res_blocks]
  std::vector<int64_t> skip_channels_;
  bool encoder_only_ = false;
};

// Throws ddm::Error naming model.KEY if cfg is not a valid U-Net configuration.
void validate_unet(const ModelConfig& cfg);
// Analytic forward FLOPs per image of the U-Net described by cfg (see net.h for the rule); of its
// encoder half alone (in_conv, encoder, bottleneck) with encoder_only.
double unet_forward_flops(const ModelConfig& cfg, bool encoder_only = false);

}  // namespace ddm
