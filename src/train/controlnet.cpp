// ControlNet's locked base: resolving, pinning and loading it (see controlnet.h).
#include "train/controlnet.h"

#include <filesystem>

#include <torch/torch.h>

#include "core/error.h"
#include "core/fileio.h"
#include "core/run_dir.h"
#include "core/safetensors.h"
#include "model/controlnet.h"
#include "train/checkpoint.h"
#include "train/network.h"
#include "train/optimizer.h"

namespace fs = std::filesystem;

namespace ddm {
namespace {

// The base's resolved config, from its checkpoint directory.
RunConfig base_config(const std::string& ckpt, const std::string& key) {
  DDM_CHECK(fs::is_regular_file(fs::path(ckpt) / RunDir::kState),
            key << ": the base checkpoint " << ckpt << " does not exist (moved or deleted?); point model.controlnet "
                << "at a trained U-Net run");
  const Checkpoint ck = read_checkpoint(ckpt, /*weights_only=*/true);
  return parse_config(ck.config_toml, ckpt + "/" + RunDir::kState + " (config)");
}

// The way to a ControlNet on an sd-unet run: diffusers' ControlNetModel on the run's UNet in diffusers' layout.
void refuse_sd_unet_base(const RunConfig& base, const std::string& what, const std::string& run) {
  DDM_CHECK(base.model.arch != "sd-unet",
            what << ": " << run << " holds diffusers' UNet (model.arch = sd-unet), whose ControlNet is diffusers' "
                 << "ControlNetModel: write the run out with `ddm export --ckpt " << run << " --diffusers OUT`, then "
                 << "train with model.arch = \"sd-unet\", model.unet = OUT and model.controlnet = \"from-unet\" "
                 << "(docs/stable-diffusion.md, \"ControlNet\")");
}

}  // namespace

RunConfig controlnet_default_config(const std::string& base, const std::vector<std::string>& overrides) {
  DDM_CHECK(fs::exists(base), "--controlnet " << base << ": no such directory; give a trained U-Net run (e.g. `ddm "
                                                         "train --config configs/quickstart.toml --out RUN`)");
  const std::string ckpt = resolve_checkpoint(base);
  const Checkpoint ck = read_checkpoint(ckpt, /*weights_only=*/true);
  const RunConfig own = parse_config(ck.config_toml, ckpt + "/" + RunDir::kState + " (the base's config)");
  refuse_sd_unet_base(own, "--controlnet " + base, base);
  DDM_CHECK(own.model.arch == "unet" && own.model.latent.empty(),
            "--controlnet " << base << ": " << ckpt << " holds a " << (own.model.latent.empty() ? "" : "latent ")
                            << own.model.arch << " model; a ControlNet steers a pixel U-Net");
  const std::string abs = fs::absolute(ckpt).lexically_normal().string();
  DDM_CHECK(abs.find('\'') == std::string::npos, "--controlnet: a path with a ' is not supported: " << abs);
  // The base may be a distilled student or an expert: a ControlNet trains on all the data itself.
  std::vector<std::string> all = {"model.controlnet='" + abs + "'", "train.teacher=''", "data.partition=''",
                                  "data.expert=-1", "train.expert_budget=full"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  return parse_config(ck.config_toml, ckpt + "/" + RunDir::kState + " (the base's config)", all);
}

void resolve_controlnet(RunConfig& cfg, const Dataset& data) {
  ModelConfig& m = cfg.model;
  const std::string key = "model.controlnet = " + m.controlnet;
  DDM_CHECK(fs::exists(m.controlnet), key << ": no such directory; give a trained U-Net run (e.g. `ddm train --config "
                                             "configs/tiny.toml --out RUN`)");
  const fs::path path = absolute_dir(m.controlnet);
  const std::string ckpt = fs::absolute(resolve_checkpoint(path.string())).lexically_normal().string();
  const RunConfig base = base_config(ckpt, key);
  DDM_CHECK(base.model.controlnet.empty(), key << ": " << ckpt << " is itself a ControlNet; give the U-Net it "
                                               << "steers (" << base.model.controlnet << ")");
  refuse_sd_unet_base(base, key, path.string());
  DDM_CHECK(base.model.arch == "unet" && base.model.latent.empty(),
            key << ": " << ckpt << " holds a " << (base.model.latent.empty() ? "" : "latent ") << base.model.arch
                << " model; a ControlNet steers a pixel U-Net");
  DDM_CHECK(base.model.embed.empty(), key << ": the base is conditioned on image embeddings (model.embed); a "
                                              "ControlNet on it is not supported yet");
  DDM_CHECK(!base.model.self_cond, key << ": the base is self-conditioned (model.self_cond); a ControlNet on it is not "
                                         "supported yet");
  const int64_t c = data.images.size(1), h = data.images.size(2);
  DDM_CHECK(base.model.in_channels == c && base.model.image_size == h,
            key << ": the base was trained on " << base.model.in_channels << "x" << base.model.image_size << "x"
                << base.model.image_size << " images, but the data is " << c << "x" << h << "x" << h << " ("
                << data.description << ")");
  DDM_CHECK(base.model.num_classes == 0 || base.model.num_classes == data.num_classes,
            key << ": the base has " << base.model.num_classes << " classes, the data " << data.num_classes
                << " (" << data.description << ")");
  RunConfig with_base = cfg;  // differs from cfg in [diffusion] alone
  with_base.diffusion = base.diffusion;
  const std::string diff = first_difference(to_toml(with_base), to_toml(cfg), "base", "this config");
  DDM_CHECK(diff.empty(), key << ": a ControlNet predicts what its base predicts, but the [diffusion] sections differ: "
                              << diff << "; remove the [diffusion] keys (the base's are used)");
  const std::string sha = sha256_file((fs::path(ckpt) / RunDir::kEma).string());
  DDM_CHECK(m.controlnet_sha256.empty() || m.controlnet_sha256 == sha,
            "the locked base changed: " << (fs::path(ckpt) / RunDir::kEma).string() << " has sha256 " << sha
                                        << ", but this ControlNet was trained on model.controlnet_sha256 = "
                                        << m.controlnet_sha256 << "; restore that base");
  ModelConfig resolved = base.model;  // the architecture is the base's
  resolved.controlnet = ckpt;
  resolved.controlnet_sha256 = sha;
  resolved.control = m.control;
  m = resolved;
}

void attach_controlnet(NetImpl& net, const ModelConfig& m) {
  if (m.controlnet.empty()) return;
  if (m.arch == "sd-unet") return attach_sd_controlnet(net, m);  // diffusers' ControlNetModel on its UNet
  auto* cn = dynamic_cast<ControlNetImpl*>(&net);
  DDM_CHECK(cn, "attach_controlnet: the net is not a ControlNet");
  DDM_CHECK(!m.controlnet_sha256.empty(), "model.controlnet = " << m.controlnet << " is not resolved (controlnet_sha256 unset)");
  const std::string weights = (fs::path(m.controlnet) / RunDir::kEma).string();
  DDM_CHECK(fs::is_regular_file(weights), "model.controlnet = " << m.controlnet << ": the locked base's weights " << weights
                                                                << " do not exist (moved or deleted?); restore them (a "
                                                                   "ControlNet is tied to its own base)");
  const std::string bytes = read_file(weights);
  const std::string sha = sha256_hex(bytes);
  DDM_CHECK(sha == m.controlnet_sha256,
            "the locked base changed: " << weights << " has sha256 " << sha << ", but this ControlNet was trained on "
                                        << "model.controlnet_sha256 = " << m.controlnet_sha256
                                        << "; restore that base (a ControlNet is tied to its own)");
  load_module_state(cn->base(), parse_safetensors(bytes, weights).tensors, weights);
  cn->set_base_loaded();
  // The trainable copy starts as the base's encoder: same names (model/unet.h builds both alike).
  torch::NoGradGuard no_grad;
  const auto base = cn->base().named_parameters();
  for (auto& p : cn->control().named_parameters()) p.value().copy_(base[p.key()]);
}

}  // namespace ddm
