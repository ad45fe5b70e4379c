// The pieces diffusers' UNet2DConditionModel and ControlNetModel share (see unet_blocks.h).
#include "sd/unet_blocks.h"

#include <algorithm>
#include <cmath>

#include <torch/nn/functional.h>
#include <torch/torch.h>

#include "core/error.h"
#include "core/json.h"
#include "model/ops.h"
#include "sd/diffusers_weights.h"

namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace ddm::sd {
namespace {

using json = nlohmann::json;

nn::GroupNorm group_norm(int64_t groups, int64_t ch, double eps) { return sd_group_norm(groups, ch, eps); }
nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1) { return sd_conv(in, out, k, stride); }
nn::Linear linear(int64_t in, int64_t out, bool bias = true) { return nn::Linear(nn::LinearOptions(in, out).bias(bias)); }

// A module of its one parameter set "conv" (Downsample2D, Upsample2D) or "proj" (GEGLU).
struct ConvHolderImpl : nn::Module {
  explicit ConvHolderImpl(nn::Conv2d c) : conv(register_module("conv", std::move(c))) {}
  nn::Conv2d conv;
};
TORCH_MODULE(ConvHolder);
struct GegluImpl : nn::Module {
  GegluImpl(int64_t dim, int64_t inner) : proj(register_module("proj", linear(dim, 2 * inner))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [B, N, dim] -> [B, N, inner]
    const auto parts = apply_linear(proj, x).chunk(2, -1);
    return parts[0] * F::gelu(parts[1]);
  }
  nn::Linear proj;
};
TORCH_MODULE(Geglu);

// BasicTransformerBlock: self-attention, cross-attention, GEGLU feed-forward (ff.net.0, ff.net.2).
struct BlockImpl : nn::Module {
  BlockImpl(int64_t dim, int64_t heads, int64_t context_dim) {
    norm1 = register_module("norm1", nn::LayerNorm(nn::LayerNormOptions({dim})));
    attn1 = register_module("attn1", SdAttention(dim, dim, heads));
    norm2 = register_module("norm2", nn::LayerNorm(nn::LayerNormOptions({dim})));
    attn2 = register_module("attn2", SdAttention(dim, context_dim, heads));
    norm3 = register_module("norm3", nn::LayerNorm(nn::LayerNormOptions({dim})));
    auto ff = register_module("ff", std::make_shared<nn::Module>());
    net = ff->register_module("net", nn::ModuleList());
    net->push_back(Geglu(dim, 4 * dim));
    net->push_back(nn::Identity());  // diffusers' dropout
    net->push_back(linear(4 * dim, dim));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& context) {  // [B, N, dim], [B, T, C] -> [B, N, dim]
    const torch::Tensor a = norm1(x);
    x = attn1(a, a) + x;
    x = attn2(norm2(x), context) + x;
    const torch::Tensor h = net[0]->as<Geglu>()->forward(norm3(x));  // [B, N, 4 dim]
    return apply_linear(*net[2]->as<nn::Linear>(), h) + x;
  }
  nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  SdAttention attn1{nullptr}, attn2{nullptr};
  nn::ModuleList net;
};
TORCH_MODULE(Block);

// diffusers' get_timestep_embedding with flip_sin_to_cos and no frequency shift: [cos, sin] of
// t * 10000^(-k / (dim / 2)), k = 0 .. dim/2 - 1. t [B] -> [B, dim].
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const torch::Tensor exponent =
      torch::arange(half, t.options().dtype(torch::kFloat32)) * (-std::log(10000.0) / static_cast<double>(half));
  const torch::Tensor args = t.to(torch::kFloat32).unsqueeze(1) * exponent.exp().unsqueeze(0);  // [B, half]
  return torch::cat({args.cos(), args.sin()}, 1);                                                  // [B, dim]
}

}  // namespace

nn::Conv2d sd_conv(int64_t in, int64_t out, int64_t k, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2));
}

