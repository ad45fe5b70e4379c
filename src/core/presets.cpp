// Named model presets (see presets.h): sized for CPU training on 28x28x1 images, and for your own
// RGB images at 32-256 px (unet-N, latent-unet-N; `ddm presets` gives their sizes).
// Sizes for 28x28x1 with 10 classes (count_params / forward_flops_per_image, forward FLOPs per image):
//   unet-tiny   0.49M params, 0.20 GFLOP  U-Net 32/64/64, 1 res block per level, 28 -> 14 -> 7
//   unet-small  3.61M params, 1.46 GFLOP  U-Net 64/128/128, 2 res blocks per level, attention at 7x7
//   dit-tiny    1.28M params, 0.08 GFLOP  DiT patch 4 (49 tokens), width 128, depth 4, 4 heads
//   dit-small   4.16M params, 1.22 GFLOP  DiT patch 2 (196 tokens), width 192, depth 6, 6 heads
// On ae-f4's 7x7x4 latents (model.latent):
//   latent-unet        1.33M params, 0.075 GFLOP  U-Net 128, one 7x7 level, 2 res blocks, attention
//   latent-dit         1.87M params, 0.124 GFLOP  DiT patch 1 (49 tokens), width 128, depth 6, 4 heads
//   latent-router-dit  0.25M params, 0.017 GFLOP  router DiT patch 1, width 64, depth 3 (K = 4)
// ae-f4 (the autoencoder, 28x28x1 -> 7x7x4): 0.95M params, encoder 0.083 + decoder 0.237 GFLOP.
// unet-tiny has the shape of the 538k-parameter reference U-Net in docs/architecture.md.
#include "core/presets.h"

#include <functional>
#include <sstream>
#include <utility>

#include "core/error.h"

namespace ddm {

namespace {

// A preset starts from the default architecture fields and overrides some of them.
using PresetFn = std::function<void(ModelConfig&)>;

const std::vector<std::pair<std::string, PresetFn>>& presets() {
  static const std::vector<std::pair<std::string, PresetFn>> table = {
      {"unet-tiny",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 32;
         m.channel_mult = {1, 2, 2};
         m.res_blocks = 1;
         m.attn_levels = {};
         m.groups = 8;
       }},
      {"unet-small",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 64;
         m.channel_mult = {1, 2, 2};
         m.res_blocks = 2;
         m.attn_levels = {2};
         m.groups = 16;
         m.heads = 4;
       }},
      {"dit-tiny",
       [](ModelConfig& m) {
         m.arch = "dit";
         m.patch = 4;
         m.width = 128;
         m.depth = 4;
         m.heads = 4;
         m.mlp_ratio = 4.0;
       }},
      {"dit-small",
       [](ModelConfig& m) {
         m.arch = "dit";
         m.patch = 2;
         m.width = 192;
         m.depth = 6;
         m.heads = 6;
         m.mlp_ratio = 4.0;
       }},
      // Latent backbones (model.latent = a `ddm train-autoencoder` run): on ae-f4's 7x7x4 latents.
      // 7 is odd, so the U-Net keeps one resolution; the DiT sees each latent pixel as a token.
      {"latent-unet",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 128;
         m.channel_mult = {1};
         m.res_blocks = 2;
         m.attn_levels = {0};
         m.groups = 8;
         m.heads = 4;
       }},
      {"latent-dit",
       [](ModelConfig& m) {
         m.arch = "dit";
         m.patch = 1;
         m.width = 128;
         m.depth = 6;
         m.heads = 4;
         m.mlp_ratio = 4.0;
       }},
      // The router of latent experts: every latent pixel a token (router-dit-tiny's patch 7 would
      // make one token of a 7x7 latent).
      {"latent-router-dit",
       [](ModelConfig& m) {
         m.arch = "router-dit";
         m.patch = 1;
         m.width = 64;
         m.depth = 3;
         m.heads = 4;
         m.mlp_ratio = 4.0;
       }},
      // The autoencoder of latent diffusion (`ddm train-autoencoder`): 28x28x1 -> 7x7x4 (f = 4).
      {"ae-f4",
       [](ModelConfig& m) {
         m.arch = "autoencoder";
         m.channels = 32;
         m.channel_mult = {1, 2, 2};
         m.res_blocks = 1;
         m.latent_channels = 4;
         m.groups = 8;
       }},
      // Your own RGB images at 32, 64, 128 and 256 px (docs/own-data.md): U-Nets with attention at 16x16
      // and 8x8 (at 8x8 only above 64 px), one more halving per doubling of the side. 32 and 64 px are
      // sized to train on a CPU (0.5 and 2.2 GFLOP per image forward), 128 and 256 px for a GPU.
      {"unet-32",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 32;
         m.channel_mult = {1, 2, 2};
         m.res_blocks = 2;
         m.attn_levels = {1, 2};
         m.groups = 16;
         m.heads = 4;
       }},
      {"unet-64",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 32;
         m.channel_mult = {1, 2, 2, 4};
         m.res_blocks = 2;
         m.attn_levels = {2, 3};
         m.groups = 16;
         m.heads = 4;
       }},
      {"unet-128",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 64;
         m.channel_mult = {1, 1, 2, 2, 4};
         m.res_blocks = 2;
         m.attn_levels = {4};
         m.groups = 16;
         m.heads = 4;
       }},
      {"unet-256",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 64;
         m.channel_mult = {1, 1, 2, 2, 4, 4};
         m.res_blocks = 2;
         m.attn_levels = {5};
         m.groups = 16;
         m.heads = 4;
       }},
      // Latent U-Nets for 128 and 256 px images on an f = 8 autoencoder with 4 channels (diffusers'
      // sd-vae-ft-mse: model.latent = its folder): 16x16x4 and 32x32x4 latents.
      {"latent-unet-128",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 128;
         m.channel_mult = {1, 2};
         m.res_blocks = 2;
         m.attn_levels = {1};
         m.groups = 16;
         m.heads = 4;
       }},
      {"latent-unet-256",
       [](ModelConfig& m) {
         m.arch = "unet";
         m.channels = 128;
         m.channel_mult = {1, 2, 2};
         m.res_blocks = 2;
         m.attn_levels = {1, 2};
         m.groups = 16;
         m.heads = 4;
       }},
      // Routers: a few percent of an expert's FLOPs, so routed sampling costs about one expert.
      {"router-dit-tiny",
       [](ModelConfig& m) {
         m.arch = "router-dit";
         m.patch = 7;
         m.width = 64;
         m.depth = 3;
         m.heads = 4;
         m.mlp_ratio = 4.0;
       }},
      {"router-conv-tiny",
       [](ModelConfig& m) {
         m.arch = "router-conv";
         m.patch = 2;
         m.channels = 16;
         m.channel_mult = {1, 2};
         m.res_blocks = 1;
         m.groups = 8;
       }},
  };
  return table;
}

}  // namespace

