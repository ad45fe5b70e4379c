// Stable Diffusion's UNet as a ddm network (see unet_net.h).
#include "sd/unet_net.h"

#include <filesystem>

#include "core/error.h"
#include "sd/pipeline_dir.h"

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
  return is_pipeline_dir(path) ? pipeline_component(path, "unet", {"UNet2DConditionModel"}) : path;
}

}  // namespace ddm::sd
