// diffusers' ControlNetModel in LibTorch, under diffusers' parameter names (see controlnet_model.h).
#include "sd/controlnet_model.h"

#include <filesystem>
#include <map>

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

nn::Conv2d zero_conv(int64_t in, int64_t out, int64_t k) {
  nn::Conv2d c = sd_conv(in, out, k);
  torch::NoGradGuard no_grad;
  c->weight.zero_();
  c->bias.zero_();
  return c;
}

// The keys of diffusers' ControlNetModel that ddm does not build on, with the value (diffusers'
// default) they must have.
const std::map<std::string, json>& fixed_keys() {
  static const std::map<std::string, json> keys = {
      {"flip_sin_to_cos", true}, {"freq_shift", 0}, {"mid_block_type", "UNetMidBlock2DCrossAttn"},
      {"only_cross_attention", false}, {"downsample_padding", 1}, {"mid_block_scale_factor", 1},
      {"act_fn", "silu"}, {"transformer_layers_per_block", 1}, {"encoder_hid_dim", nullptr},
      {"encoder_hid_dim_type", nullptr}, {"num_attention_heads", nullptr}, {"class_embed_type", nullptr},
      {"addition_embed_type", nullptr}, {"addition_time_embed_dim", nullptr}, {"num_class_embeds", nullptr},
      {"resnet_time_scale_shift", "default"}, {"projection_class_embeddings_input_dim", nullptr},
      {"global_pool_conditions", false}};
  return keys;
}

}  // namespace

ControlNetModelConfig parse_controlnet_model_config(const json& j, const std::string& file) {
  ControlNetModelConfig c;
  c.unet = parse_unet_config_keys(j, file, "ControlNetModel",
                                  {"conditioning_channels", "controlnet_conditioning_channel_order",
                                   "conditioning_embedding_out_channels"},
                                  fixed_keys());
  c.unet.out_channels = c.unet.in_channels;
  const ConfigReader r{j, file};
  r.integer("conditioning_channels", c.conditioning_channels, 1, 1024);
  r.widths("conditioning_embedding_out_channels", c.conditioning_embedding_out_channels);
  std::string order = "rgb";
  r.string("controlnet_conditioning_channel_order", order);
  DDM_CHECK(order == "rgb" || order == "bgr", file << ": controlnet_conditioning_channel_order = \"" << order
                                                   << "\"; diffusers knows rgb and bgr");
  c.bgr = order == "bgr";
  return c;
}

json controlnet_model_config_json(const ControlNetModelConfig& c) {
  json j = {{"_class_name", "ControlNetModel"}, {"_diffusers_version", "0.42.1"}};
  j.update(unet_config_keys_json(c.unet));
  j["conditioning_channels"] = c.conditioning_channels;
  j["conditioning_embedding_out_channels"] = c.conditioning_embedding_out_channels;
  j["controlnet_conditioning_channel_order"] = c.bgr ? "bgr" : "rgb";
  for (const auto& [key, value] : fixed_keys()) j[key] = value;
  return j;
}

ControlNetModelConfig controlnet_config_from_unet(const UNet2DConditionConfig& unet, int64_t conditioning_channels,
                                                  std::vector<int64_t> embedding_widths) {
  DDM_CHECK(conditioning_channels >= 1 && !embedding_widths.empty(),
            "a ControlNet needs >= 1 conditioning channels and >= 1 embedding widths");
  ControlNetModelConfig c;
  c.unet = unet;
  c.unet.out_channels = unet.in_channels;
  c.conditioning_channels = conditioning_channels;
  c.conditioning_embedding_out_channels = std::move(embedding_widths);
  return c;
}

ControlNetConditioningEmbeddingImpl::ControlNetConditioningEmbeddingImpl(int64_t out, int64_t in,
                                                                         const std::vector<int64_t>& widths) {
  conv_in = register_module("conv_in", sd_conv(in, widths.front(), 3));
  blocks = register_module("blocks", nn::ModuleList());
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    blocks->push_back(sd_conv(widths[i], widths[i], 3));
    blocks->push_back(sd_conv(widths[i], widths[i + 1], 3, 2));
  }
  conv_out = register_module("conv_out", zero_conv(widths.back(), out, 3));
}

torch::Tensor ControlNetConditioningEmbeddingImpl::forward(const torch::Tensor& cond) {
  torch::Tensor h = F::silu(conv_in(cond));                          // [B, e0, H f, W f]
  for (const auto& b : *blocks) h = F::silu(b->as<nn::Conv2d>()->forward(h));  // halved by every second
  return conv_out(h);                                                // [B, w0, H, W]
}

