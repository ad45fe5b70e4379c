// Control maps (see control.h).
#include "data/control.h"

#include <torch/torch.h>

#include "core/error.h"

namespace ddm {

torch::Tensor control_map(const std::string& type, const torch::Tensor& images) {
  DDM_CHECK(images.dim() == 4, "control_map: expected images [B, C, H, W], got " << images.sizes());
  torch::NoGradGuard no_grad;
  const auto x = images.to(torch::kFloat);
  if (type == "edges") {
    const auto g = x.mean(1, /*keepdim=*/true);                                   // [B, 1, H, W]
    const auto k = torch::tensor({{-1.f, 0.f, 1.f}, {-2.f, 0.f, 2.f}, {-1.f, 0.f, 1.f}}).to(x.device());  // Sobel, d/dx
    const auto kernels = torch::stack({k, k.t()}).unsqueeze(1);                   // [2, 1, 3, 3]
    const auto padded = torch::replication_pad2d(g, {1, 1, 1, 1});               // [B, 1, H+2, W+2]
    const auto d = torch::conv2d(padded, kernels);                                // [B, 2, H, W]
    const auto mag = (d * d).sum(1, /*keepdim=*/true).sqrt();                     // [B, 1, H, W]
    return (mag / 4).clamp(0, 1) * 2 - 1;                                         // [B, 1, H, W]
  }
  DDM_CHECK(type == "lowres", "model.control = \"" << type << "\" is not one of: edges, lowres");
  const auto small = torch::avg_pool2d(x, 4, 4, 0, /*ceil_mode=*/true, /*count_include_pad=*/false);  // [B, C, ceil(H/4), ceil(W/4)]
  // Each block's mean back over its own pixels (a partial edge block too).
  return small.repeat_interleave(4, 2).repeat_interleave(4, 3).narrow(2, 0, x.size(2)).narrow(3, 0, x.size(3));  // [B, C, H, W]
}

double control_error(const std::string& type, const torch::Tensor& samples, const torch::Tensor& maps) {
  const auto got = control_map(type, samples);  // [N, Cc, H, W]
  DDM_CHECK(got.sizes() == maps.sizes(), "control_error: control maps " << maps.sizes() << " for samples of maps "
                                                                        << got.sizes());
  return (got - maps.to(torch::kFloat)).pow(2).mean().item<double>();
}

}  // namespace ddm
