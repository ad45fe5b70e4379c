// Building blocks shared by the U-Net and the DiT (see layers.h).
#include "model/layers.h"

#include <cmath>

#include <torch/torch.h>

#include "core/error.h"
#include "model/ops.h"

namespace ddm {

namespace nn = torch::nn;

torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period) {
  DDM_CHECK(t.dim() == 1, "timestep_embedding: t must be 1-D [B], got " << t.sizes());
  DDM_CHECK(dim > 0, "timestep_embedding: dim must be > 0, got " << dim);
  const int64_t half = dim / 2;
  auto opts = t.options();
  auto s = t * 1000.0;                                                                  // [B]
  auto freqs = torch::exp(torch::arange(half, opts) * (-std::log(max_period) / half));  // [half]
  auto args = s.unsqueeze(1) * freqs.unsqueeze(0);                                      // [B, half]
  auto emb = torch::cat({torch::cos(args), torch::sin(args)}, 1);                       // [B, 2 half]
  if (dim % 2 == 1) emb = torch::cat({emb, torch::zeros({t.size(0), 1}, opts)}, 1);     // [B, dim]
  return emb;
}

torch::Tensor pos_embed_2d(int64_t dim, int64_t grid) {
  DDM_CHECK(dim % 4 == 0 && dim > 0, "pos_embed_2d: dim must be a positive multiple of 4, got " << dim);
  DDM_CHECK(grid > 0, "pos_embed_2d: grid must be > 0, got " << grid);
  auto d64 = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t quarter = dim / 4;
  auto omega = torch::pow(10000.0, -torch::arange(quarter, d64) / static_cast<double>(quarter));  // [D/4]
  auto coord = torch::arange(grid, d64);                                       // [G]
  auto ang = coord.unsqueeze(1) * omega.unsqueeze(0);                          // [G, D/4]
  auto one_d = torch::cat({torch::sin(ang), torch::cos(ang)}, 1);              // [G, D/2]
  auto rows = one_d.unsqueeze(1).expand({grid, grid, dim / 2});                // [G(row), G(col), D/2]
  auto cols = one_d.unsqueeze(0).expand({grid, grid, dim / 2});                // [G(row), G(col), D/2]
  auto emb = torch::cat({rows, cols}, 2).reshape({grid * grid, dim});          // [G*G, D]
  return emb.to(torch::kFloat32);
}

torch::Tensor patchify(const torch::Tensor& x, int64_t p) {
  DDM_CHECK(x.dim() == 4, "patchify: x must be [B, C, H, W], got " << x.sizes());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  DDM_CHECK(p > 0 && H % p == 0 && W % p == 0,
            "patchify: image " << H << "x" << W << " is not divisible by patch " << p);
  auto v = x.reshape({B, C, H / p, p, W / p, p});                  // [B, C, h, p, w, p]
  return v.permute({0, 2, 4, 1, 3, 5})                             // [B, h, w, C, p, p]
      .reshape({B, (H / p) * (W / p), C * p * p});                 // [B, N, C p p]
}

torch::Tensor unpatchify(const torch::Tensor& tokens, int64_t p, int64_t channels, int64_t height,
                         int64_t width) {
  const int64_t B = tokens.size(0), h = height / p, w = width / p;
  DDM_CHECK(tokens.dim() == 3 && tokens.size(1) == h * w && tokens.size(2) == channels * p * p,
            "unpatchify: tokens " << tokens.sizes() << " do not match C=" << channels << " H=" << height
                                  << " W=" << width << " p=" << p);
  auto v = tokens.reshape({B, h, w, channels, p, p});              // [B, h, w, C, p, p]
  return v.permute({0, 3, 1, 4, 2, 5})                             // [B, C, h, p, w, p]
      .reshape({B, channels, height, width});                      // [B, C, H, W]
}

void zero_init(torch::nn::Module& m) {
  torch::NoGradGuard ng;
  for (auto& p : m.parameters(/*recurse=*/false)) p.zero_();
}

// ---------------------------------------------------------------------------------------------
TimeEmbedderImpl::TimeEmbedderImpl(int64_t freq_dim, int64_t dim) : freq_dim_(freq_dim) {
  fc1_ = register_module("fc1", nn::Linear(freq_dim, dim));
  fc2_ = register_module("fc2", nn::Linear(dim, dim));
}

