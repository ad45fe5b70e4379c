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
#include "model/ops.h"
#include "sd/diffusers_weights.h"

namespace fs = std::filesystem;
namespace nn = torch::nn;
namespace F = torch::nn::functional;

namespace ddm::sd {
namespace {

using json = nlohmann::json;


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
  UNet2DConditionConfig c = parse_unet_config_keys(j, file, "UNet2DConditionModel",
                                                   {"out_channels", "sample_size", "up_block_types"}, fixed_keys());
  const ConfigReader r{j, file};
  r.integer("out_channels", c.out_channels, 1, 1024);
  r.integer("sample_size", c.sample_size, 1, 1 << 16);
  return c;
}

json unet_2d_condition_config_json(const UNet2DConditionConfig& c) {
  json j = {{"_class_name", "UNet2DConditionModel"}, {"_diffusers_version", "0.42.1"}};
  j.update(unet_config_keys_json(c));
  j["out_channels"] = c.out_channels;
  j["sample_size"] = c.sample_size;
  j["up_block_types"] = c.up_block_types;
  for (const auto& [key, value] : fixed_keys()) j[key] = value;
  return j;
}

UNet2DConditionModelImpl::UNet2DConditionModelImpl(UNet2DConditionConfig c) : c_(std::move(c)) {
  const auto& w = c_.block_out_channels;
  const int64_t L = static_cast<int64_t>(w.size()), g = c_.norm_num_groups, T = c_.time_embed_dim();
  const double eps = c_.norm_eps;
  conv_in = register_module("conv_in", sd_conv(c_.in_channels, w[0], 3));
  time_embedding = register_module("time_embedding", TimeEmbedding(w[0], T));
  auto transformer = [&](int64_t ch, int64_t heads) {
    return SdTransformer(ch, heads, c_.cross_attention_dim, g, c_.use_linear_projection);
  };
  down_blocks = register_module("down_blocks", make_down_blocks(c_));
  mid_block = register_module("mid_block", make_mid_block(c_));
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
  conv_norm_out = register_module("conv_norm_out", sd_group_norm(g, w[0], eps));
  conv_out = register_module("conv_out", sd_conv(w[0], c_.out_channels, 3));
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
  k.emb = time_embedding(timestep, k.h.scalar_type());  // [B, 4 w0]
  k.h = conv_in(k.h);                                                                                  // [B, w0, H, W]
  k.skips = {k.h};
}

void UNet2DConditionModelImpl::unit_down(NetCarry& k, size_t i, size_t j, const torch::Tensor& context) {
  down_step(*down_blocks[i]->as<Level>(), k, j, context);
}

void UNet2DConditionModelImpl::unit_downsample(NetCarry& k, size_t i) { downsample_step(*down_blocks[i]->as<Level>(), k); }

void UNet2DConditionModelImpl::unit_mid(NetCarry& k, const torch::Tensor& context) {
  k.h = mid_forward(*mid_block, k.h, k.emb, context);  // [B, w[-1], H/f, W/f]
}

void UNet2DConditionModelImpl::add_residuals(NetCarry& k, const UNetResiduals& r) const {
  DDM_CHECK(r.down.size() == k.skips.size() && r.mid.defined(),
            "UNet2DConditionModel: a ControlNet's residuals must be one per skip (" << k.skips.size()
                                                                                  << ") and the middle's, got "
                                                                                  << r.down.size());
  for (size_t i = 0; i < k.skips.size(); ++i) {
    DDM_CHECK(r.down[i].sizes() == k.skips[i].sizes(), "UNet2DConditionModel: residual " << i << " is "
                                                           << r.down[i].sizes() << ", its skip " << k.skips[i].sizes());
    k.skips[i] = k.skips[i] + r.down[i];  // [B, w, h, w]
  }
  DDM_CHECK(r.mid.sizes() == k.h.sizes(), "UNet2DConditionModel: the middle residual is " << r.mid.sizes()
                                                                                           << ", the middle " << k.h.sizes());
  k.h = k.h + r.mid;
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
  k.h = conv_out(group_norm_silu(conv_norm_out, k.h));  // [B, out_channels, H, W]
  k.emb = torch::Tensor();
}

NetCarry UNet2DConditionModelImpl::encode(const torch::Tensor& sample, const torch::Tensor& timestep,
                                          const torch::Tensor& context) {
  check_inputs(sample, timestep, context);
  NetCarry k{sample, {}, {}};
  unit_in(k, timestep);
  for (size_t i = 0; i < down_blocks->size(); ++i) {
    for (size_t j = 0; j < down_blocks[i]->as<Level>()->resnets->size(); ++j) unit_down(k, i, j, context);
    if (down_blocks[i]->as<Level>()->resample) unit_downsample(k, i);
  }
  unit_mid(k, context);
  return k;
}

torch::Tensor UNet2DConditionModelImpl::decode(NetCarry k, const torch::Tensor& context, const UNetResiduals* residuals) {
  if (residuals) add_residuals(k, *residuals);  // (diffusers adds the skips' before the middle: the same sums)
  for (size_t i = 0; i < up_blocks->size(); ++i) {
    for (size_t j = 0; j < up_blocks[i]->as<Level>()->resnets->size(); ++j) unit_up(k, i, j, context);
    if (up_blocks[i]->as<Level>()->resample) unit_upsample(k, i);
  }
  unit_out(k);
  return k.h;  // [B, out_channels, H, W]
}

torch::Tensor UNet2DConditionModelImpl::forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                                                const torch::Tensor& context, const UNetResiduals* residuals) {
  return decode(encode(sample, timestep, context), context, residuals);  // [B, out_channels, H, W]
}

std::vector<NetUnit> UNet2DConditionModelImpl::units(std::function<torch::Tensor(const torch::Tensor&)> timestep) {
  std::vector<NetUnit> u;
  const auto params = params_of;
  const auto at = item_or_null;
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
  for (NetUnit& d : decoder_units()) u.push_back(std::move(d));
  return u;
}

std::vector<NetUnit> UNet2DConditionModelImpl::decoder_units() {
  std::vector<NetUnit> u;
  const auto params = params_of;
  const auto at = item_or_null;
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
  const int64_t L = static_cast<int64_t>(w.size());
  const double temb = static_cast<double>(c.time_embed_dim());
  std::vector<int64_t> skips;
  double n = 0;
  double f = flops_of::encoder(c, H, W, tokens, skips, n);
  int64_t ch = w.back();
  for (int64_t i = 0; i < L; ++i) {
    const int64_t out = w[L - 1 - i];
    for (int64_t j = 0; j <= c.layers_per_block; ++j) {
      f += flops_of::resnet(ch + skips.back(), out, temb, n) +
           (c.up_block_types[i] == "CrossAttnUpBlock2D"
                ? flops_of::transformer(out, n, tokens, c.cross_attention_dim)
                : 0.0);
      skips.pop_back();
      ch = out;
    }
    if (i + 1 < L) {
      n *= 4;
      f += flops_of::conv(ch, ch, 3, n);  // after the nearest 2x
    }
  }
  return f + flops_of::conv(w[0], c.out_channels, 3, n);
}

UNet2DConditionConfig load_unet_2d_condition_config(const std::string& dir) {
  std::string file;
  const nlohmann::json j = read_model_config(dir, "UNet2DConditionModel", file);
  return parse_unet_2d_condition_config(j, file);
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
