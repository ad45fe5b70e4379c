// diffusers' UNet2DConditionModel in LibTorch, under diffusers' parameter names (see unet_2d_condition.h).
#include "sd/unet_2d_condition.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/nn/functional.h>
#include <torch/torch.h>

#include "core/error.h"
#include "core/json.h"
#include "sd/diffusers_weights.h"

namespace fs = std::filesystem;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace ddm::sd {
namespace {

using json = nlohmann::json;

nn::GroupNorm group_norm(int64_t groups, int64_t ch, double eps) {
  return nn::GroupNorm(nn::GroupNormOptions(groups, ch).eps(eps));
}
nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(k / 2));
}
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
    const auto parts = proj(x).chunk(2, -1);
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
    return net[2]->as<nn::Linear>()->forward(h) + x;
  }
  nn::LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  SdAttention attn1{nullptr}, attn2{nullptr};
  nn::ModuleList net;
};
TORCH_MODULE(Block);

// CrossAttnDownBlock2D / DownBlock2D / UNetMidBlock2DCrossAttn / CrossAttnUpBlock2D / UpBlock2D:
// resnets, attentions (none in the plain blocks) and a resampler.
struct LevelImpl : nn::Module {
  enum class Kind { kDown, kMid, kUp };
  Kind kind;
  nn::ModuleList resnets, attentions, samplers;
  nn::Conv2d resample{nullptr};
  explicit LevelImpl(Kind k) : kind(k) {
    resnets = register_module("resnets", nn::ModuleList());
    attentions = register_module("attentions", nn::ModuleList());
  }
  void add_resampler(int64_t ch) {
    samplers = register_module(kind == Kind::kDown ? "downsamplers" : "upsamplers", nn::ModuleList());
    ConvHolder h(kind == Kind::kDown ? conv(ch, ch, 3, 2) : conv(ch, ch, 3));
    resample = h->conv;
    samplers->push_back(h);
  }
  torch::Tensor resnet(size_t i, const torch::Tensor& x, const torch::Tensor& temb) {
    return resnets[i]->as<UnetResnet>()->forward(x, temb);
  }
  torch::Tensor attend(size_t i, const torch::Tensor& x, const torch::Tensor& context) {
    return i < attentions->size() ? attentions[i]->as<SdTransformer>()->forward(x, context) : x;
  }
};
TORCH_MODULE(Level);

struct TimeEmbeddingImpl : nn::Module {
  TimeEmbeddingImpl(int64_t in, int64_t dim) {
    linear_1 = register_module("linear_1", linear(in, dim));
    linear_2 = register_module("linear_2", linear(dim, dim));
  }
  nn::Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimeEmbedding);

// diffusers' get_timestep_embedding with flip_sin_to_cos and no frequency shift: [cos, sin] of
// t * 10000^(-k / (dim / 2)), k = 0 .. dim/2 - 1. t [B] -> [B, dim].
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const torch::Tensor exponent =
      torch::arange(half, t.options().dtype(torch::kFloat32)) * (-std::log(10000.0) / static_cast<double>(half));
  const torch::Tensor args = t.to(torch::kFloat32).unsqueeze(1) * exponent.exp().unsqueeze(0);  // [B, half]
  return torch::cat({args.cos(), args.sin()}, 1);                                                  // [B, dim]
}

// The keys of diffusers' UNet2DConditionModel that ddm does not build on, with the value (diffusers'
// default) they must have.
const std::map<std::string, json>& fixed_keys() {
  static const std::map<std::string, json> keys = {
      {"center_input_sample", false}, {"flip_sin_to_cos", true}, {"freq_shift", 0},
      {"mid_block_type", "UNetMidBlock2DCrossAttn"}, {"only_cross_attention", false}, {"downsample_padding", 1},
      {"mid_block_scale_factor", 1}, {"dropout", 0.0}, {"act_fn", "silu"}, {"transformer_layers_per_block", 1},
      {"reverse_transformer_layers_per_block", nullptr}, {"encoder_hid_dim", nullptr},
      {"encoder_hid_dim_type", nullptr}, {"num_attention_heads", nullptr}, {"dual_cross_attention", false},
      {"class_embed_type", nullptr}, {"addition_embed_type", nullptr}, {"addition_time_embed_dim", nullptr},
      {"num_class_embeds", nullptr}, {"resnet_time_scale_shift", "default"}, {"resnet_skip_time_act", false},
      {"resnet_out_scale_factor", 1.0}, {"time_embedding_type", "positional"}, {"time_embedding_dim", nullptr},
      {"time_embedding_act_fn", nullptr}, {"timestep_post_act", nullptr}, {"time_cond_proj_dim", nullptr},
      {"conv_in_kernel", 3}, {"conv_out_kernel", 3}, {"projection_class_embeddings_input_dim", nullptr},
      {"attention_type", "default"}, {"class_embeddings_concat", false}, {"mid_block_only_cross_attention", nullptr},
      {"cross_attention_norm", nullptr}};
  return keys;
}

}  // namespace