torch::Tensor TimeEmbedderImpl::forward(const torch::Tensor& t) {
  auto e = timestep_embedding(t, freq_dim_);   // [B, F]
  e = torch::silu(apply_linear(fc1_, e));      // [B, D]
  return apply_linear(fc2_, e);                // [B, D]
}

LabelEmbedderImpl::LabelEmbedderImpl(int64_t num_classes, int64_t dim) : num_classes_(num_classes) {
  DDM_CHECK(num_classes > 0, "LabelEmbedder: num_classes must be > 0, got " << num_classes);
  table_ = register_module("table", nn::Embedding(num_classes + 1, dim));
}

torch::Tensor LabelEmbedderImpl::forward(const torch::Tensor& y) {
  return table_(y);  // [B] -> [B, D]
}

// ---------------------------------------------------------------------------------------------
ResBlockImpl::ResBlockImpl(int64_t in_ch, int64_t out_ch, int64_t emb_dim, int64_t groups)
    : out_ch_(out_ch) {
  norm1_ = register_module("norm1", nn::GroupNorm(groups, in_ch));
  conv1_ = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in_ch, out_ch, 3).padding(1)));
  emb_ = register_module("emb", nn::Linear(emb_dim, 2 * out_ch));
  norm2_ = register_module("norm2", nn::GroupNorm(groups, out_ch));
  conv2_ = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out_ch, out_ch, 3).padding(1)));
  zero_init(*conv2_);
  if (in_ch != out_ch) skip_ = register_module("skip", nn::Conv2d(nn::Conv2dOptions(in_ch, out_ch, 1)));
}

torch::Tensor ResBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& emb_act) {
  auto h = conv1_(group_norm_silu(norm1_, x));                   // [B, out, H, W]
  auto ss = apply_linear(emb_, emb_act);                          // [B, 2 out]
  auto scale = ss.narrow(1, 0, out_ch_);                          // [B, out]
  auto shift = ss.narrow(1, out_ch_, out_ch_);                    // [B, out]
  // silu(norm2(h) * (1 + scale) + shift), one pass on a GPU with the fused kernel (ops.h)
  h = conv2_(group_norm_act(norm2_, h, /*silu=*/true, scale, shift));  // [B, out, H, W]
  return skip_ ? skip_(x) + h : x + h;                            // [B, out, H, W]
}

AttentionBlockImpl::AttentionBlockImpl(int64_t ch, int64_t heads, int64_t groups) : heads_(heads) {
  DDM_CHECK(heads > 0 && ch % heads == 0,
            "AttentionBlock: channels " << ch << " not divisible by heads " << heads);
  norm_ = register_module("norm", nn::GroupNorm(groups, ch));
  qkv_ = register_module("qkv", nn::Conv2d(nn::Conv2dOptions(ch, 3 * ch, 1)));
  proj_ = register_module("proj", nn::Conv2d(nn::Conv2dOptions(ch, ch, 1)));
  zero_init(*proj_);
}

torch::Tensor AttentionBlockImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int64_t d = C / heads_;
  if (!x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    // Channels-last: the qkv convolution's output is [B, H, W, 3 C] in memory, already tokens.
    auto qkv = qkv_(group_norm_act(norm_, x, /*silu=*/false));    // [B, 3 C, H, W], channels-last
    auto a = attention_tokens_qkv(qkv.permute({0, 2, 3, 1}).reshape({B, H * W, 3, heads_, d}));  // [B, h, N, d]
    a = a.transpose(1, 2).reshape({B, H, W, C}).permute({0, 3, 1, 2});  // [B, C, H, W], channels-last
    return x + proj_(a);                                          // [B, C, H, W]
  }
  auto qkv = qkv_(group_norm_act(norm_, x, /*silu=*/false)).reshape({B, 3, heads_, d, H * W})  // [B, 3, h, d, N]
                 .transpose(-1, -2);                              // [B, 3, h, N, d]
  auto a = attention_qkv(qkv);                                    // [B, h, N, d]
  a = a.transpose(-1, -2).reshape({B, C, H, W});                  // [B, C, H, W]
  return x + proj_(a);                                            // [B, C, H, W]
}

