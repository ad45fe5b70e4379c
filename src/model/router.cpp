// Router networks: p(k | x_t, t, y) as logits (see router.h).
#include "model/router.h"

#include <torch/torch.h>

#include "core/error.h"
#include "model/dit.h"
#include "model/flops.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

bool is_router_arch(const std::string& arch) { return arch == "router-dit" || arch == "router-conv"; }

void validate_router(const ModelConfig& cfg) {
  DDM_CHECK(is_router_arch(cfg.arch), "model.arch = '" << cfg.arch << "' is not a router architecture");
  DDM_CHECK(cfg.num_experts >= 2, "model.num_experts must be >= 2 for a router (it is normally taken from the "
                                  "partition), got " << cfg.num_experts);
  if (cfg.arch == "router-dit") {
    validate_dit(cfg);
    return;
  }
  DDM_CHECK(cfg.patch > 0 && cfg.image_size % cfg.patch == 0,
            "model.patch = " << cfg.patch << " must be > 0 and divide model.image_size = " << cfg.image_size);
  DDM_CHECK(cfg.channels > 0, "model.channels must be > 0, got " << cfg.channels);
  DDM_CHECK(!cfg.channel_mult.empty(), "model.channel_mult must list at least one level");
  DDM_CHECK(cfg.res_blocks >= 1, "model.res_blocks must be >= 1, got " << cfg.res_blocks);
  for (auto m : cfg.channel_mult) {
    DDM_CHECK(m > 0, "model.channel_mult entries must be > 0, got " << m);
    DDM_CHECK(cfg.groups > 0 && (cfg.channels * m) % cfg.groups == 0,
              "model.groups = " << cfg.groups << " does not divide " << cfg.channels * m << " channels");
  }
  const int64_t grid = cfg.image_size / cfg.patch, factor = int64_t{1} << (cfg.channel_mult.size() - 1);
  DDM_CHECK(grid % factor == 0, "router-conv: the " << grid << "x" << grid << " map after model.patch = " << cfg.patch
                                << " is not divisible by 2^(levels-1) = " << factor
                                << "; change model.patch or model.channel_mult");
}

// ---------------------------------------------------------------------------------------------
// router-dit

RouterDiTImpl::RouterDiTImpl(const ModelConfig& cfg) : cfg_(cfg) {
  validate_router(cfg);
  const int64_t p = cfg.patch, W = cfg.width, grid = cfg.image_size / p;
  patch_embed_ = register_module("patch_embed", nn::Linear(cfg.in_channels * p * p, W));
  pos_ = register_buffer("pos", pos_embed_2d(W, grid).unsqueeze(0));  // [1, N, W]
  cls_ = register_parameter("cls", torch::zeros({1, 1, W}));
  time_ = register_module("time", TimeEmbedder(kTimeFreqDim, W));
  if (cfg.num_classes > 0) label_ = register_module("label", LabelEmbedder(cfg.num_classes, W));
  if (cfg.text_pooled_dim > 0) pooled_ = register_module("pooled", nn::Linear(cfg.text_pooled_dim, W));
  for (int64_t i = 0; i < cfg.depth; ++i)
    blocks_.push_back(register_module("block" + std::to_string(i), DiTBlock(W, cfg.heads, cfg.mlp_ratio)));
  norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({W}).eps(kDiTNormEps)));
  head_ = register_module("head", nn::Linear(W, cfg.num_experts));
  init_dit_weights(*this);
  torch::NoGradGuard ng;
  nn::init::normal_(cls_, 0.0, 0.02);
  zero_init(*head_);
}

torch::Tensor RouterDiTImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& cond) {
  const torch::Tensor& y = cond.y;
  const int64_t C = cfg_.in_channels, S = cfg_.image_size, p = cfg_.patch;
  DDM_CHECK(x.dim() == 4 && x.size(1) == C && x.size(2) == S && x.size(3) == S,
            "router: expected x [B, " << C << ", " << S << ", " << S << "], got " << x.sizes());
  const int64_t B = x.size(0), N = pos_.size(1);
  auto tok = patchify(x, p).reshape({B * N, C * p * p});             // [B N, C p p]
  auto h = apply_linear(patch_embed_, tok).view({B, N, -1}) + pos_;                // [B, N, W]
  h = torch::cat({cls_.expand({B, 1, cfg_.width}), h}, 1);           // [B, 1 + N, W]
  auto c = time_(t);                                                 // [B, W]
  if (label_) {
    DDM_CHECK(y.defined(), "router: class labels y are required (model.num_classes = " << cfg_.num_classes << ")");
    c = c + label_(y);                                               // [B, W]
  }
  if (pooled_) {
    DDM_CHECK(cond.pooled.defined(), "router: the prompts' pooled embedding is required (model.text_encoder)");
    c = c + apply_linear(pooled_, cond.pooled);                                    // [B, W]
  }
  const auto c_act = torch::silu(c);                                 // [B, W]
  for (auto& block : blocks_) h = block->forward(h, c_act);          // [B, 1 + N, W]
  return apply_linear(head_, norm_(h.select(1, 0)));                               // [B, K]
}

// ---------------------------------------------------------------------------------------------
// router-conv