ControlNetModelImpl::ControlNetModelImpl(ControlNetModelConfig c) : c_(std::move(c)) {
  const auto& u = c_.unet;
  const auto& w = u.block_out_channels;
  conv_in = register_module("conv_in", sd_conv(u.in_channels, w[0], 3));
  time_embedding = register_module("time_embedding", TimeEmbedding(w[0], u.time_embed_dim()));
  controlnet_cond_embedding = register_module(
      "controlnet_cond_embedding",
      ControlNetConditioningEmbedding(w[0], c_.conditioning_channels, c_.conditioning_embedding_out_channels));
  down_blocks = register_module("down_blocks", make_down_blocks(u));
  controlnet_down_blocks = register_module("controlnet_down_blocks", nn::ModuleList());
  controlnet_down_blocks->push_back(zero_conv(w[0], w[0], 1));
  for (size_t i = 0; i < w.size(); ++i) {
    for (int64_t j = 0; j < u.layers_per_block; ++j) controlnet_down_blocks->push_back(zero_conv(w[i], w[i], 1));
    if (i + 1 < w.size()) controlnet_down_blocks->push_back(zero_conv(w[i], w[i], 1));
  }
  controlnet_mid_block = register_module("controlnet_mid_block", zero_conv(w.back(), w.back(), 1));
  mid_block = register_module("mid_block", make_mid_block(u));
}

void ControlNetModelImpl::check_inputs(const torch::Tensor& sample, const torch::Tensor& timestep,
                                       const torch::Tensor& context, const torch::Tensor& cond) const {
  const auto& u = c_.unet;
  const int64_t B = sample.size(0), f = c_.hint_factor(), down = int64_t{1} << (u.block_out_channels.size() - 1);
  DDM_CHECK(sample.dim() == 4 && sample.size(1) == u.in_channels && sample.size(2) % down == 0 &&
                sample.size(3) % down == 0,
            "ControlNetModel: the sample must be [B, " << u.in_channels << ", H, W] with H and W multiples of " << down
                                                       << ", got " << sample.sizes());
  DDM_CHECK(timestep.dim() == 1 && timestep.size(0) == B,
            "ControlNetModel: one timestep per sample, got " << timestep.sizes() << " for " << B);
  DDM_CHECK(context.defined() && context.dim() == 3 && context.size(0) == B && context.size(2) == u.cross_attention_dim,
            "ControlNetModel: the context must be [" << B << ", T, " << u.cross_attention_dim << "], got "
                                                     << (context.defined() ? context.sizes() : torch::IntArrayRef{}));
  DDM_CHECK(cond.defined() && cond.dim() == 4 && cond.size(0) == B && cond.size(1) == c_.conditioning_channels &&
                cond.size(2) == sample.size(2) * f && cond.size(3) == sample.size(3) * f,
            "ControlNetModel: the control image must be [" << B << ", " << c_.conditioning_channels << ", "
                                                           << sample.size(2) * f << ", " << sample.size(3) * f
                                                           << "] (" << f << " x the sample's size), got "
                                                           << (cond.defined() ? cond.sizes() : torch::IntArrayRef{}));
}

void ControlNetModelImpl::unit_in(NetCarry& k, const torch::Tensor& timestep, const torch::Tensor& cond) {
  k.emb = time_embedding(timestep, k.h.scalar_type());                                   // [B, 4 w0]
  const torch::Tensor hint = controlnet_cond_embedding(c_.bgr ? cond.flip({1}) : cond);  // [B, w0, H, W]
  k.h = conv_in(k.h) + hint;                                                              // [B, w0, H, W]
  k.skips = {k.h};
}

UNetResiduals ControlNetModelImpl::residuals(const std::vector<torch::Tensor>& skips, const torch::Tensor& mid,
                                             double scale) {
  DDM_CHECK(skips.size() == controlnet_down_blocks->size(),
            "ControlNetModel: " << skips.size() << " skips for " << controlnet_down_blocks->size() << " zero convolutions");
  UNetResiduals r;
  for (size_t i = 0; i < skips.size(); ++i) r.down.push_back(controlnet_down_blocks[i]->as<nn::Conv2d>()->forward(skips[i]));
  r.mid = controlnet_mid_block(mid);  // [B, w[-1], h, w]
  if (scale != 1.0) {
    for (auto& t : r.down) t = t * scale;
    r.mid = r.mid * scale;
  }
  return r;
}

std::vector<torch::Tensor> ControlNetModelImpl::zero_parameters() const {
  std::vector<torch::Tensor> out = controlnet_down_blocks->parameters();
  for (const auto& p : controlnet_mid_block->parameters()) out.push_back(p);
  return out;
}

UNetResiduals ControlNetModelImpl::forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                                           const torch::Tensor& context, const torch::Tensor& cond,
                                           double conditioning_scale) {
  check_inputs(sample, timestep, context, cond);
  NetCarry k{sample, {}, {}};
  unit_in(k, timestep, cond);
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    auto* level = down_blocks[i]->as<Level>();
    for (size_t j = 0; j < level->resnets->size(); ++j) down_step(*level, k, j, context);
    if (level->resample) downsample_step(*level, k);
  }
  k.h = mid_forward(*mid_block, k.h, k.emb, context);  // [B, w[-1], H / f, W / f]
  return residuals(k.skips, k.h, conditioning_scale);
}

