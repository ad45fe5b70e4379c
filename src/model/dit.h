// DiT backbone (Peebles & Xie 2023, "Scalable Diffusion Models with Transformers"), for small
// images:
//   tokens = Linear(patchify(x, patch)) + fixed 2-D sin-cos position embedding   [B, N, width]
//   c = TimeEmbedder(t) (+ LabelEmbedder(y) when num_classes > 0)                [B, width]
//       (+ Linear(Cond::pooled) when text_pooled_dim > 0)
//   depth x DiTBlock(tokens, SiLU(c))  (adaLN-Zero; one fused qkv and one modulation linear each;
//       with text_dim > 0 each also attends to Cond::context after its self-attention, as PixArt-α)
//   DiTFinalLayer (adaLN + zero-initialized linear) -> unpatchify                [B, C, H, W]
// The linear patch embedding equals a Conv2d(C, width, patch, stride patch). With the zero
// initialization the network outputs exactly 0 at init.
#pragma once
#include <vector>

#include "core/config.h"
#include "model/layers.h"
#include "model/net.h"

namespace ddm {

class DiTImpl : public NetImpl {
 public:
  // Throws ddm::Error on invalid shapes (image_size % patch, width % heads, width % 4).
  explicit DiTImpl(const ModelConfig& cfg);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) override;
  bool self_conditioned() const override { return cfg_.self_cond; }
  // in (patch, position and conditioning embeddings), block{i}, out (final layer + unpatchify).
  std::vector<NetUnit> units() override;

  // Access for tests (e.g. re-initializing the modulation linears).
  std::vector<DiTBlock>& blocks() { return blocks_; }

 private:
  void unit_in(NetCarry& k, const torch::Tensor& t, const Cond& c);
  void unit_out(NetCarry& k);

  ModelConfig cfg_;
  torch::nn::Linear patch_embed_{nullptr};
  EmbedProjector embed_{nullptr};  // model.embed
  torch::Tensor pos_;  // buffer [1, N, width], fixed
  TimeEmbedder time_{nullptr};
  LabelEmbedder label_{nullptr};
  torch::nn::Linear pooled_{nullptr};  // the text's pooled embedding (model.text_pooled_dim)
  std::vector<DiTBlock> blocks_;
  DiTFinalLayer final_{nullptr};
};

// Sinusoidal features fed to the DiT time MLP (as in DiT).
constexpr int64_t kTimeFreqDim = 256;

// DiT's initialization of every submodule of root: Xavier-uniform linears with zero bias, N(0, 0.02)
// for linears under "time." and for embedding tables; linears named "*.ada" and "final.linear" are
// left alone (zero-initialized by their constructors: adaLN-Zero).
void init_dit_weights(torch::nn::Module& root);
// Throws ddm::Error naming model.KEY if cfg is not a valid DiT configuration.
void validate_dit(const ModelConfig& cfg);
// Analytic forward FLOPs per image of the DiT described by cfg (see flops.h for the rule).
double dit_forward_flops(const ModelConfig& cfg);
// Hidden width of the DiT MLP: round(width * mlp_ratio).
int64_t dit_mlp_hidden(const ModelConfig& cfg);

}  // namespace ddm