nn::GroupNorm sd_group_norm(int64_t groups, int64_t ch, double eps) {
  return nn::GroupNorm(nn::GroupNormOptions(groups, ch).eps(eps));
}

UNet2DConditionConfig parse_unet_config_keys(const json& j, const std::string& file, const std::string& class_name,
                                             const std::set<std::string>& extra, const std::map<std::string, json>& fixed) {
  DDM_CHECK(j.is_object(), file << ": not a JSON object");
  const ConfigReader r{j, file};
  std::string cls;
  r.string("_class_name", cls);
  DDM_CHECK(cls == class_name,
            file << ": _class_name \"" << cls << "\": ddm reads diffusers' " << class_name << " here");
  const std::set<std::string> known = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values",
                                       "in_channels", "down_block_types", "block_out_channels", "layers_per_block",
                                       "norm_num_groups", "norm_eps", "cross_attention_dim", "attention_head_dim",
                                       "use_linear_projection", "upcast_attention", "addition_embed_type_num_heads"};
  for (const auto& [key, value] : j.items()) {
    const auto f = fixed.find(key);
    if (f != fixed.end()) {
      DDM_CHECK(value == f->second, file << ": " << key << " = " << value.dump() << ": ddm's " << class_name
                                         << " builds only " << f->second.dump()
                                         << " (Stable Diffusion 1.x / 2.x's); not supported yet");
      continue;
    }
    DDM_CHECK(known.count(key) || extra.count(key),
              file << ": \"" << key << "\" is not a key of diffusers' " << class_name << " that ddm "
                   << "reads (a newer diffusers, or another model's config?); ddm does not ignore what it does not know");
  }
  UNet2DConditionConfig c;
  r.integer("in_channels", c.in_channels, 1, 1024);
  r.integer("layers_per_block", c.layers_per_block, 1, 64);
  r.integer("norm_num_groups", c.norm_num_groups, 1, 1024);
  r.integer("cross_attention_dim", c.cross_attention_dim, 1, 1 << 16);
  r.boolean("use_linear_projection", c.use_linear_projection);
  r.boolean("upcast_attention", c.upcast_attention);
  r.number("norm_eps", c.norm_eps);
  DDM_CHECK(c.norm_eps > 0, file << ": norm_eps must be > 0, got " << c.norm_eps);
  r.widths("block_out_channels", c.block_out_channels);
  const size_t levels = c.block_out_channels.size();
  auto types = [&](const char* key, std::vector<std::string>& out, const std::string& plain, const std::string& cross) {
    if (j.contains(key)) {
      const json& t = j[key];
      DDM_CHECK(t.is_array(), file << ": " << key << " must be a list, got " << t.dump());
      out.clear();
      for (const auto& v : t) {
        DDM_CHECK(v.is_string() && (v.get<std::string>() == plain || v.get<std::string>() == cross),
                  file << ": " << key << " holds " << v.dump() << "; ddm builds " << plain << " and " << cross
                       << " blocks only");
        out.push_back(v.get<std::string>());
      }
    }
    DDM_CHECK(out.size() == levels, file << ": " << key << " names " << out.size() << " blocks, block_out_channels "
                                         << levels << " levels");
  };
  types("down_block_types", c.down_block_types, "DownBlock2D", "CrossAttnDownBlock2D");
  if (extra.count("up_block_types")) types("up_block_types", c.up_block_types, "UpBlock2D", "CrossAttnUpBlock2D");
  c.heads.assign(levels, 8);
  if (j.contains("attention_head_dim")) {
    const json& h = j["attention_head_dim"];
    if (h.is_array()) {
      DDM_CHECK(h.size() == levels, file << ": attention_head_dim names " << h.size() << " levels, block_out_channels "
                                         << levels);
      for (size_t i = 0; i < levels; ++i) c.heads[i] = json_int(h[i], file + ": attention_head_dim", 1, 1024);
    } else {
      c.heads.assign(levels, json_int(h, file + ": attention_head_dim", 1, 1024));
    }
  }
  for (size_t i = 0; i < levels; ++i) {
    const int64_t w = c.block_out_channels[i];
    DDM_CHECK(w % c.norm_num_groups == 0, file << ": norm_num_groups " << c.norm_num_groups << " does not divide "
                                               << "the width " << w);
    DDM_CHECK(w % c.heads[i] == 0, file << ": the " << c.heads[i] << " heads of level " << i
                                        << " (attention_head_dim) do not divide its width " << w);
  }
  DDM_CHECK(c.block_out_channels.front() % 2 == 0, file << ": block_out_channels[0] must be even (the time embedding)");
  return c;
}

