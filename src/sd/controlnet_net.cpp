// A ControlNet on Stable Diffusion's UNet as a ddm network (see controlnet_net.h).
#include "sd/controlnet_net.h"

#include "core/error.h"

namespace ddm::sd {

SdControlNetNetImpl::SdControlNetNetImpl(UNet2DConditionModel unet, ControlNetModel controlnet, int64_t timesteps)
    : unet_(std::move(unet)), controlnet_(register_module("controlnet", std::move(controlnet))), timesteps_(timesteps) {
  DDM_CHECK(timesteps_ >= 2, "diffusers' ControlNet: diffusion.timesteps must be >= 2, got " << timesteps_);
  for (auto& p : unet_->parameters()) p.set_requires_grad(false);
  unet_->eval();
}

void SdControlNetNetImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  NetImpl::to(device, dtype, non_blocking);
  unet_->to(device, dtype, non_blocking);
}
void SdControlNetNetImpl::to(torch::Dtype dtype, bool non_blocking) {
  NetImpl::to(dtype, non_blocking);
  unet_->to(dtype, non_blocking);
}
void SdControlNetNetImpl::to(torch::Device device, bool non_blocking) {
  NetImpl::to(device, non_blocking);
  unet_->to(device, non_blocking);
}

torch::Tensor SdControlNetNetImpl::control_image(const torch::Tensor& map) const {
  const int64_t cc = controlnet_->config().conditioning_channels;
  DDM_CHECK(map.defined() && map.dim() == 4 && (map.size(1) == cc || map.size(1) == 1),
            "diffusers' ControlNet reads " << cc << "-channel control images; the control map is "
                                           << (map.defined() ? map.sizes() : torch::IntArrayRef{}));
  const torch::Tensor unit = (map + 1) * 0.5;                           // [B, Cc, S, S] in [0, 1]
  return map.size(1) == cc ? unit : unit.expand({-1, cc, -1, -1}).contiguous();  // [B, cc, S, S]
}

torch::Tensor SdControlNetNetImpl::timestep(const torch::Tensor& t) const {
  return (t.to(torch::kDouble) * static_cast<double>(timesteps_) - 1.0).to(torch::kFloat);  // [B]
}

Cond SdControlNetNetImpl::precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(unet_loaded_, "diffusers' ControlNet: the locked UNet was not loaded (train/network.h)");
  DDM_CHECK(c.context.defined(), "diffusers' ControlNet needs the text encoder's states (Cond::context)");
  torch::NoGradGuard no_grad;
  NetCarry k = unet_->encode(x, timestep(t), c.context.to(x.dtype()));
  Cond out = c;
  out.frozen = {k.emb, k.h};                                         // [B, 4 w0], [B, w[-1], h, w]
  for (auto& s : k.skips) out.frozen.push_back(std::move(s));        // [B, w_l, H_l, W_l] each
  return out;
}

torch::Tensor SdControlNetNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(unet_loaded_, "diffusers' ControlNet: the locked UNet was not loaded (train/network.h)");
  DDM_CHECK(c.context.defined(), "diffusers' ControlNet needs the text encoder's states (Cond::context)");
  DDM_CHECK(c.control.defined(), "diffusers' ControlNet needs a control map (Cond::control)");
  const torch::Tensor ts = timestep(t);                   // [B]
  const torch::Tensor context = c.context.to(x.dtype());  // [B, T, D]
  const UNetResiduals r = controlnet_(x, ts, context, control_image(c.control).to(x.dtype()));
  NetCarry k;
  if (c.frozen.empty()) {
    k = unet_->encode(x, ts, context);  // (no trainable parameter: nothing to differentiate)
  } else {
    DDM_CHECK(c.frozen.size() == r.down.size() + 2,
              "diffusers' ControlNet: Cond::frozen holds " << c.frozen.size() << " tensors, not this ControlNet's precompute");
    k.emb = c.frozen[0];
    k.h = c.frozen[1];
    k.skips.assign(c.frozen.begin() + 2, c.frozen.end());
  }
  return unet_->decode(std::move(k), context, &r);  // [B, C, H, W]
}

std::vector<NetUnit> SdControlNetNetImpl::units() {
  DDM_CHECK(unet_loaded_, "diffusers' ControlNet: the locked UNet was not loaded (train/network.h)");
  std::vector<NetUnit> u = controlnet_->units([this](const torch::Tensor& t) { return timestep(t); },
                                              [this](const Cond& c) {
                                                DDM_CHECK(c.control.defined(),
                                                          "diffusers' ControlNet needs a control map (Cond::control)");
                                                return control_image(c.control);
                                              });
  for (NetUnit& x : u) x.name = "control." + x.name;
  u.push_back({"zero",
               [this](NetCarry& k, const torch::Tensor&, const Cond& c) {
                 DDM_CHECK(c.frozen.size() == k.skips.size() + 2,
                           "diffusers' ControlNet: a pipeline stage needs the locked encoder's features (Cond::frozen "
                           "from precompute)");
                 const UNetResiduals r = controlnet_->residuals(k.skips, k.h);
                 NetCarry out{c.frozen[1] + r.mid, c.frozen[0], {}};                                      // as decode adds them
                 for (size_t i = 0; i < r.down.size(); ++i) out.skips.push_back(c.frozen[2 + i] + r.down[i]);  // [B, w, h, w]
                 k = std::move(out);
               },
               controlnet_->zero_parameters(), /*reads_frozen=*/true});
  for (NetUnit& d : unet_->decoder_units()) {
    d.name = "locked." + d.name;
    u.push_back(std::move(d));
  }
  return u;
}

}  // namespace ddm::sd