// ---------------------------------------------------------------------------------------------
DiTBlockImpl::DiTBlockImpl(int64_t width, int64_t heads, double mlp_ratio, int64_t context_dim)
    : width_(width), heads_(heads) {
  DDM_CHECK(heads > 0 && width % heads == 0,
            "DiTBlock: width " << width << " not divisible by heads " << heads);
  const auto hidden = static_cast<int64_t>(std::lround(static_cast<double>(width) * mlp_ratio));
  DDM_CHECK(hidden > 0, "DiTBlock: mlp_ratio " << mlp_ratio << " gives an empty MLP");
  qkv_ = register_module("qkv", nn::Linear(width, 3 * width));
  proj_ = register_module("proj", nn::Linear(width, width));
  fc1_ = register_module("fc1", nn::Linear(width, hidden));
  fc2_ = register_module("fc2", nn::Linear(hidden, width));
  ada_ = register_module("ada", nn::Linear(width, 6 * width));
  zero_init(*ada_);
  if (context_dim > 0) cross_ = register_module("cross", CrossAttention(width, context_dim, heads));
}

namespace {
// x + gate * lin(h) for x [B, N, W], gate [B, W], h [B N, in]. On the CPU the linear runs without its
// bias, which gated_residual adds in the same pass (ops.h: the fused kernel), so no pass copies a
// broadcast bias; on a GPU the bias goes into the GEMM (cuBLAS's epilogue), since a separate a + bias
// there is a full pass over [B N, W] (in float32 under bf16 autocast), twice per block and again in
// backward; on CUDA (unless DDM_FUSED_CUDA=0) the residual's backward is one kernel (fused_gpu.h).
torch::Tensor gated_linear_residual(const torch::Tensor& x, const torch::Tensor& gate, const torch::Tensor& h,
                                    nn::Linear& lin) {
  if (!x.is_cpu()) return gated_residual(x, gate, apply_linear(lin, h).view(x.sizes()));  // [B, N, W]
  return gated_residual(x, gate, at::linear(h, lin->weight).view(x.sizes()), lin->bias);  // [B, N, W], h W^T
}
}  // namespace

torch::Tensor DiTBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& c_act, const torch::Tensor& context,
                                    const torch::Tensor& context_mask) {
  // Linears run on 2-D [B N, W] views.
  const int64_t B = x.size(0), N = x.size(1), W = width_, d = W / heads_;
  auto m = apply_linear(ada_, c_act).chunk(6, -1);                     // 6 x [B, W]
  auto h = adaln_modulate(x, m[0], m[1], kDiTNormEps);                 // [B, N, W]
  auto qkv = apply_linear(qkv_, h.view({B * N, W})).view({B, N, 3, heads_, d});  // [B, N, 3, h, d]
  auto a = attention_tokens_qkv(qkv);                                  // [B, h, N, d]
  auto out = gated_linear_residual(x, m[2], a.transpose(1, 2).reshape({B * N, W}), proj_);  // [B, N, W]
  if (cross_) out = out + cross_(out, context, context_mask);          // [B, N, W]
  h = adaln_modulate(out, m[3], m[4], kDiTNormEps);                    // [B, N, W]
  h = torch::gelu(apply_linear(fc1_, h.view({B * N, W})));            // [B N, hidden]
  return gated_linear_residual(out, m[5], h, fc2_);                    // [B, N, W]
}

DiTFinalLayerImpl::DiTFinalLayerImpl(int64_t width, int64_t out_dim) {
  ada_ = register_module("ada", nn::Linear(width, 2 * width));
  linear_ = register_module("linear", nn::Linear(width, out_dim));
  zero_init(*ada_);
  zero_init(*linear_);
}

torch::Tensor DiTFinalLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& c_act) {
  const int64_t B = x.size(0), N = x.size(1);
  auto m = apply_linear(ada_, c_act).chunk(2, -1);                     // 2 x [B, W]
  auto h = adaln_modulate(x, m[0], m[1], kDiTNormEps);                 // [B, N, W]
  return apply_linear(linear_, h.view({B * N, x.size(2)})).view({B, N, -1});  // [B, N, out_dim]
}

}  // namespace ddm
