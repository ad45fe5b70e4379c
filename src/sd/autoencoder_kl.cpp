// diffusers' AutoencoderKL in LibTorch, under diffusers' parameter names (see autoencoder_kl.h).
#include "sd/autoencoder_kl.h"

#include <filesystem>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/nn/functional.h>
#include <torch/torch.h>

#include "core/error.h"
#include "core/json.h"
#include "model/ops.h"
#include "sd/diffusers_weights.h"

namespace fs = std::filesystem;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace ddm::sd {
namespace {

constexpr double kEps = 1e-6;  // every GroupNorm's, as diffusers builds the VAE

nn::GroupNorm group_norm(int64_t groups, int64_t ch) { return nn::GroupNorm(nn::GroupNormOptions(groups, ch).eps(kEps)); }
nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride = 1, int64_t padding = -1) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, k).stride(stride).padding(padding < 0 ? k / 2 : padding));
}

// A resampler's module: its one parameter set is "conv".
struct ResampleImpl : nn::Module {
  explicit ResampleImpl(int64_t ch, bool down) { conv = register_module("conv", down ? sd::conv(ch, ch, 3, 2, 0) : sd::conv(ch, ch, 3)); }
  nn::Conv2d conv{nullptr};
};
TORCH_MODULE(Resample);

using json = nlohmann::json;

}  // namespace

AutoencoderKLConfig parse_autoencoder_kl_config(const json& j, const std::string& file) {
  DDM_CHECK(j.is_object(), file << ": not a JSON object");
  const std::set<std::string> known = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values",
                                       "in_channels", "out_channels", "down_block_types", "up_block_types",
                                       "block_out_channels", "layers_per_block", "act_fn", "latent_channels",
                                       "norm_num_groups", "sample_size", "scaling_factor", "shift_factor",
                                       "latents_mean", "latents_std", "force_upcast", "use_quant_conv",
                                       "use_post_quant_conv", "mid_block_add_attention"};
  for (const auto& [key, value] : j.items())
    DDM_CHECK(known.count(key), file << ": \"" << key << "\" is not a key of diffusers' AutoencoderKL that ddm reads "
                                     << "(a newer diffusers, or another model's config?); ddm does not ignore what it "
                                     << "does not know");
  const ConfigReader r{j, file};
  std::string cls;
  r.string("_class_name", cls);
  DDM_CHECK(cls == "AutoencoderKL", file << ": _class_name \"" << cls << "\": ddm reads diffusers' AutoencoderKL here");
  AutoencoderKLConfig c;
  r.integer("in_channels", c.in_channels, 1, 64);
  r.integer("out_channels", c.out_channels, 1, 64);
  r.integer("latent_channels", c.latent_channels, 1, 1024);
  r.integer("layers_per_block", c.layers_per_block, 1, 64);
  r.integer("norm_num_groups", c.norm_num_groups, 1, 1024);
  r.integer("sample_size", c.sample_size, 1, 1 << 16);
  r.number("scaling_factor", c.scaling_factor);
  r.number("shift_factor", c.shift_factor);
  r.boolean("force_upcast", c.force_upcast);
  r.boolean("use_quant_conv", c.use_quant_conv);
  r.boolean("use_post_quant_conv", c.use_post_quant_conv);
  r.boolean("mid_block_add_attention", c.mid_block_add_attention);
  DDM_CHECK(c.scaling_factor > 0, file << ": scaling_factor must be > 0, got " << c.scaling_factor);
  r.widths("block_out_channels", c.block_out_channels);
  const size_t levels = c.block_out_channels.size();
  auto types = [&](const char* key, const char* want) {
    if (!j.contains(key)) {
      DDM_CHECK(levels == 1, file << ": no " << key << " for the " << levels << " levels of block_out_channels");
      return;
    }
    const json& t = j[key];
    DDM_CHECK(t.is_array() && t.size() == levels,
              file << ": " << key << " must name " << levels << " blocks (one per block_out_channels), got " << t.dump());
    for (const auto& v : t)
      DDM_CHECK(v.is_string() && v.get<std::string>() == want,
                file << ": " << key << " holds " << v.dump() << "; ddm builds " << want << " blocks only");
  };
  types("down_block_types", "DownEncoderBlock2D");
  types("up_block_types", "UpDecoderBlock2D");
  std::string act = "silu";
  r.string("act_fn", act);
  DDM_CHECK(act == "silu", file << ": act_fn \"" << act << "\": ddm's AutoencoderKL uses silu, as Stable Diffusion's");
  for (const char* key : {"latents_mean", "latents_std"})
    DDM_CHECK(!j.contains(key) || j[key].is_null(),
              file << ": " << key << " is set: latents normalized per channel are not supported yet (Stable "
                   << "Diffusion's VAEs leave it null)");
  for (int64_t w : c.block_out_channels)
    DDM_CHECK(w % c.norm_num_groups == 0,
              file << ": norm_num_groups " << c.norm_num_groups << " does not divide the width " << w);
  return c;
}