RouterConvImpl::RouterConvImpl(const ModelConfig& cfg) : cfg_(cfg) {
  validate_router(cfg);
  const int64_t emb = 4 * cfg.channels;
  time_ = register_module("time", TimeEmbedder(cfg.channels, emb));
  if (cfg.num_classes > 0) label_ = register_module("label", LabelEmbedder(cfg.num_classes, emb));
  if (cfg.text_pooled_dim > 0) pooled_ = register_module("pooled", nn::Linear(cfg.text_pooled_dim, emb));
  int64_t cur = cfg.channels * cfg.channel_mult[0];
  stem_ = register_module("stem", nn::Conv2d(nn::Conv2dOptions(cfg.in_channels, cur, cfg.patch).stride(cfg.patch)));
  for (size_t l = 0; l < cfg.channel_mult.size(); ++l) {
    const int64_t ch = cfg.channels * cfg.channel_mult[l];
    if (l > 0)
      down_.push_back(register_module("down" + std::to_string(l),
                                      nn::Conv2d(nn::Conv2dOptions(cur, cur, 3).stride(2).padding(1))));
    levels_.emplace_back();
    for (int64_t j = 0; j < cfg.res_blocks; ++j) {
      levels_[l].push_back(register_module("res" + std::to_string(l) + "_" + std::to_string(j),
                                           ResBlock(cur, ch, emb, cfg.groups)));
      cur = ch;
    }
  }
  norm_ = register_module("norm", nn::GroupNorm(cfg.groups, cur));
  head_ = register_module("head", nn::Linear(cur, cfg.num_experts));
  zero_init(*head_);
}

torch::Tensor RouterConvImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& cond) {
  const torch::Tensor& y = cond.y;
  const int64_t C = cfg_.in_channels, S = cfg_.image_size;
  DDM_CHECK(x.dim() == 4 && x.size(1) == C && x.size(2) == S && x.size(3) == S,
            "router: expected x [B, " << C << ", " << S << ", " << S << "], got " << x.sizes());
  auto e = time_(t);                                                 // [B, E]
  if (label_) {
    DDM_CHECK(y.defined(), "router: class labels y are required (model.num_classes = " << cfg_.num_classes << ")");
    e = e + label_(y);                                               // [B, E]
  }
  if (pooled_) {
    DDM_CHECK(cond.pooled.defined(), "router: the prompts' pooled embedding is required (model.text_encoder)");
    e = e + apply_linear(pooled_, cond.pooled);                                    // [B, E]
  }
  const auto e_act = torch::silu(e);                                 // [B, E]
  auto h = stem_(x);                                                 // [B, ch0, S/p, S/p]
  for (size_t l = 0; l < levels_.size(); ++l) {
    if (l > 0) h = down_[l - 1](h);                                  // [B, ch, s/2, s/2]
    for (auto& block : levels_[l]) h = block->forward(h, e_act);     // [B, ch_l, s, s]
  }
  h = torch::silu(norm_(h)).mean({2, 3});                            // [B, ch]
  return apply_linear(head_, h);                                                   // [B, K]
}

// ---------------------------------------------------------------------------------------------

double router_forward_flops(const ModelConfig& cfg) {
  validate_router(cfg);
  const int64_t p = cfg.patch, C = cfg.in_channels, K = cfg.num_experts, grid = cfg.image_size / p;
  if (cfg.arch == "router-dit") {
    const int64_t W = cfg.width, N = grid * grid + 1, hidden = dit_mlp_hidden(cfg);
    double f = flops::linear(C * p * p, W, N - 1);                       // patch embedding
    f += flops::linear(kTimeFreqDim, W) + flops::linear(W, W);          // time MLP
    if (cfg.text_pooled_dim > 0) f += flops::linear(cfg.text_pooled_dim, W);  // pooled text
    const double block = flops::linear(W, 6 * W) + flops::linear(W, 3 * W, N) + flops::attention(N, W) +
                         flops::linear(W, W, N) + flops::linear(W, hidden, N) + flops::linear(hidden, W, N);
    return f + static_cast<double>(cfg.depth) * block + flops::linear(W, K);
  }
  const int64_t E = 4 * cfg.channels;
  double f = flops::linear(cfg.channels, E) + flops::linear(E, E);     // time MLP
  if (cfg.text_pooled_dim > 0) f += flops::linear(cfg.text_pooled_dim, E);  // pooled text
  int64_t cur = cfg.channels * cfg.channel_mult[0], s = grid;
  f += flops::conv2d(C, cur, p, s, s);                                  // stem
  for (size_t l = 0; l < cfg.channel_mult.size(); ++l) {
    const int64_t ch = cfg.channels * cfg.channel_mult[l];
    if (l > 0) {
      s /= 2;
      f += flops::conv2d(cur, cur, 3, s, s);                            // stride-2 downsampling
    }
    for (int64_t j = 0; j < cfg.res_blocks; ++j) {
      f += flops::conv2d(cur, ch, 3, s, s) + flops::linear(E, 2 * ch) + flops::conv2d(ch, ch, 3, s, s);
      if (cur != ch) f += flops::conv2d(cur, ch, 1, s, s);
      cur = ch;
    }
  }
  return f + flops::linear(cur, K);
}

}  // namespace ddm
