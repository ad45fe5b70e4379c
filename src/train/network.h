// The network of a run, whichever room defines it: ddm's own (model/net.h: make_net) or Stable
// Diffusion's UNet in diffusers' format (model.arch = sd-unet, src/sd). Also resolves the keys that
// name diffusers' folders (model.unet, diffusion.scheduler) before training, as the other frozen and
// pretrained parts are resolved (train/latent.h, train/text.h): absolute paths, pinned by sha256.
#pragma once
#include <string>

#include "core/config.h"
#include "model/net.h"

namespace ddm {

// model.arch = sd-unet, once the data's shape, the latent space and the text encoder are resolved:
// model.unet becomes the UNet's absolute folder (a pipeline directory's unet/), unet_sha256 the sha256
// of its config.json (a value already set must match: the architecture must not have changed). The
// UNet must take model.in_channels and give as many, its downsampling must divide model.image_size,
// its cross_attention_dim must be model.text_dim, and the model has no classes (num_classes -1
// becomes 0). Throws ddm::Error naming the key, the folder and what to change.
void resolve_sd_unet(ModelConfig& m);

// model.controlnet of an sd-unet model: a ControlNet (diffusers' ControlNetModel) is trained on the
// locked UNet. Its value is a ControlNetModel folder (or a pipeline directory's controlnet/) to start
// from, made absolute, or kControlNetFromUnet: a new one, copied from the UNet's encoder as diffusers'
// from_unet does. resolve_sd_unet checks that it fits the UNet and takes control images as many times
// the UNet's input as the images are the latents, that the UNet has weights, and sets
// controlnet_sha256 to the sha256 of the UNet's weights (a value already set must match).
inline constexpr const char* kControlNetFromUnet = "from-unet";

// For a resolved sd-unet ControlNet (make_network's): loads the locked UNet's weights, checked
// against model.controlnet_sha256. The ControlNet's own starting weights are load_pretrained's.
void attach_sd_controlnet(NetImpl& net, const ModelConfig& m);

// diffusion.scheduler, when set: a diffusers scheduler (scheduler_config.json, its folder, or a
// pipeline directory's scheduler/) becomes schedule = discrete and its beta_schedule, beta_start,
// beta_end and timesteps (num_train_timesteps); the path is made absolute. Its prediction_type must be
// the objective (epsilon: eps, v_prediction: v; "sample" is not trained by ddm).
void resolve_scheduler(DiffusionConfig& d);

// The network cfg describes, with its initial weights (sd-unet: from its initialization, not its
// folder's weights; see load_pretrained). sd-unet's config.json is checked against model.unet_sha256.
Net make_network(const RunConfig& cfg);

// A fresh run's starting weights where the model has them: sd-unet with weights in its folder (to
// fine-tune); an sd-unet ControlNet's from model.controlnet's folder, or copied from the UNet's
// encoder (after attach_sd_controlnet). Returns a line saying what was loaded, "" when nothing was.
std::string load_pretrained(NetImpl& net, const ModelConfig& m);

// How a run names its network in what it prints: "unet-tiny (unet)", or for sd-unet "sd-unet
// (diffusers' UNet2DConditionModel of DIR)".
std::string network_name(const ModelConfig& m);

// forward_flops_per_image for every architecture (sd-unet: from its config.json, at text_tokens tokens).
double network_flops_per_image(const ModelConfig& m);

}  // namespace ddm