json autoencoder_kl_config_json(const AutoencoderKLConfig& c) {
  const size_t levels = c.block_out_channels.size();
  return {{"_class_name", "AutoencoderKL"},
          {"_diffusers_version", "0.42.1"},
          {"act_fn", "silu"},
          {"block_out_channels", c.block_out_channels},
          {"down_block_types", std::vector<std::string>(levels, "DownEncoderBlock2D")},
          {"force_upcast", c.force_upcast},
          {"in_channels", c.in_channels},
          {"latent_channels", c.latent_channels},
          {"latents_mean", nullptr},
          {"latents_std", nullptr},
          {"layers_per_block", c.layers_per_block},
          {"mid_block_add_attention", c.mid_block_add_attention},
          {"norm_num_groups", c.norm_num_groups},
          {"out_channels", c.out_channels},
          {"sample_size", c.sample_size},
          {"scaling_factor", c.scaling_factor},
          {"shift_factor", c.shift_factor == 0 ? json(nullptr) : json(c.shift_factor)},
          {"up_block_types", std::vector<std::string>(levels, "UpDecoderBlock2D")},
          {"use_post_quant_conv", c.use_post_quant_conv},
          {"use_quant_conv", c.use_quant_conv}};
}

VaeResnetImpl::VaeResnetImpl(int64_t in, int64_t out, int64_t groups) {
  norm1 = register_module("norm1", group_norm(groups, in));
  conv1 = register_module("conv1", conv(in, out, 3));
  norm2 = register_module("norm2", group_norm(groups, out));
  conv2 = register_module("conv2", conv(out, out, 3));
  if (in != out) conv_shortcut = register_module("conv_shortcut", conv(in, out, 1));
}

torch::Tensor VaeResnetImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = conv1(group_norm_silu(norm1, x));  // [B, out, H, W]
  h = conv2(group_norm_silu(norm2, h));                 // [B, out, H, W]
  return (conv_shortcut ? conv_shortcut(x) : x) + h;
}

VaeAttentionImpl::VaeAttentionImpl(int64_t ch, int64_t groups) {
  group_norm = register_module("group_norm", sd::group_norm(groups, ch));
  to_q = register_module("to_q", nn::Linear(ch, ch));
  to_k = register_module("to_k", nn::Linear(ch, ch));
  to_v = register_module("to_v", nn::Linear(ch, ch));
  to_out = register_module("to_out", nn::ModuleList());
  to_out->push_back(nn::Linear(ch, ch));
}

torch::Tensor VaeAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const torch::Tensor h =
      group_norm_act(group_norm, x, /*silu=*/false).reshape({B, C, H * W}).transpose(1, 2);  // [B, HW, C]
  // One head: [B, 1, HW, C], scaled by 1/sqrt(C).
  const torch::Tensor a =
      at::scaled_dot_product_attention(apply_linear(to_q, h).unsqueeze(1), apply_linear(to_k, h).unsqueeze(1),
                                       apply_linear(to_v, h).unsqueeze(1))
          .squeeze(1);                                                           // [B, HW, C]
  const torch::Tensor o = apply_linear(*to_out[0]->as<nn::Linear>(), a);        // [B, HW, C]
  return x + o.transpose(1, 2).reshape({B, C, H, W});
}

VaeMidBlockImpl::VaeMidBlockImpl(int64_t ch, int64_t groups, bool attention) {
  resnets = register_module("resnets", nn::ModuleList());
  attentions = register_module("attentions", nn::ModuleList());
  resnets->push_back(VaeResnet(ch, ch, groups));
  if (attention) attentions->push_back(VaeAttention(ch, groups));
  resnets->push_back(VaeResnet(ch, ch, groups));
}

torch::Tensor VaeMidBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = resnets[0]->as<VaeResnet>()->forward(x);            // [B, ch, H, W]
  if (!attentions->is_empty()) h = attentions[0]->as<VaeAttention>()->forward(h);
  return resnets[1]->as<VaeResnet>()->forward(h);
}

VaeBlockImpl::VaeBlockImpl(int64_t in, int64_t out, int64_t layers, int64_t groups, Resample resample)
    : resample_(resample) {
  resnets = register_module("resnets", nn::ModuleList());
  for (int64_t i = 0; i < layers; ++i) resnets->push_back(VaeResnet(i == 0 ? in : out, out, groups));
  if (resample == Resample::kNone) return;
  samplers = register_module(resample == Resample::kDown ? "downsamplers" : "upsamplers", nn::ModuleList());
  sd::Resample r(out, resample == Resample::kDown);
  conv = r->conv;
  samplers->push_back(r);
}

torch::Tensor VaeBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x;
  for (const auto& m : *resnets) h = m->as<VaeResnet>()->forward(h);  // [B, out, H, W]
  if (resample_ == Resample::kDown)  // zero padding right and bottom, then stride 2: [B, out, H/2, W/2]
    return conv(torch::constant_pad_nd(h, {0, 1, 0, 1}));
  if (resample_ == Resample::kUp)  // nearest 2x, then a conv: [B, out, 2H, 2W]
    return conv(F::interpolate(h, F::InterpolateFuncOptions().scale_factor(std::vector<double>{2.0, 2.0}).mode(torch::kNearest)));
  return h;
}

