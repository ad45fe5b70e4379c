// DiT backbone (see dit.h).
#include "model/dit.h"

#include <cmath>
#include <string>

#include <torch/torch.h>

#include "core/error.h"
#include "model/flops.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

int64_t dit_mlp_hidden(const ModelConfig& cfg) {
  return static_cast<int64_t>(std::lround(static_cast<double>(cfg.width) * cfg.mlp_ratio));
}

void validate_dit(const ModelConfig& cfg) {
  DDM_CHECK(cfg.patch > 0, "model.patch must be > 0, got " << cfg.patch);
  DDM_CHECK(cfg.image_size % cfg.patch == 0,
            "model.image_size = " << cfg.image_size << " is not divisible by model.patch = " << cfg.patch
                                  << "; choose a patch size that divides the image size");
  DDM_CHECK(cfg.width > 0, "model.width must be > 0, got " << cfg.width);
  DDM_CHECK(cfg.depth >= 1, "model.depth must be >= 1, got " << cfg.depth);
  DDM_CHECK(cfg.heads > 0, "model.heads must be > 0, got " << cfg.heads);
  DDM_CHECK(cfg.width % cfg.heads == 0,
            "model.width = " << cfg.width << " is not divisible by model.heads = " << cfg.heads);
  DDM_CHECK(cfg.width % 4 == 0, "model.width = " << cfg.width
                                    << " must be a multiple of 4 (2-D sin-cos position embedding)");
  DDM_CHECK(std::isfinite(cfg.mlp_ratio) && cfg.mlp_ratio > 0 && dit_mlp_hidden(cfg) > 0,
            "model.mlp_ratio must be > 0 (and width * mlp_ratio >= 1), got " << cfg.mlp_ratio);
}

DiTImpl::DiTImpl(const ModelConfig& cfg) : cfg_(cfg) {
  validate_dit(cfg);
  const int64_t p = cfg.patch, W = cfg.width, grid = cfg.image_size / p;
  const int64_t in = cfg.in_channels * (cfg.self_cond ? 2 : 1);  // model.self_cond: x and the estimate
  patch_embed_ = register_module("patch_embed", nn::Linear(in * p * p, W));
  pos_ = register_buffer("pos", pos_embed_2d(W, grid).unsqueeze(0));  // [1, N, W]
  time_ = register_module("time", TimeEmbedder(kTimeFreqDim, W));
  if (cfg.num_classes > 0) label_ = register_module("label", LabelEmbedder(cfg.num_classes, W));
  if (cfg.embed_dim > 0) embed_ = register_module("embed", EmbedProjector(cfg.embed_dim, W));
  if (cfg.text_pooled_dim > 0) pooled_ = register_module("pooled", nn::Linear(cfg.text_pooled_dim, W));
  for (int64_t i = 0; i < cfg.depth; ++i)
    blocks_.push_back(register_module("block" + std::to_string(i), DiTBlock(W, cfg.heads, cfg.mlp_ratio, cfg.text_dim)));
  final_ = register_module("final", DiTFinalLayer(W, p * p * cfg.in_channels));

  init_dit_weights(*this);
}

void init_dit_weights(nn::Module& root) {
  // DiT's initialization: Xavier-uniform linears with zero bias, N(0, 0.02) for the time MLP and
  // the label table; the adaLN modulations and the output linear stay zero (adaLN-Zero), and so do
  // the cross-attentions' output linears (as PixArt-α's): a text block starts as DiT's.
  torch::NoGradGuard ng;
  for (auto& item : root.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const std::string& name = item.key();
    if (auto* lin = item.value()->as<nn::Linear>()) {
      if (ends_with(name, ".ada") || ends_with(name, ".cross.out") || name == "final.linear") continue;
      if (name.rfind("time.", 0) == 0) {
        nn::init::normal_(lin->weight, 0.0, 0.02);
      } else {
        nn::init::xavier_uniform_(lin->weight);
      }
      if (lin->bias.defined()) nn::init::zeros_(lin->bias);
    } else if (auto* emb = item.value()->as<nn::Embedding>()) {
      nn::init::normal_(emb->weight, 0.0, 0.02);
    }
  }
}

