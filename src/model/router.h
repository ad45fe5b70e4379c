// Routers for decentralized diffusion (docs/decentralized.md, "Router"): classifiers that predict
// which data cluster a noisy sample x_t came from, p(k | x_t, t, y), conditioned on the noise level
// and the class exactly like the experts. They implement the Net interface (same forward signature,
// so the trainer, checkpoints and EMA serve them unchanged) but return logits [B, K] instead of an
// image; K = model.num_experts.
// A text model's router is conditioned on the prompt as well, p(k | x_t, t, c) (the posterior the
// ensemble needs is that of the experts' own condition): the text encoder's pooled embedding through a
// linear into the (t, y) embedding, as the experts take it (no cross-attention: a router is small).
//   router-dit   DiT tokens plus a learned CLS token (no position embedding); adaLN-Zero blocks
//                conditioned on (t, y); LayerNorm of the CLS token -> Linear(width, K) (the paper's
//                router, small)
//   router-conv  patch-embedding conv (kernel = stride = model.patch), then per level of
//                model.channel_mult model.res_blocks residual blocks with (t, y) modulation and a
//                stride-2 conv between levels; GroupNorm, SiLU, global average pool -> Linear(ch, K)
// The output linear is zero-initialized, so an untrained router predicts the uniform distribution.
#pragma once
#include <string>
#include <vector>

#include "core/config.h"
#include "model/layers.h"
#include "model/net.h"

namespace ddm {

// True for the model.arch values that build routers (router-dit, router-conv).
bool is_router_arch(const std::string& arch);

class RouterDiTImpl : public NetImpl {
 public:
  explicit RouterDiTImpl(const ModelConfig& cfg);
  // x [B, C, S, S], t [B], y [B] -> logits [B, num_experts]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;

 private:
  ModelConfig cfg_;
  torch::nn::Linear patch_embed_{nullptr}, head_{nullptr};
  torch::Tensor pos_, cls_;  // buffer [1, N, W] fixed; parameter [1, 1, W] learned
  TimeEmbedder time_{nullptr};
  LabelEmbedder label_{nullptr};
  torch::nn::Linear pooled_{nullptr};  // text: the pooled embedding into the conditioning
  std::vector<DiTBlock> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
};

class RouterConvImpl : public NetImpl {
 public:
  explicit RouterConvImpl(const ModelConfig& cfg);
  // x [B, C, S, S], t [B], y [B] -> logits [B, num_experts]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;

 private:
  ModelConfig cfg_;
  torch::nn::Conv2d stem_{nullptr};
  std::vector<std::vector<ResBlock>> levels_;
  std::vector<torch::nn::Conv2d> down_;
  torch::nn::GroupNorm norm_{nullptr};
  TimeEmbedder time_{nullptr};
  LabelEmbedder label_{nullptr};
  torch::nn::Linear pooled_{nullptr};  // text: the pooled embedding into the conditioning
  torch::nn::Linear head_{nullptr};
};

// Throws ddm::Error naming model.KEY if cfg is not a valid router configuration.
void validate_router(const ModelConfig& cfg);
// Analytic forward FLOPs per image (see flops.h for the rule).
double router_forward_flops(const ModelConfig& cfg);

}  // namespace ddm