UNet2DConditionConfig parse_unet_2d_condition_config(const json& j, const std::string& file) {
  DDM_CHECK(j.is_object(), file << ": not a JSON object");
  const ConfigReader r{j, file};
  std::string cls;
  r.string("_class_name", cls);
  DDM_CHECK(cls == "UNet2DConditionModel",
            file << ": _class_name \"" << cls << "\": ddm reads diffusers' UNet2DConditionModel here");
  const std::set<std::string> known = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values",
                                       "in_channels", "out_channels", "sample_size", "down_block_types",
                                       "up_block_types", "block_out_channels", "layers_per_block", "norm_num_groups",
                                       "norm_eps", "cross_attention_dim", "attention_head_dim",
                                       "use_linear_projection", "upcast_attention", "addition_embed_type_num_heads"};
  for (const auto& [key, value] : j.items()) {
    const auto fixed = fixed_keys().find(key);
    if (fixed != fixed_keys().end()) {
      DDM_CHECK(value == fixed->second, file << ": " << key << " = " << value.dump() << ": ddm's UNet2DConditionModel "
                                             << "builds only " << fixed->second.dump()
                                             << " (Stable Diffusion 1.x / 2.x's); not supported yet");
      continue;
    }
    DDM_CHECK(known.count(key), file << ": \"" << key << "\" is not a key of diffusers' UNet2DConditionModel that ddm "
                                     << "reads (a newer diffusers, or another model's config?); ddm does not ignore "
                                     << "what it does not know");
  }
  UNet2DConditionConfig c;
  r.integer("in_channels", c.in_channels, 1, 1024);
  r.integer("out_channels", c.out_channels, 1, 1024);
  r.integer("sample_size", c.sample_size, 1, 1 << 16);
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
  types("up_block_types", c.up_block_types, "UpBlock2D", "CrossAttnUpBlock2D");
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

json unet_2d_condition_config_json(const UNet2DConditionConfig& c) {
  json j = {{"_class_name", "UNet2DConditionModel"},
            {"_diffusers_version", "0.42.1"},
            {"in_channels", c.in_channels},
            {"out_channels", c.out_channels},
            {"sample_size", c.sample_size},
            {"down_block_types", c.down_block_types},
            {"up_block_types", c.up_block_types},
            {"block_out_channels", c.block_out_channels},
            {"layers_per_block", c.layers_per_block},
            {"norm_num_groups", c.norm_num_groups},
            {"norm_eps", c.norm_eps},
            {"cross_attention_dim", c.cross_attention_dim},
            {"attention_head_dim", c.heads},
            {"use_linear_projection", c.use_linear_projection},
            {"upcast_attention", c.upcast_attention},
            {"addition_embed_type_num_heads", 64}};
  for (const auto& [key, value] : fixed_keys()) j[key] = value;
  return j;
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
  torch::Tensor h = conv1(F::silu(norm1(x)));                        // [B, out, H, W]
  h = h + time_emb_proj(F::silu(temb)).unsqueeze(-1).unsqueeze(-1);  // + [B, out, 1, 1]
  h = conv2(F::silu(norm2(h)));                                      // [B, out, H, W]
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
  const torch::Tensor a = at::scaled_dot_product_attention(split(to_q(x)), split(to_k(context)), split(to_v(context)));
  return to_out[0]->as<nn::Linear>()->forward(a.transpose(1, 2).reshape({B, N, D}));  // [B, N, dim]
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
  torch::Tensor h = norm(x);
  h = linear_ ? proj_in->as<nn::Linear>()->forward(tokens(h)) : tokens(proj_in->as<nn::Conv2d>()->forward(h));
  h = transformer_blocks[0]->as<Block>()->forward(h, context);  // [B, HW, C]
  h = linear_ ? image(proj_out->as<nn::Linear>()->forward(h)) : proj_out->as<nn::Conv2d>()->forward(image(h));
  return h + x;
}