json unet_config_keys_json(const UNet2DConditionConfig& c) {
  const bool one_heads = std::all_of(c.heads.begin(), c.heads.end(), [&](int64_t h) { return h == c.heads.front(); });
  return {{"in_channels", c.in_channels},
          {"down_block_types", c.down_block_types},
          {"block_out_channels", c.block_out_channels},
          {"layers_per_block", c.layers_per_block},
          {"norm_num_groups", c.norm_num_groups},
          {"norm_eps", c.norm_eps},
          {"cross_attention_dim", c.cross_attention_dim},
          {"attention_head_dim", one_heads ? json(c.heads.front()) : json(c.heads)},  // as SD 1.5's (8) and 2.1's
          {"use_linear_projection", c.use_linear_projection},
          {"upcast_attention", c.upcast_attention},
          {"addition_embed_type_num_heads", 64}};
}

UnetResnetImpl::UnetResnetImpl(int64_t in, int64_t out, int64_t temb, int64_t groups, double eps) {
  norm1 = register_module("norm1", group_norm(groups, in, eps));
  conv1 = register_module("conv1", conv(in, out, 3));
  time_emb_proj = register_module("time_emb_proj", linear(temb, out));
  norm2 = register_module("norm2", group_norm(groups, out, eps));
  conv2 = register_module("conv2", conv(out, out, 3));
  if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1));
}

torch::Tensor UnetResnetImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  torch::Tensor h = conv1(group_norm_silu(norm1, x));                // [B, out, H, W]
  h = h + apply_linear(time_emb_proj, F::silu(temb)).unsqueeze(-1).unsqueeze(-1);  // + [B, out, 1, 1]
  h = conv2(group_norm_silu(norm2, h));                              // [B, out, H, W]
  return (conv_shortcut ? conv_shortcut(x) : x) + h;
}

SdAttentionImpl::SdAttentionImpl(int64_t dim, int64_t context_dim, int64_t heads) : heads_(heads) {
  to_q = register_module("to_q", linear(dim, dim, false));
  to_k = register_module("to_k", linear(context_dim, dim, false));
  to_v = register_module("to_v", linear(context_dim, dim, false));
  to_out = register_module("to_out", nn::ModuleList());
  to_out->push_back(linear(dim, dim));
}

torch::Tensor SdAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context) {
  const int64_t B = x.size(0), N = x.size(1), D = to_q->options.out_features(), hd = D / heads_;
  auto split = [&](const torch::Tensor& t) { return t.view({B, t.size(1), heads_, hd}).transpose(1, 2); };  // [B, h, n, hd]
  const torch::Tensor a = at::scaled_dot_product_attention(split(apply_linear(to_q, x)), split(apply_linear(to_k, context)),
                                                           split(apply_linear(to_v, context)));  // [B, h, N, hd]
  return apply_linear(*to_out[0]->as<nn::Linear>(), a.transpose(1, 2).reshape({B, N, D}));  // [B, N, dim]
}

SdTransformerImpl::SdTransformerImpl(int64_t ch, int64_t heads, int64_t context_dim, int64_t groups, bool linear_projection)
    : linear_(linear_projection) {
  norm = register_module("norm", group_norm(groups, ch, 1e-6));
  if (linear_) {
    proj_in = register_module("proj_in", linear(ch, ch).ptr());
  } else {
    proj_in = register_module("proj_in", conv(ch, ch, 1).ptr());
  }
  transformer_blocks = register_module("transformer_blocks", nn::ModuleList());
  transformer_blocks->push_back(Block(ch, heads, context_dim));
  if (linear_) {
    proj_out = register_module("proj_out", linear(ch, ch).ptr());
  } else {
    proj_out = register_module("proj_out", conv(ch, ch, 1).ptr());
  }
}