std::vector<NetUnit> ControlNetModelImpl::units(std::function<torch::Tensor(const torch::Tensor&)> timestep,
                                                std::function<torch::Tensor(const Cond&)> control) {
  std::vector<NetUnit> u;
  u.push_back({"in",
               [this, timestep, control](NetCarry& k, const torch::Tensor& t, const Cond& c) {
                 const torch::Tensor ts = timestep(t), cond = control(c);
                 check_inputs(k.h, ts, c.context, cond);
                 unit_in(k, ts, cond);
               },
               params_of({conv_in.get(), time_embedding.get(), controlnet_cond_embedding.get()})});
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    auto* level = down_blocks[i]->as<Level>();
    for (size_t j = 0; j < level->resnets->size(); ++j)
      u.push_back({"down" + std::to_string(i) + "_" + std::to_string(j),
                   [level, j](NetCarry& k, const torch::Tensor&, const Cond& c) { down_step(*level, k, j, c.context); },
                   params_of({item_or_null(level->resnets, j), item_or_null(level->attentions, j)})});
    if (level->resample)
      u.push_back({"downsample" + std::to_string(i),
                   [level](NetCarry& k, const torch::Tensor&, const Cond&) { downsample_step(*level, k); },
                   params_of({level->samplers.get()})});
  }
  u.push_back({"mid",
               [this](NetCarry& k, const torch::Tensor&, const Cond& c) {
                 k.h = mid_forward(*mid_block, k.h, k.emb, c.context);  // [B, w[-1], h, w]
               },
               params_of({mid_block.get()})});
  return u;
}

std::string controlnet_mismatch(const ControlNetModelConfig& c, const UNet2DConditionConfig& u) {
  const json a = unet_config_keys_json(c.unet), b = unet_config_keys_json(u);
  for (const auto& [key, value] : a.items())
    if (b.at(key) != value) return key + " is " + value.dump() + " in the ControlNet, " + b.at(key).dump() + " in the UNet";
  return "";
}

void ControlNetModelImpl::copy_encoder_from(const UNet2DConditionModelImpl& unet) {
  const std::string differs = controlnet_mismatch(c_, unet.config());
  DDM_CHECK(differs.empty(), "ControlNetModel: its encoder differs from the UNet's (" << differs
                                                                                     << "): it is not a ControlNet of that UNet");
  const auto from = unet.named_parameters();
  torch::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const std::string& key = p.key();
    const bool encoder = key.rfind("conv_in.", 0) == 0 || key.rfind("time_embedding.", 0) == 0 ||
                         key.rfind("down_blocks.", 0) == 0 || key.rfind("mid_block.", 0) == 0;
    if (!encoder) continue;
    const torch::Tensor* src = from.find(key);
    DDM_CHECK(src && src->sizes() == p.value().sizes(), "ControlNetModel: the UNet has no parameter " << key
                                                                                                      << " of its shape");
    p.value().copy_(*src);
  }
}

double controlnet_model_flops(const ControlNetModelConfig& c, int64_t H, int64_t W, int64_t tokens) {
  std::vector<int64_t> skips;
  double n = 0;
  double f = flops_of::encoder(c.unet, H, W, tokens, skips, n);
  // The zero convolutions, at each skip's resolution, and the middle's.
  const auto& w = c.unet.block_out_channels;
  double px = static_cast<double>(H * W);
  f += flops_of::conv(w[0], w[0], 1, px);
  for (size_t i = 0; i < w.size(); ++i) {
    f += static_cast<double>(c.unet.layers_per_block) * flops_of::conv(w[i], w[i], 1, px);
    if (i + 1 < w.size()) {
      px /= 4;
      f += flops_of::conv(w[i], w[i], 1, px);
    }
  }
  f += flops_of::conv(w.back(), w.back(), 1, px);
  // The conditioning embedding, from the control image's resolution down to the sample's.
  const auto& e = c.conditioning_embedding_out_channels;
  const double fac = static_cast<double>(c.hint_factor());
  double hp = static_cast<double>(H * W) * fac * fac;
  f += flops_of::conv(c.conditioning_channels, e[0], 3, hp);
  for (size_t i = 0; i + 1 < e.size(); ++i) {
    f += flops_of::conv(e[i], e[i], 3, hp);
    hp /= 4;
    f += flops_of::conv(e[i], e[i + 1], 3, hp);
  }
  return f + flops_of::conv(e.back(), w[0], 3, hp);
}

ControlNetModelConfig load_controlnet_model_config(const std::string& dir) {
  std::string file;
  const nlohmann::json j = read_model_config(dir, "ControlNetModel", file);
  return parse_controlnet_model_config(j, file);
}

ControlNetModel load_controlnet_model(const std::string& dir) {
  ControlNetModel model(load_controlnet_model_config(dir));
  load_diffusers_weights(*model, dir, (fs::path(dir) / "config.json").string());
  return model;
}

void save_controlnet_model(ControlNetModel& model, const std::string& dir) {
  save_diffusers_model(*model, controlnet_model_config_json(model->config()), dir);
}

}  // namespace ddm::sd
