// ControlNet on a locked ddm U-Net (see controlnet.h).
#include "model/controlnet.h"

#include <string>

#include <torch/torch.h>

#include "core/error.h"
#include "model/flops.h"
#include "model/layers.h"

namespace ddm {

namespace nn = torch::nn;

namespace {
constexpr int64_t kHint1 = 16, kHint2 = 32;  // the hint block's widths

nn::Conv2d conv3(int64_t in, int64_t out) { return nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1)); }
}  // namespace

int64_t control_channels(const ModelConfig& cfg) {
  if (cfg.control == "edges") return 1;
  DDM_CHECK(cfg.control == "lowres", "model.control = \"" << cfg.control << "\" is not one of: edges, lowres");
  return cfg.in_channels;
}

ControlNetImpl::ControlNetImpl(const ModelConfig& cfg) : cfg_(cfg) {
  base_ = std::make_shared<UNetImpl>(cfg);
  for (auto& p : base_->parameters()) p.set_requires_grad(false);
  base_->eval();
  control_ = register_module("control", std::make_shared<UNetImpl>(cfg, /*encoder_only=*/true));
  const int64_t c0 = cfg.channels * cfg.channel_mult[0];
  auto last = conv3(kHint2, c0);
  zero_init(*last);
  hint_ = register_module("hint", nn::Sequential(conv3(control_channels(cfg), kHint1), nn::SiLU(),
                                                 conv3(kHint1, kHint2), nn::SiLU(), last));
  std::vector<int64_t> chans = base_->skip_channels();
  chans.push_back(base_->mid_channels());
  for (size_t i = 0; i < chans.size(); ++i) {
    auto z = nn::Conv2d(nn::Conv2dOptions(chans[i], chans[i], 1));
    zero_init(*z);
    zero_.push_back(register_module("zero" + std::to_string(i), z));
  }
}

void ControlNetImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  NetImpl::to(device, dtype, non_blocking);
  base_->to(device, dtype, non_blocking);
}
void ControlNetImpl::to(torch::Dtype dtype, bool non_blocking) {
  NetImpl::to(dtype, non_blocking);
  base_->to(dtype, non_blocking);
}
void ControlNetImpl::to(torch::Device device, bool non_blocking) {
  NetImpl::to(device, non_blocking);
  base_->to(device, non_blocking);
}

std::vector<torch::Tensor> ControlNetImpl::residuals(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(c.control.defined(), "ControlNet: a control map is required (model.control = " << cfg_.control << ")");
  const int64_t cc = control_channels(cfg_);
  DDM_CHECK(c.control.dim() == 4 && c.control.size(0) == x.size(0) && c.control.size(1) == cc &&
                c.control.size(2) == x.size(2) && c.control.size(3) == x.size(3),
            "ControlNet: expected a control map [" << x.size(0) << ", " << cc << ", " << x.size(2) << ", " << x.size(3)
                                                  << "] (model.control = " << cfg_.control << "), got "
                                                  << c.control.sizes());
  const auto hint = hint_->forward(c.control);                     // [B, c0, S, S]
  const UNetImpl::Features f = control_->encode(x, t, c, hint);      // skips, h
  std::vector<torch::Tensor> r;
  for (size_t i = 0; i < f.skips.size(); ++i) r.push_back(zero_[i](f.skips[i]));  // [B, c_l, S_l, S_l]
  r.push_back(zero_.back()(f.h));                                   // [B, c_{L-1}, S_{L-1}, S_{L-1}]
  return r;
}

Cond ControlNetImpl::precompute(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(base_loaded_, "ControlNet: the locked base model was not loaded (train/controlnet.h)");
  torch::NoGradGuard no_grad;
  UNetImpl::Features f = base_->encode(x, t, c);
  Cond out = c;
  out.frozen.clear();
  out.frozen.push_back(f.emb_act);                                  // [B, E]
  out.frozen.push_back(f.h);                                        // [B, c_{L-1}, ...]
  for (auto& s : f.skips) out.frozen.push_back(s);                  // [B, c_l, S_l, S_l] each
  return out;
}