VaeEncoderImpl::VaeEncoderImpl(const AutoencoderKLConfig& c) {
  const auto& w = c.block_out_channels;
  const int64_t g = c.norm_num_groups, L = static_cast<int64_t>(w.size());
  conv_in = register_module("conv_in", conv(c.in_channels, w[0], 3));
  down_blocks = register_module("down_blocks", nn::ModuleList());
  for (int64_t i = 0; i < L; ++i)
    down_blocks->push_back(VaeBlock(i == 0 ? w[0] : w[i - 1], w[i], c.layers_per_block, g,
                                    i + 1 < L ? VaeBlockImpl::Resample::kDown : VaeBlockImpl::Resample::kNone));
  mid_block = register_module("mid_block", VaeMidBlock(w.back(), g, c.mid_block_add_attention));
  conv_norm_out = register_module("conv_norm_out", group_norm(g, w.back()));
  conv_out = register_module("conv_out", conv(w.back(), 2 * c.latent_channels, 3));
}

torch::Tensor VaeEncoderImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = conv_in(x);                                       // [B, w0, S, S]
  for (const auto& m : *down_blocks) h = m->as<VaeBlock>()->forward(h);  // [B, w[-1], S/f, S/f]
  h = mid_block(h);
  return conv_out(group_norm_silu(conv_norm_out, h));  // [B, 2z, S/f, S/f]
}

VaeDecoderImpl::VaeDecoderImpl(const AutoencoderKLConfig& c) {
  const std::vector<int64_t> w(c.block_out_channels.rbegin(), c.block_out_channels.rend());  // widest first
  const int64_t g = c.norm_num_groups, L = static_cast<int64_t>(w.size());
  conv_in = register_module("conv_in", conv(c.latent_channels, w[0], 3));
  mid_block = register_module("mid_block", VaeMidBlock(w[0], g, c.mid_block_add_attention));
  up_blocks = register_module("up_blocks", nn::ModuleList());
  for (int64_t i = 0; i < L; ++i)
    up_blocks->push_back(VaeBlock(i == 0 ? w[0] : w[i - 1], w[i], c.layers_per_block + 1, g,
                                  i + 1 < L ? VaeBlockImpl::Resample::kUp : VaeBlockImpl::Resample::kNone));
  conv_norm_out = register_module("conv_norm_out", group_norm(g, w.back()));
  conv_out = register_module("conv_out", conv(w.back(), c.out_channels, 3));
}

torch::Tensor VaeDecoderImpl::forward(const torch::Tensor& z) {
  torch::Tensor h = mid_block(conv_in(z));                           // [B, w[-1], h, w]
  for (const auto& m : *up_blocks) h = m->as<VaeBlock>()->forward(h);  // [B, w0, h*f, w*f]
  return conv_out(group_norm_silu(conv_norm_out, h));  // [B, out_channels, h*f, w*f]
}

AutoencoderKLImpl::AutoencoderKLImpl(AutoencoderKLConfig c) : c_(std::move(c)) {
  encoder = register_module("encoder", VaeEncoder(c_));
  decoder = register_module("decoder", VaeDecoder(c_));
  const int64_t z = c_.latent_channels;
  if (c_.use_quant_conv) quant_conv = register_module("quant_conv", conv(2 * z, 2 * z, 1));
  if (c_.use_post_quant_conv) post_quant_conv = register_module("post_quant_conv", conv(z, z, 1));
}

std::pair<torch::Tensor, torch::Tensor> AutoencoderKLImpl::encode(const torch::Tensor& x) {
  DDM_CHECK(x.dim() == 4 && x.size(1) == c_.in_channels && x.size(2) % c_.factor() == 0 && x.size(3) % c_.factor() == 0,
            "AutoencoderKL: images must be [B, " << c_.in_channels << ", H, W] with H and W multiples of "
                                                 << c_.factor() << ", got " << x.sizes());
  torch::Tensor moments = encoder(x);                  // [B, 2z, h, w]
  if (quant_conv) moments = quant_conv(moments);
  auto parts = moments.chunk(2, 1);                    // mean, logvar: [B, z, h, w] each
  return {parts[0], parts[1].clamp(-30.0, 20.0)};
}

torch::Tensor AutoencoderKLImpl::decode(const torch::Tensor& z) {
  DDM_CHECK(z.dim() == 4 && z.size(1) == c_.latent_channels,
            "AutoencoderKL: latents must be [B, " << c_.latent_channels << ", h, w], got " << z.sizes());
  return decoder(post_quant_conv ? post_quant_conv(z) : z);  // [B, out_channels, h*f, w*f]
}

AutoencoderKL load_autoencoder_kl(const std::string& dir) {
  std::string config_file;
  const nlohmann::json j = read_model_config(dir, "AutoencoderKL", config_file);
  AutoencoderKL model(parse_autoencoder_kl_config(j, config_file));
  load_diffusers_weights(*model, dir, config_file);
  model->eval();
  return model;
}

void save_autoencoder_kl(AutoencoderKL& model, const std::string& dir) {
  save_diffusers_model(*model, autoencoder_kl_config_json(model->config()), dir);
}

}  // namespace ddm::sd
