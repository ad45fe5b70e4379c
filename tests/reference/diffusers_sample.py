"""Samples a pipeline directory with diffusers' own StableDiffusionPipeline (or, given --control,
StableDiffusionControlNetPipeline), for tests/integration/test_sd_train.cpp and test_sd_controlnet.cpp:
a model ddm trained and exported (`ddm export --diffusers`) must give, from the same initial noise,
prompts, control images, guidance and steps, the images `ddm sample` gives.

The pipeline's scheduler is swapped for EulerDiscreteScheduler with Karras sigmas over linspace
timesteps: the sigmas from the schedule's noisiest timestep to its least noisy one with rho = 7, then
0, which are the times ddm's samplers visit on the discrete path (src/diffusion/sampler.h), and its
Euler step in diffusers' sigma space is ddm's ddim step. The one difference of convention, where
each starts (see below), is undone by scaling the noise the pipeline is handed.

Writes OUT_FILE with
  latents  what the pipeline sampled (output_type="latent")  [N, 4, h, w]
  images   those latents decoded by the pipeline's VAE, in [-1, 1]  [N, 3, H, W]

Usage: python diffusers_sample.py [--control FILE] PIPELINE_DIR NOISE_FILE OUT_FILE STEPS GUIDANCE PROMPT...
       (NOISE_FILE: safetensors with `noise` [N, 4, h, w]; --control FILE: safetensors with `image`
       [N, 3, H, W] in [0, 1], the control images; the reference environment's python)
"""
import sys

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from safetensors.torch import load_file, save_file


def main():
    args = sys.argv[1:]
    control = None
    if args[0] == "--control":
        control = load_file(args[1])["image"]
        args = args[2:]
    pipe_dir, noise_file, out_file, steps, guidance = args[:5]
    prompts = args[5:]
    torch.set_num_threads(1)
    kind = StableDiffusionPipeline if control is None else StableDiffusionControlNetPipeline
    pipe = kind.from_pretrained(pipe_dir, torch_dtype=torch.float32)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True,
                                                        timestep_spacing="linspace")
    pipe.set_progress_bar_config(disable=True)
    noise = load_file(noise_file)["noise"]
    # ddm's x at t = 1 is the noise itself (alpha^2 + sigma^2 = 1 on its VP paths); with linspace
    # spacing this scheduler starts from init_noise_sigma = sigma_max times the latents in its sigma
    # space, where that x is sqrt(sigma_max^2 + 1) times the noise: so it is handed the noise scaled by
    # the ratio, and both start from the same x.
    pipe.scheduler.set_timesteps(int(steps))
    sigma_max = pipe.scheduler.sigmas.max()
    noise = noise * ((sigma_max**2 + 1) ** 0.5 / pipe.scheduler.init_noise_sigma)
    with torch.no_grad():
        extra = {} if control is None else {"image": control}
        latents = pipe(prompt=prompts, latents=noise, num_inference_steps=int(steps), guidance_scale=float(guidance),
                       output_type="latent", **extra).images
        images = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample.clamp(-1, 1)
    save_file({"latents": latents.contiguous(), "images": images.contiguous()}, out_file)
    print("sampled", len(prompts), "prompts with diffusers'", kind.__name__, "into", out_file)


if __name__ == "__main__":
    main()