torch::Tensor ControlNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const Cond& c) {
  DDM_CHECK(base_loaded_, "ControlNet: the locked base model was not loaded (train/controlnet.h)");
  const Cond pre = c.frozen.empty() ? precompute(x, t, c) : c;
  DDM_CHECK(pre.frozen.size() == base_->skip_channels().size() + 2,
            "ControlNet: Cond::frozen holds " << pre.frozen.size() << " tensors, not this ControlNet's precompute");
  UNetImpl::Features f;
  f.emb_act = pre.frozen[0];
  f.h = pre.frozen[1];
  f.skips.assign(pre.frozen.begin() + 2, pre.frozen.end());
  f.text.context = c.context;                                      // the locked decoder's text, if any
  f.text.context_mask = c.context_mask;
  return base_->decode(std::move(f), residuals(x, t, c));          // [B, C, S, S]
}

std::vector<NetUnit> ControlNetImpl::units() {
  DDM_CHECK(base_loaded_, "ControlNet: the locked base model was not loaded (train/controlnet.h)");
  // The trainable copy's encoder, its first unit also running the hint block on the control map.
  std::vector<NetUnit> u = control_->encoder_units([this](const Cond& c) {
    DDM_CHECK(c.control.defined(), "ControlNet: a control map is required (model.control = " << cfg_.control << ")");
    return hint_->forward(c.control);                              // [B, c0, S, S]
  });
  for (NetUnit& x : u) x.name = "control." + x.name;
  for (const torch::Tensor& p : hint_->parameters()) u.front().params.push_back(p);
  // The zero convolutions turn the copy's features into residuals, added to the locked encoder's
  // features (precomputed: Cond::frozen); the carry becomes the locked decoder's input.
  std::vector<torch::Tensor> zp;
  for (const auto& z : zero_)
    for (const torch::Tensor& p : z->parameters()) zp.push_back(p);
  u.push_back({"zero", [this](NetCarry& k, const torch::Tensor&, const Cond& c) {
                 DDM_CHECK(c.frozen.size() == base_->skip_channels().size() + 2,
                           "ControlNet: a pipeline stage needs the locked encoder's features (Cond::frozen from precompute)");
                 NetCarry out{c.frozen[1] + zero_.back()(k.h), c.frozen[0], {}};  // h [B, c_{L-1}, ...], emb [B, E]
                 for (size_t i = 0; i < k.skips.size(); ++i)
                   out.skips.push_back(c.frozen[2 + i] + zero_[i](k.skips[i]));  // [B, c_l, S_l, S_l]
                 k = std::move(out);
               },
               zp, /*reads_frozen=*/true});
  // The locked decoder: on the gradient path, no parameter of its own to train (its parameters stay
  // listed, frozen: they count in a stage's work).
  for (NetUnit& d : base_->decoder_units()) {
    d.name = "locked." + d.name;
    u.push_back(std::move(d));
  }
  return u;
}

double controlnet_forward_flops(const ModelConfig& cfg) {
  const int64_t s = cfg.image_size, c0 = cfg.channels * cfg.channel_mult[0];
  double f = unet_forward_flops(cfg) + unet_forward_flops(cfg, /*encoder_only=*/true);
  f += flops::conv2d(control_channels(cfg), kHint1, 3, s, s) + flops::conv2d(kHint1, kHint2, 3, s, s) +
       flops::conv2d(kHint2, c0, 3, s, s);
  int64_t size = s;
  for (size_t l = 0; l + 1 < cfg.channel_mult.size(); ++l, size /= 2) {
    const int64_t ch = cfg.channels * cfg.channel_mult[l];
    f += static_cast<double>(cfg.res_blocks) * flops::conv2d(ch, ch, 1, size, size);
  }
  const int64_t mid = cfg.channels * cfg.channel_mult.back();
  return f + flops::conv2d(mid, mid, 1, size, size);
}

}  // namespace ddm