UNet2DConditionModelImpl::UNet2DConditionModelImpl(UNet2DConditionConfig c) : c_(std::move(c)) {
  const auto& w = c_.block_out_channels;
  const int64_t L = static_cast<int64_t>(w.size()), g = c_.norm_num_groups, T = c_.time_embed_dim();
  const double eps = c_.norm_eps;
  conv_in = register_module("conv_in", conv(c_.in_channels, w[0], 3));
  time_embedding = register_module("time_embedding", TimeEmbedding(w[0], T).ptr());
  auto transformer = [&](int64_t ch, int64_t heads) {
    return SdTransformer(ch, heads, c_.cross_attention_dim, g, c_.use_linear_projection);
  };
  down_blocks = register_module("down_blocks", nn::ModuleList());
  for (int64_t i = 0; i < L; ++i) {
    const bool cross = c_.down_block_types[i] == "CrossAttnDownBlock2D";
    Level level(LevelImpl::Kind::kDown);
    for (int64_t j = 0; j < c_.layers_per_block; ++j) {
      level->resnets->push_back(UnetResnet(j == 0 ? (i == 0 ? w[0] : w[i - 1]) : w[i], w[i], T, g, eps));
      if (cross) level->attentions->push_back(transformer(w[i], c_.heads[i]));
    }
    if (i + 1 < L) level->add_resampler(w[i]);
    down_blocks->push_back(level);
  }
  Level mid(LevelImpl::Kind::kMid);
  mid->resnets->push_back(UnetResnet(w.back(), w.back(), T, g, eps));
  mid->attentions->push_back(transformer(w.back(), c_.heads.back()));
  mid->resnets->push_back(UnetResnet(w.back(), w.back(), T, g, eps));
  mid_block = register_module("mid_block", mid.ptr());
  up_blocks = register_module("up_blocks", nn::ModuleList());
  for (int64_t i = 0; i < L; ++i) {
    const int64_t out = w[L - 1 - i], prev = w[L - 1 - std::max<int64_t>(i - 1, 0)];
    const int64_t skip_in = w[L - 1 - std::min(i + 1, L - 1)];  // the width of the level below's skips
    const bool cross = c_.up_block_types[i] == "CrossAttnUpBlock2D";
    Level level(LevelImpl::Kind::kUp);
    const int64_t n = c_.layers_per_block + 1;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t skip = j == n - 1 ? skip_in : out, in = j == 0 ? (i == 0 ? w.back() : prev) : out;
      level->resnets->push_back(UnetResnet(in + skip, out, T, g, eps));
      if (cross) level->attentions->push_back(transformer(out, c_.heads[L - 1 - i]));
    }
    if (i + 1 < L) level->add_resampler(out);
    up_blocks->push_back(level);
  }
  conv_norm_out = register_module("conv_norm_out", group_norm(g, w[0], eps));
  conv_out = register_module("conv_out", conv(w[0], c_.out_channels, 3));
}

void UNet2DConditionModelImpl::check_inputs(const torch::Tensor& sample, const torch::Tensor& timestep,
                                            const torch::Tensor& context) const {
  const int64_t B = sample.size(0), f = int64_t{1} << (c_.block_out_channels.size() - 1);
  DDM_CHECK(sample.dim() == 4 && sample.size(1) == c_.in_channels && sample.size(2) % f == 0 && sample.size(3) % f == 0,
            "UNet2DConditionModel: the sample must be [B, " << c_.in_channels << ", H, W] with H and W multiples of "
                                                            << f << ", got " << sample.sizes());
  DDM_CHECK(timestep.dim() == 1 && timestep.size(0) == B, "UNet2DConditionModel: one timestep per sample, got "
                                                              << timestep.sizes() << " for " << B);
  DDM_CHECK(context.defined() && context.dim() == 3 && context.size(0) == B && context.size(2) == c_.cross_attention_dim,
            "UNet2DConditionModel: the context must be [" << B << ", T, " << c_.cross_attention_dim << "], got "
                                                          << (context.defined() ? context.sizes() : torch::IntArrayRef{}));
}

void UNet2DConditionModelImpl::unit_in(NetCarry& k, const torch::Tensor& timestep) {
  auto* te = time_embedding->as<TimeEmbedding>();
  const torch::Tensor t_emb = timestep_embedding(timestep, c_.block_out_channels[0]).to(k.h.dtype());  // [B, w0]
  k.emb = te->linear_2(F::silu(te->linear_1(t_emb)));                                                 // [B, 4 w0]
  k.h = conv_in(k.h);                                                                                  // [B, w0, H, W]
  k.skips = {k.h};
}