PresetShape preset_shape(const std::string& name) {
  const size_t dash = name.rfind('-');
  const std::string tail = dash == std::string::npos ? "" : name.substr(dash + 1);
  const bool sized = !tail.empty() && tail.find_first_not_of("0123456789") == std::string::npos;
  const bool latent = name.rfind("latent-", 0) == 0;
  if (sized) {
    const int64_t side = std::stoll(tail);
    return latent ? PresetShape{4, side / 8, std::to_string(side) + " px images as f8 latents"}
                  : PresetShape{3, side, std::to_string(side) + " px RGB"};
  }
  if (latent) return {4, 7, "ae-f4's latents of 28 px"};
  return {1, 28, "28 px grey"};
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.first);
  return names;
}

void apply_preset(const std::string& name, ModelConfig& cfg) {
  for (const auto& p : presets()) {
    if (p.first != name) continue;
    // Reset every architecture field to its default, then apply the preset's values.
    ModelConfig m;
    m.preset = cfg.preset;
    m.in_channels = cfg.in_channels;
    m.image_size = cfg.image_size;
    m.num_classes = cfg.num_classes;
    m.num_experts = cfg.num_experts;
    m.latent = cfg.latent;
    m.latent_sha256 = cfg.latent_sha256;
    m.latent_scale = cfg.latent_scale;
    m.latent_shift = cfg.latent_shift;
    m.controlnet = cfg.controlnet;
    m.controlnet_sha256 = cfg.controlnet_sha256;
    m.control = cfg.control;
    m.self_cond = cfg.self_cond;
    m.embed = cfg.embed;
    m.embed_sha256 = cfg.embed_sha256;
    m.embed_dim = cfg.embed_dim;
    m.text_encoder = cfg.text_encoder;  // a router is conditioned on the text like its experts
    m.text_sha256 = cfg.text_sha256;
    m.text_skip = cfg.text_skip;
    m.text_dim = cfg.text_dim;
    m.text_pooled_dim = cfg.text_pooled_dim;
    m.text_tokens = cfg.text_tokens;
    p.second(m);
    if (m.arch != "unet" && m.arch != "dit") {  // a router or an autoencoder takes none of the backbone's conditioning
      m.controlnet.clear();
      m.controlnet_sha256.clear();
      m.self_cond = false;
      m.embed.clear();
      m.embed_sha256.clear();
      m.embed_dim = 0;
    }
    if (m.arch == "autoencoder") {
      m.text_encoder.clear();
      m.text_sha256.clear();
      m.text_skip = m.text_dim = m.text_pooled_dim = m.text_tokens = 0;
    }
    cfg = m;
    return;
  }
  std::ostringstream valid;
  for (const auto& n : preset_names()) valid << (valid.tellp() > 0 ? ", " : "") << n;
  DDM_FAIL("model.preset = '" << name << "' is not a known preset; valid names: " << valid.str());
}

}  // namespace ddm
