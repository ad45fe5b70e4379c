// make_net (arch dispatch + validation), parameter counting and analytic FLOPs (see net.h).
#include "model/net.h"

#include <torch/torch.h>

#include "core/error.h"
#include "model/autoencoder.h"
#include "model/dit.h"
#include "model/router.h"
#include "model/unet.h"

namespace ddm {

namespace {

// Checks the fields every architecture needs; the arch-specific ones are checked by
// validate_unet / validate_dit.
void validate_common(const ModelConfig& cfg) {
  DDM_CHECK(cfg.arch == "unet" || cfg.arch == "dit" || cfg.arch == "autoencoder" || is_router_arch(cfg.arch),
            "model.arch = '" << cfg.arch
                             << "' is not a known architecture; use unet, dit, router-dit, router-conv or autoencoder");
  DDM_CHECK(cfg.in_channels > 0, "model.in_channels must be > 0 (it is normally taken from the data), got "
                                     << cfg.in_channels);
  DDM_CHECK(cfg.image_size > 0, "model.image_size must be > 0 (it is normally taken from the data), got "
                                    << cfg.image_size);
  DDM_CHECK(cfg.num_classes >= 0, "model.num_classes must be resolved to >= 0 (0 = unconditional) "
                                  "before building the model, got " << cfg.num_classes);
}

}  // namespace

Net make_net(const ModelConfig& cfg) {
  validate_common(cfg);
  if (cfg.arch == "unet") return std::make_shared<UNetImpl>(cfg);
  if (cfg.arch == "router-dit") return std::make_shared<RouterDiTImpl>(cfg);
  if (cfg.arch == "router-conv") return std::make_shared<RouterConvImpl>(cfg);
  if (cfg.arch == "autoencoder") return std::make_shared<AutoencoderImpl>(autoencoder_shape(cfg));
  return std::make_shared<DiTImpl>(cfg);
}

int64_t count_params(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters())
    if (p.requires_grad()) n += p.numel();
  return n;
}

double forward_flops_per_image(const ModelConfig& cfg) {
  validate_common(cfg);
  if (is_router_arch(cfg.arch)) return router_forward_flops(cfg);
  if (cfg.arch == "autoencoder") {  // training runs the encoder and the decoder
    const AutoencoderShape s = autoencoder_shape(cfg);
    return encoder_flops_per_image(s) + decoder_flops_per_image(s);
  }
  return cfg.arch == "unet" ? unet_forward_flops(cfg) : dit_forward_flops(cfg);
}

}  // namespace ddm
