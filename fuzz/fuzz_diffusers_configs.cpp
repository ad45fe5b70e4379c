// Fuzz target: the config.json of a diffusers model folder. The first byte b picks the class the rest
// of the input is read as (b % 3 = 0: AutoencoderKL, 1: UNet2DConditionModel, or ControlNetModel when
// b / 3 is odd, 2: a scheduler's scheduler_config.json). A bad config must be a ddm::Error; a model config that parses and is small
// builds its model, which runs on a tiny input; a schedule that parses gives its alphas_cumprod.
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fuzz_util.h"
#include "sd/autoencoder_kl.h"
#include "sd/controlnet_model.h"
#include "sd/scheduler.h"
#include "sd/unet_2d_condition.h"

namespace {

// Small enough to build and run at once: few levels, narrow.
template <class Config>
bool small(const Config& c) {
  int64_t width = 0;
  for (int64_t w : c.block_out_channels) width += w;
  return c.block_out_channels.size() <= 3 && width <= 96 && c.layers_per_block <= 2;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ddm::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const nlohmann::json j = nlohmann::json::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  torch::NoGradGuard no_grad;
  ddm::fuzz::expect_errors([&] {
    if (data[0] % 3 == 2) {
      const auto s = ddm::sd::parse_scheduler_config(j, "scheduler_config.json");
      if (s.num_train_timesteps <= 4096) ddm::fuzz::touch(ddm::sd::alphas_cumprod(s));
    } else if (data[0] % 3 == 0) {
      const auto c = ddm::sd::parse_autoencoder_kl_config(j, "config.json");
      (void)ddm::sd::autoencoder_kl_config_json(c).dump();
      if (!small(c) || c.in_channels > 4 || c.latent_channels > 16) return;
      ddm::sd::AutoencoderKL vae(c);
      const int64_t side = 2 * c.factor();
      const auto [mean, logvar] = vae->encode(torch::zeros({1, c.in_channels, side, side}));
      ddm::fuzz::touch(vae->decode(mean));
      ddm::fuzz::touch(logvar);
    } else if ((data[0] / 3) % 2 == 1) {
      const auto c = ddm::sd::parse_controlnet_model_config(j, "config.json");
      (void)ddm::sd::controlnet_model_config_json(c).dump();
      if (!small(c.unet) || c.unet.in_channels > 8 || c.unet.cross_attention_dim > 64 || c.conditioning_channels > 4 ||
          c.conditioning_embedding_out_channels.size() > 3)
        return;
      int64_t width = 0;
      for (int64_t w : c.conditioning_embedding_out_channels) width += w;
      if (width > 96) return;
      ddm::sd::ControlNetModel cn(c);
      const int64_t side = int64_t{1} << (c.unet.block_out_channels.size() - 1), f = c.hint_factor();
      const auto r = cn->forward(torch::zeros({1, c.unet.in_channels, side, side}), torch::tensor({3.0}),
                                 torch::zeros({1, 2, c.unet.cross_attention_dim}),
                                 torch::zeros({1, c.conditioning_channels, side * f, side * f}));
      ddm::fuzz::touch(r.mid);
    } else {
      const auto c = ddm::sd::parse_unet_2d_condition_config(j, "config.json");
      (void)ddm::sd::unet_2d_condition_config_json(c).dump();
      if (!small(c) || c.in_channels > 8 || c.cross_attention_dim > 64) return;
      ddm::sd::UNet2DConditionModel unet(c);
      const int64_t side = int64_t{1} << (c.block_out_channels.size() - 1);
      ddm::fuzz::touch(unet->forward(torch::zeros({1, c.in_channels, side, side}), torch::tensor({3.0}),
                                     torch::zeros({1, 2, c.cross_attention_dim})));
    }
  });
  return 0;
}
