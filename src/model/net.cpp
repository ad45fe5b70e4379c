// make_net (arch dispatch + validation), parameter counting and analytic FLOPs (see net.h).
#include "model/net.h"

#include <torch/torch.h>

#include <algorithm>

#include "core/error.h"
#include "model/autoencoder.h"
#include "model/controlnet.h"
#include "model/dit.h"
#include "model/ops.h"
#include "model/router.h"
#include "model/unet.h"

namespace ddm {

namespace {

// Checks the fields every architecture needs; the arch-specific ones are checked by
// validate_unet / validate_dit.
void validate_common(const ModelConfig& cfg) {
  DDM_CHECK(cfg.arch != "sd-unet", "model.arch = sd-unet is diffusers' UNet, which make_network (train/network.h) "
                                   "builds, and network_flops_per_image counts");
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

namespace {
// Every per-sample tensor of a Cond, in one order: rows, select, to and cat walk them alike.
constexpr torch::Tensor Cond::*kPerSample[] = {&Cond::y,     &Cond::control,      &Cond::self_cond, &Cond::embed,
                                                &Cond::embed_null, &Cond::context, &Cond::context_mask, &Cond::pooled};
}  // namespace

Cond Cond::rows(int64_t first, int64_t n) const {
  DDM_CHECK(residuals.empty() && frozen.empty(), "Cond::rows: a network's internal conditioning cannot be sliced");
  Cond c;
  for (auto m : kPerSample)
    if ((this->*m).defined()) c.*m = (this->*m).narrow(0, first, n);
  return c;
}

Cond Cond::select(const torch::Tensor& idx) const {
  DDM_CHECK(residuals.empty() && frozen.empty(), "Cond::select: a network's internal conditioning cannot be indexed");
  Cond c;
  for (auto m : kPerSample)
    if ((this->*m).defined()) c.*m = (this->*m).index_select(0, idx);
  return c;
}

std::vector<torch::Tensor*> Cond::slots() {
  std::vector<torch::Tensor*> out;
  for (auto m : kPerSample) out.push_back(&(this->*m));
  for (auto* list : {&residuals, &frozen})
    for (torch::Tensor& t : *list) out.push_back(&t);
  return out;
}

Cond Cond::to(torch::Device device) const {
  Cond c = *this;
  for (auto m : kPerSample)
    if ((c.*m).defined()) c.*m = (c.*m).to(device);
  for (auto* list : {&c.residuals, &c.frozen})
    for (torch::Tensor& t : *list) t = t.to(device);
  return c;
}

Cond Cond::cat(const Cond& a, const Cond& b) {
  DDM_CHECK(a.residuals.empty() && a.frozen.empty() && b.residuals.empty() && b.frozen.empty(),
            "Cond::cat: a network's internal conditioning cannot be concatenated");
  Cond c;
  for (auto m : kPerSample) {
    DDM_CHECK((a.*m).defined() == (b.*m).defined(), "Cond::cat: the two conditionings carry different fields");
    if ((a.*m).defined()) c.*m = torch::cat({a.*m, b.*m});
  }
  return c;
}

EmbedProjectorImpl::EmbedProjectorImpl(int64_t embed_dim, int64_t out_dim) : embed_dim_(embed_dim) {
  proj_ = register_module("proj", torch::nn::Linear(embed_dim, out_dim));
  null_ = register_parameter("null", torch::zeros({out_dim}));
}

torch::Tensor EmbedProjectorImpl::forward(const Cond& c, int64_t batch) {
  if (!c.embed.defined()) return null_.expand({batch, null_.size(0)});  // [B, E]
  DDM_CHECK(c.embed.dim() == 2 && c.embed.size(0) == batch && c.embed.size(1) == embed_dim_,
            "model.embed: expected embeddings [" << batch << ", " << embed_dim_ << "], got " << c.embed.sizes());
  auto e = apply_linear(proj_, c.embed.to(null_.scalar_type()));  // [B, E]
  if (c.embed_null.defined()) e = torch::where(c.embed_null.view({-1, 1}), null_.expand_as(e), e);  // [B, E]
  return e;
}

torch::Tensor with_self_cond(const torch::Tensor& x, const Cond& c, bool self_cond) {
  if (!self_cond) return x;  // [B, C, H, W]
  if (!c.self_cond.defined()) return torch::cat({x, torch::zeros_like(x)}, 1);  // [B, 2C, H, W]
  DDM_CHECK(c.self_cond.sizes() == x.sizes(), "self-conditioning: the estimate is " << c.self_cond.sizes()
                                                                                    << ", the input " << x.sizes());
  return torch::cat({x, c.self_cond.to(x.scalar_type())}, 1);  // [B, 2C, H, W]
}

Net make_net(const ModelConfig& cfg) {
  validate_common(cfg);
  DDM_CHECK(!cfg.self_cond || cfg.arch == "unet" || cfg.arch == "dit",
            "model.self_cond applies to unet and dit, not model.arch = " << cfg.arch);
  if (!cfg.controlnet.empty()) {
    DDM_CHECK(cfg.arch == "unet", "model.controlnet = " << cfg.controlnet << ": a ControlNet's base must be a U-Net, "
                                  "but model.arch = " << cfg.arch);
    return std::make_shared<ControlNetImpl>(cfg);
  }
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
  if (!cfg.controlnet.empty()) return controlnet_forward_flops(cfg);
  if (cfg.arch == "autoencoder") {  // training runs the encoder and the decoder
    const AutoencoderShape s = autoencoder_shape(cfg);
    return encoder_flops_per_image(s) + decoder_flops_per_image(s);
  }
  return cfg.arch == "unet" ? unet_forward_flops(cfg) : dit_forward_flops(cfg);
}

std::vector<torch::Tensor> NetCarry::tensors() const {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& x : {h, emb})
    if (x.defined()) out.push_back(x);
  for (const torch::Tensor& x : skips) out.push_back(x);
  return out;
}

int64_t NetCarry::bytes() const {
  int64_t b = 0;
  for (const torch::Tensor& x : tensors()) b += x.numel() * static_cast<int64_t>(x.element_size());
  return b;
}

std::vector<NetSkipLife> skip_lives(const std::vector<NetUnit>& units, NetCarry k, const torch::Tensor& t, const Cond& c) {
  torch::NoGradGuard no_grad;
  const int L = static_cast<int>(units.size());
  // The skip slots after each unit. The tensors are kept (not just their addresses), so a popped
  // skip's storage cannot be reused by a later one that would then look untouched.
  std::vector<std::vector<torch::Tensor>> held(static_cast<size_t>(L));
  for (int u = 0; u < L; ++u) {
    units[static_cast<size_t>(u)].run(k, t, c);
    held[static_cast<size_t>(u)] = k.skips;
  }
  auto open = [&](int u, int i) { return i < static_cast<int>(held[static_cast<size_t>(u)].size()); };
  auto same = [&](int u, int v, int i) {  // slot i holds the same tensor after units u and v
    return open(u, i) && open(v, i) && held[static_cast<size_t>(u)][static_cast<size_t>(i)].is_same(held[static_cast<size_t>(v)][static_cast<size_t>(i)]);
  };
  std::vector<NetSkipLife> out;
  for (int u = 0; u < L; ++u)
    for (int i = 0; open(u, i); ++i) {
      if (u > 0 && same(u - 1, u, i)) continue;  // made earlier
      NetSkipLife s;
      s.slot = i, s.made = u, s.read = u + 1;
      while (s.read < L && same(u, s.read, i)) ++s.read;
      const torch::Tensor& x = held[static_cast<size_t>(u)][static_cast<size_t>(i)];
      s.row_shape = x.sizes().slice(1).vec();
      s.row_bytes = x.numel() / std::max<int64_t>(1, x.size(0)) * static_cast<int64_t>(x.element_size());
      out.push_back(std::move(s));
    }
  return out;
}

std::vector<NetUnit> NetImpl::units() {
  DDM_FAIL("this network (" << name() << ") cannot be split into pipeline stages: only a U-Net, a DiT or a ControlNet can");
}

}  // namespace ddm
