// Stable Diffusion's UNet as a ddm network (see unet_net.h).
#include "sd/unet_net.h"

#include <filesystem>

#include "core/error.h"

namespace fs = std::filesystem;

namespace ddm::sd {

SdUNetNetImpl::SdUNetNetImpl(UNet2DConditionModel unet, int64_t timesteps)
    : unet_(register_module("unet", std::move(unet))), timesteps_(timesteps) {
  DDM_CHECK(timesteps_ >= 2, "diffusers' UNet: diffusion.timesteps must be >= 2, got " << timesteps_);
}

torch::Tensor SdUNetNetImpl::timestep(const torch::Tensor& t) const {
  return (t.to(torch::kDouble) * static_cast<double>(timesteps_) - 1.0).to(torch::kFloat);  // [B]
}

torch::Tensor SdUNetNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(c.context.defined(), "diffusers' UNet2DConditionModel needs the text encoder's states (Cond::context)");
  return unet_(x, timestep(t), c.context.to(x.dtype()));  // [B, C, H, W]
}

std::vector<NetUnit> SdUNetNetImpl::units() {
  return unet_->units([this](const torch::Tensor& t) { return timestep(t); });
}

std::string unet_folder(const std::string& path) {
  const fs::path p(path);
  if (fs::is_regular_file(p / "model_index.json")) {
    DDM_CHECK(fs::is_directory(p / "unet"), path << " is a diffusers pipeline directory (model_index.json) without "
                                                 << "a unet/ folder: name the UNet's folder instead");
    return (p / "unet").string();
  }
  return p.string();
}

}  // namespace ddm::sd