torch::Tensor SdTransformerImpl::forward(const torch::Tensor& x, const torch::Tensor& context) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  auto tokens = [&](const torch::Tensor& t) { return t.permute({0, 2, 3, 1}).reshape({B, H * W, C}); };  // [B, HW, C]
  // Contiguous, as diffusers makes it: the residual stream stays in NCHW order (GroupNorm's CPU kernels
  // take another path for channels-last input).
  auto image = [&](const torch::Tensor& t) { return t.reshape({B, H, W, C}).permute({0, 3, 1, 2}).contiguous(); };  // [B, C, H, W]
  torch::Tensor h = group_norm_act(norm, x, /*silu=*/false);  // [B, C, H, W]
  h = linear_ ? apply_linear(*proj_in->as<nn::Linear>(), tokens(h)) : tokens(proj_in->as<nn::Conv2d>()->forward(h));
  h = transformer_blocks[0]->as<Block>()->forward(h, context);  // [B, HW, C]
  h = linear_ ? image(apply_linear(*proj_out->as<nn::Linear>(), h)) : proj_out->as<nn::Conv2d>()->forward(image(h));
  return h + x;
}

LevelImpl::LevelImpl(Kind k) : kind(k) {
  resnets = register_module("resnets", nn::ModuleList());
  attentions = register_module("attentions", nn::ModuleList());
}

void LevelImpl::add_resampler(int64_t ch) {
  samplers = register_module(kind == Kind::kDown ? "downsamplers" : "upsamplers", nn::ModuleList());
  ConvHolder h(kind == Kind::kDown ? conv(ch, ch, 3, 2) : conv(ch, ch, 3));
  resample = h->conv;
  samplers->push_back(h);
}

torch::Tensor LevelImpl::resnet(size_t i, const torch::Tensor& x, const torch::Tensor& temb) {
  return resnets[i]->as<UnetResnet>()->forward(x, temb);
}

torch::Tensor LevelImpl::attend(size_t i, const torch::Tensor& x, const torch::Tensor& context) {
  return i < attentions->size() ? attentions[i]->as<SdTransformer>()->forward(x, context) : x;
}

TimeEmbeddingImpl::TimeEmbeddingImpl(int64_t in, int64_t dim) {
  linear_1 = register_module("linear_1", linear(in, dim));
  linear_2 = register_module("linear_2", linear(dim, dim));
}

torch::Tensor TimeEmbeddingImpl::forward(const torch::Tensor& timestep, torch::ScalarType dtype) {
  const torch::Tensor t_emb = timestep_embedding(timestep, linear_1->options.in_features()).to(dtype);  // [B, w0]
  return apply_linear(linear_2, F::silu(apply_linear(linear_1, t_emb)));                               // [B, 4 w0]
}

nn::ModuleList make_down_blocks(const UNet2DConditionConfig& c) {
  const auto& w = c.block_out_channels;
  const int64_t L = static_cast<int64_t>(w.size()), T = c.time_embed_dim();
  nn::ModuleList blocks;
  for (int64_t i = 0; i < L; ++i) {
    const bool cross = c.down_block_types[i] == "CrossAttnDownBlock2D";
    Level level(LevelImpl::Kind::kDown);
    for (int64_t j = 0; j < c.layers_per_block; ++j) {
      level->resnets->push_back(UnetResnet(j == 0 ? (i == 0 ? w[0] : w[i - 1]) : w[i], w[i], T, c.norm_num_groups, c.norm_eps));
      if (cross)
        level->attentions->push_back(
            SdTransformer(w[i], c.heads[i], c.cross_attention_dim, c.norm_num_groups, c.use_linear_projection));
    }
    if (i + 1 < L) level->add_resampler(w[i]);
    blocks->push_back(level);
  }
  return blocks;
}

