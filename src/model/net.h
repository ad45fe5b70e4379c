// The network interface every backbone implements. A Net maps (x, noise-level conditioning t,
// class label y) to a tensor shaped like x. It knows nothing about the noise process: what t means
// and what the output is trained to predict is decided in src/diffusion.
#pragma once
#include <memory>
#include <string>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "core/config.h"

namespace ddm {

class NetImpl : public torch::nn::Module {
 public:
  // x: float [B, C, H, W]; t: float [B] in [0, 1]; y: int64 [B], where y == num_classes is the
  // null class (unconditional; used for classifier-free guidance). Returns float [B, C, H, W]
  // (routers, model/router.h: logits [B, num_experts]).
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& y) = 0;
};
using Net = std::shared_ptr<NetImpl>;

// Builds the network described by cfg (arch unet | dit | router-dit | router-conv | autoencoder). cfg.in_channels, image_size and
// num_classes must already be resolved (> 0, > 0, >= 0). Throws ddm::Error on invalid shapes
// (e.g. image_size not divisible by the DiT patch or by the U-Net's downsampling).
Net make_net(const ModelConfig& cfg);

// Number of trainable parameters.
int64_t count_params(const torch::nn::Module& m);
// Analytic forward FLOPs per image (2 x multiply-accumulates of convolutions, linear layers and
// attention matmuls; elementwise ops ignored), for the configuration.
double forward_flops_per_image(const ModelConfig& cfg);

}  // namespace ddm
