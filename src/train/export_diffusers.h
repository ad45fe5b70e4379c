// A run's model written as a diffusers Stable Diffusion pipeline directory (`ddm export --diffusers`):
// what StableDiffusionPipeline.from_pretrained opens, so that the people who sample and serve with
// diffusers can use a model ddm trained. The model must be diffusers' UNet (model.arch = sd-unet) on
// diffusers' VAE (model.latent) with transformers' CLIP text encoder, trained on the discrete schedule:
//   unet/          the run's UNet (EMA weights unless told otherwise), config.json + safetensors
//   vae/           the frozen VAE's files, its scaling_factor and shift_factor set to the run's
//   text_encoder/  the frozen text encoder's files (a pipeline's text_encoder/, or a transformers
//   tokenizer/     CLIPTextModel folder) and its tokenizer's
//   scheduler/     the scheduler the run was trained with (diffusion.scheduler), or an
//                  EulerDiscreteScheduler of its discrete schedule and prediction type
//   model_index.json
// A ControlNet on the UNet (model.controlnet) becomes a StableDiffusionControlNetPipeline: controlnet/
// holds the run's ControlNetModel (EMA weights unless told otherwise), unet/ the locked UNet's files.
// The directory is written under a temporary name and renamed when complete: an error leaves nothing.
#pragma once
#include <string>

#include "train/loaded_model.h"

namespace ddm {

// Throws ddm::Error naming what does not fit a Stable Diffusion pipeline, and `out` when it exists.
// Returns a one-line description of what was written.
std::string export_diffusers(const LoadedModel& m, const std::string& out);

}  // namespace ddm