void UNet2DConditionModelImpl::unit_down(NetCarry& k, size_t i, size_t j, const torch::Tensor& context) {
  auto* level = down_blocks[i]->as<Level>();
  k.h = level->attend(j, level->resnet(j, k.h, k.emb), context);  // [B, w_i, H_i, W_i]
  k.skips.push_back(k.h);
}

void UNet2DConditionModelImpl::unit_downsample(NetCarry& k, size_t i) {
  k.h = down_blocks[i]->as<Level>()->resample(k.h);  // [B, w_i, H_i / 2, W_i / 2]
  k.skips.push_back(k.h);
}

void UNet2DConditionModelImpl::unit_mid(NetCarry& k, const torch::Tensor& context) {
  auto* mid = mid_block->as<Level>();
  k.h = mid->resnet(1, mid->attend(0, mid->resnet(0, k.h, k.emb), context), k.emb);  // [B, w[-1], H/f, W/f]
}

void UNet2DConditionModelImpl::unit_up(NetCarry& k, size_t i, size_t j, const torch::Tensor& context) {
  auto* level = up_blocks[i]->as<Level>();
  k.h = torch::cat({k.h, k.skips.back()}, 1);  // [B, in + skip, h, w]
  k.skips.pop_back();
  k.h = level->attend(j, level->resnet(j, k.h, k.emb), context);  // [B, out, h, w]
}

void UNet2DConditionModelImpl::unit_upsample(NetCarry& k, size_t i) {  // nearest 2x, then a conv
  k.h = up_blocks[i]->as<Level>()->resample(
      F::interpolate(k.h, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)));
}

void UNet2DConditionModelImpl::unit_out(NetCarry& k) {
  k.h = conv_out(F::silu(conv_norm_out(k.h)));  // [B, out_channels, H, W]
  k.emb = torch::Tensor();
}

torch::Tensor UNet2DConditionModelImpl::forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                                                const torch::Tensor& context) {
  check_inputs(sample, timestep, context);
  NetCarry k{sample, {}, {}};
  unit_in(k, timestep);
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    for (size_t j = 0; j < down_blocks[i]->as<Level>()->resnets->size(); ++j) unit_down(k, i, j, context);
    if (down_blocks[i]->as<Level>()->resample) unit_downsample(k, i);
  }
  unit_mid(k, context);
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    for (size_t j = 0; j < up_blocks[i]->as<Level>()->resnets->size(); ++j) unit_up(k, i, j, context);
    if (up_blocks[i]->as<Level>()->resample) unit_upsample(k, i);
  }
  unit_out(k);
  return k.h;  // [B, out_channels, H, W]
}

std::vector<NetUnit> UNet2DConditionModelImpl::units(std::function<torch::Tensor(const torch::Tensor&)> timestep) {
  std::vector<NetUnit> u;
  auto params = [](std::initializer_list<const nn::Module*> ms) {
    std::vector<torch::Tensor> out;
    for (const nn::Module* m : ms)
      if (m)
        for (const torch::Tensor& p : m->parameters()) out.push_back(p);
    return out;
  };
  auto at = [](nn::ModuleList list, size_t j) -> const nn::Module* { return j < list->size() ? list[j].get() : nullptr; };
  u.push_back({"in",
               [this, timestep](NetCarry& k, const torch::Tensor& t, const Cond& c) {
                 check_inputs(k.h, t, c.context);
                 unit_in(k, timestep(t));
               },
               params({conv_in.get(), time_embedding.get()})});
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    auto* level = down_blocks[i]->as<Level>();
    for (size_t j = 0; j < level->resnets->size(); ++j)
      u.push_back({"down" + std::to_string(i) + "_" + std::to_string(j),
                   [this, i, j](NetCarry& k, const torch::Tensor&, const Cond& c) { unit_down(k, i, j, c.context); },
                   params({at(level->resnets, j), at(level->attentions, j)})});
    if (level->resample)
      u.push_back({"downsample" + std::to_string(i), [this, i](NetCarry& k, const torch::Tensor&, const Cond&) { unit_downsample(k, i); },
                   params({level->samplers.get()})});
  }
  u.push_back({"mid", [this](NetCarry& k, const torch::Tensor&, const Cond& c) { unit_mid(k, c.context); },
               params({mid_block.get()})});
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    auto* level = up_blocks[i]->as<Level>();
    for (size_t j = 0; j < level->resnets->size(); ++j)
      u.push_back({"up" + std::to_string(i) + "_" + std::to_string(j),
                   [this, i, j](NetCarry& k, const torch::Tensor&, const Cond& c) { unit_up(k, i, j, c.context); },
                   params({at(level->resnets, j), at(level->attentions, j)})});
    if (level->resample)
      u.push_back({"upsample" + std::to_string(i), [this, i](NetCarry& k, const torch::Tensor&, const Cond&) { unit_upsample(k, i); },
                   params({level->samplers.get()})});
  }
  u.push_back({"out", [this](NetCarry& k, const torch::Tensor&, const Cond&) { unit_out(k); },
               params({conv_norm_out.get(), conv_out.get()})});
  return u;
}