// The units: in (patch and conditioning embeddings), block{i}, out; forward runs them in order.
void DiTImpl::unit_in(NetCarry& k, const torch::Tensor& t, const Cond& cond) {
  const torch::Tensor x = k.h;
  const int64_t C = cfg_.in_channels, S = cfg_.image_size, p = cfg_.patch;
  DDM_CHECK(x.dim() == 4 && x.size(1) == C && x.size(2) == S && x.size(3) == S,
            "DiT: expected x [B, " << C << ", " << S << ", " << S << "], got " << x.sizes());
  const int64_t B = x.size(0), N = pos_.size(1);
  const auto xin = with_self_cond(x, cond, cfg_.self_cond);     // [B, C or 2C, S, S]
  auto tok = patchify(xin, p).reshape({B * N, xin.size(1) * p * p});  // [B N, C' p p]
  k.h = apply_linear(patch_embed_, tok).view({B, N, -1}) + pos_;               // [B, N, W]
  auto c = time_(t);                                             // [B, W]
  if (label_) {
    DDM_CHECK(cond.y.defined(), "DiT: class labels y are required (model.num_classes = " << cfg_.num_classes << ")");
    c = c + label_(cond.y);                                      // [B, W]
  }
  if (embed_) c = c + embed_(cond, B);                           // [B, W]
  check_text_cond(cond, B, cfg_, "DiT");
  if (pooled_) c = c + apply_linear(pooled_, cond.pooled);                    // [B, W]
  k.emb = torch::silu(c);                                        // [B, W]
}

void DiTImpl::unit_out(NetCarry& k) {
  const int64_t p = cfg_.patch;
  k.h = unpatchify(final_(k.h, k.emb), p, cfg_.in_channels, cfg_.image_size, cfg_.image_size);  // [B, C, S, S]
  k.emb = torch::Tensor();
}

torch::Tensor DiTImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& cond) {
  NetCarry k{x, {}, {}};
  unit_in(k, t, cond);                                           // h [B, N, W], emb [B, W]
  for (auto& block : blocks_) k.h = block->forward(k.h, k.emb, cond.context, cond.context_mask);  // [B, N, W]
  unit_out(k);
  return k.h;                                                    // [B, C, S, S]
}

std::vector<NetUnit> DiTImpl::units() {
  auto mod = [](const auto& holder) -> const torch::nn::Module* { return holder.is_empty() ? nullptr : holder.get(); };
  auto params = [](std::initializer_list<const torch::nn::Module*> ms) {
    std::vector<torch::Tensor> out;
    for (const torch::nn::Module* m : ms)
      if (m)
        for (const torch::Tensor& p : m->parameters()) out.push_back(p);
    return out;
  };
  std::vector<NetUnit> u;
  u.push_back({"in", [this](NetCarry& k, const torch::Tensor& t, const Cond& c) { unit_in(k, t, c); },
               params({mod(patch_embed_), mod(time_), mod(label_), mod(embed_), mod(pooled_)})});
  for (size_t i = 0; i < blocks_.size(); ++i)
    u.push_back({"block" + std::to_string(i),
                 [this, i](NetCarry& k, const torch::Tensor&, const Cond& c) {
                   k.h = blocks_[i]->forward(k.h, k.emb, c.context, c.context_mask);
                 },
                 params({mod(blocks_[i])})});
  u.push_back({"out", [this](NetCarry& k, const torch::Tensor&, const Cond&) { unit_out(k); }, params({mod(final_)})});
  return u;
}

double dit_forward_flops(const ModelConfig& cfg) {
  validate_dit(cfg);
  const int64_t p = cfg.patch, W = cfg.width, C = cfg.in_channels;
  const int64_t N = (cfg.image_size / p) * (cfg.image_size / p), hidden = dit_mlp_hidden(cfg);
  double f = flops::linear(C * (cfg.self_cond ? 2 : 1) * p * p, W, N);   // patch embedding
  f += flops::linear(kTimeFreqDim, W) + flops::linear(W, W);            // time MLP
  if (cfg.text_pooled_dim > 0) f += flops::linear(cfg.text_pooled_dim, W);
  const int64_t T = cfg.text_tokens;
  const double cross = cfg.text_dim > 0 ? flops::linear(W, W, N) * 2 + flops::linear(cfg.text_dim, W, T) * 2 +
                                              flops::cross_attention(N, T, W)
                                        : 0.0;                          // q, out; k, v; the attention
  const double block = flops::linear(W, 6 * W)                          // adaLN modulation
                       + flops::linear(W, 3 * W, N) + flops::attention(N, W) + flops::linear(W, W, N) + cross
                       + flops::linear(W, hidden, N) + flops::linear(hidden, W, N);
  f += static_cast<double>(cfg.depth) * block;
  f += flops::linear(W, 2 * W) + flops::linear(W, p * p * C, N);        // final layer
  return f;
}

}  // namespace ddm
