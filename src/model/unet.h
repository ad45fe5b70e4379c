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
// Attention is added at the levels listed in attn_levels, with cfg.heads heads. Conditioning:
// emb = TimeEmbedder(t) (+ LabelEmbedder(y) when num_classes > 0), emb_dim = 4 * channels; each
// ResBlock turns SiLU(emb) into a GroupNorm scale/shift.
#pragma once
#include <vector>

#include "core/config.h"
#include "model/layers.h"
#include "model/net.h"

namespace ddm {

class UNetImpl : public NetImpl {
 public:
  // cfg must be validated (make_net does it): throws ddm::Error on invalid shapes.
  explicit UNetImpl(const ModelConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) override;

 private:
  struct Stage {  // one ResBlock and its optional attention
    ResBlock res{nullptr};
    AttentionBlock attn{nullptr};
  };
  torch::Tensor run(Stage& s, const torch::Tensor& h, const torch::Tensor& emb_act);

  ModelConfig cfg_;
  TimeEmbedder time_{nullptr};
  LabelEmbedder label_{nullptr};
  torch::nn::Conv2d in_conv_{nullptr}, out_conv_{nullptr};
  torch::nn::GroupNorm out_norm_{nullptr};
  std::vector<std::vector<Stage>> enc_;  // [L-1][res_blocks]
  std::vector<torch::nn::Conv2d> down_;  // [L-1]
  std::vector<Stage> mid_;               // [res_blocks]
  std::vector<torch::nn::Conv2d> up_;    // [L-1], up_[l] brings level l+1 to level l
  std::vector<std::vector<Stage>> dec_;  // [L-1][res_blocks]
};

// Throws ddm::Error naming model.KEY if cfg is not a valid U-Net configuration.
void validate_unet(const ModelConfig& cfg);
// Analytic forward FLOPs per image of the U-Net described by cfg (see net.h for the rule).
double unet_forward_flops(const ModelConfig& cfg);

}  // namespace ddm
