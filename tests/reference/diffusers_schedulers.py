"""diffusers' schedulers as Stable Diffusion's pipelines ship them, for tests/unit/sd/test_scheduler.cpp.

Each directory holds a scheduler diffusers built from a config and wrote with save_config
(scheduler_config.json, with every key the class writes), and alphas_cumprod.safetensors with the
scheduler's own alphas_cumprod:
  sd15   PNDMScheduler as SD 1.5's: scaled_linear from 0.00085 to 0.012, epsilon, skip_prk_steps
  sd21   DDIMScheduler as SD 2.1's (768): the same betas, v_prediction
  ddpm   DDPMScheduler with the linear schedule of DDPM (1e-4 to 0.02)
  cosine DDPMScheduler with squaredcos_cap_v2
  euler  EulerDiscreteScheduler over SD's betas

Usage: python diffusers_schedulers.py OUT_DIR   (the reference environment's python)
"""
import os
import sys

from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler, PNDMScheduler
from safetensors.torch import save_file

SD = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
MADE = {
    "sd15": PNDMScheduler(**SD, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1),
    "sd21": DDIMScheduler(**SD, clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                          prediction_type="v_prediction"),
    "ddpm": DDPMScheduler(),
    "cosine": DDPMScheduler(beta_schedule="squaredcos_cap_v2"),
    "euler": EulerDiscreteScheduler(**SD, steps_offset=1),
}


def main():
    out_dir = sys.argv[1]
    for name, scheduler in MADE.items():
        path = os.path.join(out_dir, name)
        scheduler.save_config(path)
        save_file({"alphas_cumprod": scheduler.alphas_cumprod.contiguous()},
                  os.path.join(path, "alphas_cumprod.safetensors"))
    print("wrote", ", ".join(MADE), "into", out_dir)


if __name__ == "__main__":
    main()