Level make_mid_block(const UNet2DConditionConfig& c) {
  const int64_t w = c.block_out_channels.back(), T = c.time_embed_dim();
  Level mid(LevelImpl::Kind::kMid);
  mid->resnets->push_back(UnetResnet(w, w, T, c.norm_num_groups, c.norm_eps));
  mid->attentions->push_back(SdTransformer(w, c.heads.back(), c.cross_attention_dim, c.norm_num_groups, c.use_linear_projection));
  mid->resnets->push_back(UnetResnet(w, w, T, c.norm_num_groups, c.norm_eps));
  return mid;
}

torch::Tensor mid_forward(LevelImpl& mid, const torch::Tensor& h, const torch::Tensor& emb, const torch::Tensor& context) {
  return mid.resnet(1, mid.attend(0, mid.resnet(0, h, emb), context), emb);  // [B, w[-1], h, w]
}

void down_step(LevelImpl& level, NetCarry& k, size_t j, const torch::Tensor& context) {
  k.h = level.attend(j, level.resnet(j, k.h, k.emb), context);  // [B, w_i, H_i, W_i]
  k.skips.push_back(k.h);
}

void downsample_step(LevelImpl& level, NetCarry& k) {
  k.h = level.resample(k.h);  // [B, w_i, H_i / 2, W_i / 2]
  k.skips.push_back(k.h);
}

std::vector<torch::Tensor> params_of(std::initializer_list<const nn::Module*> modules) {
  std::vector<torch::Tensor> out;
  for (const nn::Module* m : modules)
    if (m)
      for (const torch::Tensor& p : m->parameters()) out.push_back(p);
  return out;
}

const nn::Module* item_or_null(const nn::ModuleList& list, size_t j) {
  return j < list->size() ? list->ptr(j).get() : nullptr;
}

namespace flops_of {

double conv(double in, double out, double k, double pixels) { return 2 * in * out * k * k * pixels; }

double resnet(double in, double out, double temb, double n) {
  return conv(in, out, 3, n) + conv(out, out, 3, n) + (in != out ? conv(in, out, 1, n) : 0.0) + 2.0 * temb * out;
}

double transformer(double ch, double n, double T, double ctx) {
  const double proj = 2 * 2 * n * ch * ch;                      // proj_in, proj_out
  const double self = 4 * 2 * n * ch * ch + 2 * 2 * n * n * ch;  // q, k, v, out; scores, values
  const double cross = 2 * 2 * n * ch * ch + 2 * 2 * T * ctx * ch + 2 * 2 * n * T * ch;
  const double ff = 2 * n * ch * 8 * ch + 2 * n * 4 * ch * ch;  // GEGLU in, out
  return proj + self + cross + ff;
}

double encoder(const UNet2DConditionConfig& c, int64_t H, int64_t W, int64_t tokens, std::vector<int64_t>& skips,
               double& n) {
  const auto& w = c.block_out_channels;
  const int64_t L = static_cast<int64_t>(w.size());
  const double temb = static_cast<double>(c.time_embed_dim()), T = static_cast<double>(tokens),
               ctx = static_cast<double>(c.cross_attention_dim);
  n = static_cast<double>(H * W);
  double f = conv(c.in_channels, w[0], 3, n) + 2.0 * (w[0] * temb + temb * temb);
  skips.push_back(w[0]);
  int64_t ch = w[0];
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < c.layers_per_block; ++j) {
      f += resnet(ch, w[i], temb, n) + (c.down_block_types[i] == "CrossAttnDownBlock2D" ? transformer(w[i], n, T, ctx) : 0.0);
      ch = w[i];
      skips.push_back(ch);
    }
    if (i + 1 < L) {
      n /= 4;
      f += conv(ch, ch, 3, n);  // stride 2
      skips.push_back(ch);
    }
  }
  return f + 2 * resnet(ch, ch, temb, n) + transformer(ch, n, T, ctx);  // the middle
}

}  // namespace flops_of

}  // namespace ddm::sd