double unet_2d_condition_flops(const UNet2DConditionConfig& c, int64_t H, int64_t W, int64_t tokens) {
  const auto& w = c.block_out_channels;
  const int64_t L = static_cast<int64_t>(w.size()), temb = c.time_embed_dim();
  const double T = static_cast<double>(tokens), ctx = static_cast<double>(c.cross_attention_dim);
  auto conv = [](double in, double out, double k, double n) { return 2 * in * out * k * k * n; };
  auto resnet = [&](double in, double out, double n) {
    return conv(in, out, 3, n) + conv(out, out, 3, n) + (in != out ? conv(in, out, 1, n) : 0.0) + 2.0 * temb * out;
  };
  auto transformer = [&](double ch, double n) {
    const double proj = 2 * 2 * n * ch * ch;                                    // proj_in, proj_out
    const double self = 4 * 2 * n * ch * ch + 2 * 2 * n * n * ch;                // q, k, v, out; scores, values
    const double cross = 2 * 2 * n * ch * ch + 2 * 2 * T * ctx * ch + 2 * 2 * n * T * ch;
    const double ff = 2 * n * ch * 8 * ch + 2 * n * 4 * ch * ch;                 // GEGLU in, out
    return proj + self + cross + ff;
  };
  double n = static_cast<double>(H * W), f = conv(c.in_channels, w[0], 3, n) + 2.0 * (w[0] * temb + temb * temb);
  std::vector<int64_t> skips{w[0]};
  int64_t ch = w[0];
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < c.layers_per_block; ++j) {
      f += resnet(ch, w[i], n) + (c.down_block_types[i] == "CrossAttnDownBlock2D" ? transformer(w[i], n) : 0.0);
      ch = w[i];
      skips.push_back(ch);
    }
    if (i + 1 < L) {
      n /= 4;
      f += conv(ch, ch, 3, n);  // stride 2
      skips.push_back(ch);
    }
  }
  f += 2 * resnet(ch, ch, n) + transformer(ch, n);  // the middle
  for (int64_t i = 0; i < L; ++i) {
    const int64_t out = w[L - 1 - i];
    for (int64_t j = 0; j <= c.layers_per_block; ++j) {
      f += resnet(ch + skips.back(), out, n) + (c.up_block_types[i] == "CrossAttnUpBlock2D" ? transformer(out, n) : 0.0);
      skips.pop_back();
      ch = out;
    }
    if (i + 1 < L) {
      n *= 4;
      f += conv(ch, ch, 3, n);  // after the nearest 2x
    }
  }
  return f + conv(w[0], c.out_channels, 3, n);
}

UNet2DConditionConfig load_unet_2d_condition_config(const std::string& dir) {
  const std::string config_file = (fs::path(dir) / "config.json").string();
  DDM_CHECK(fs::is_regular_file(config_file), dir << ": no config.json (a diffusers UNet2DConditionModel directory "
                                                  << "holds config.json and diffusion_pytorch_model.safetensors)");
  return parse_unet_2d_condition_config(read_json_file(config_file), config_file);
}

UNet2DConditionModel load_unet_2d_condition(const std::string& dir) {
  UNet2DConditionModel model(load_unet_2d_condition_config(dir));
  load_diffusers_weights(*model, dir, (fs::path(dir) / "config.json").string());
  return model;
}

void save_unet_2d_condition(UNet2DConditionModel& model, const std::string& dir) {
  save_diffusers_model(*model, unet_2d_condition_config_json(model->config()), dir);
}

}  // namespace ddm::sd
