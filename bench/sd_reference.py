"""Stable Diffusion 2.1's UNet and VAE in diffusers, timed as ddm's are by bench/bench_sd.cpp: made by
diffusers from SD 2.1's configs (randomly initialised, seeded, as in tests/reference/diffusers_unet.py
and diffusers_vae.py), saved for ddm to read, and run on one seeded batch in PyTorch eager and under
torch.compile (inductor): the UNet's forward + backward of a seeded loss (a training step's compute,
on latents of SIZE x SIZE and 77 text states of 1024), and the VAE's encoder forward without gradients
(the frozen work of SD training) plus its whole forward + backward (images of 8 SIZE). The inputs and
diffusers' outputs are saved so that ddm's are compared on the same input. One JSON line each: the
first call (with torch.compile: the compilation) and the best of REPEAT further calls. Last, the UNet's
forward + backward in eager with diffusers' gradient checkpointing on (enable_gradient_checkpointing).

Usage: python sd_reference.py DIR BATCH SIZE THREADS [REPEAT] [COMPILE=1]   (the reference environment's python)
       python sd_reference.py --config-only DIR   (DIR/unet/config.json alone, for ddm_bench_sd --memory)
"""
import json
import os
import sys
import time

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from safetensors.torch import save_file

UNET = dict(sample_size=96, in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280, 1280], layers_per_block=2,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, attention_head_dim=[5, 10, 20, 20],
            cross_attention_dim=1024, use_linear_projection=True, upcast_attention=True)
VAE = dict(in_channels=3, out_channels=3, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
           down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4, latent_channels=4,
           sample_size=768)


def timed(fn, repeat):
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return out, first, best


def main():
    if sys.argv[1] == "--config-only":
        with torch.device("meta"):  # the config alone: no weights made
            UNet2DConditionModel(**UNET).save_config(os.path.join(sys.argv[2], "unet"))
        return
    out_dir, batch, size, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    repeat = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    with_compile = (sys.argv[6] if len(sys.argv) > 6 else "1") == "1"
    torch.set_num_threads(threads)
    torch.manual_seed(20261129)
    unet = UNet2DConditionModel(**UNET)
    vae = AutoencoderKL(**VAE)
    unet.save_pretrained(os.path.join(out_dir, "unet"), safe_serialization=True)
    vae.save_pretrained(os.path.join(out_dir, "vae"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(batch, 4, size, size, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g).float()
    context = torch.randn(batch, 77, 1024, generator=g)
    weight = torch.randn(batch, 4, size, size, generator=g)
    images = torch.rand(batch, 3, 8 * size, 8 * size, generator=g) * 2 - 1
    with torch.no_grad():
        out = unet(sample, timestep, encoder_hidden_states=context).sample
        mean = vae.encode(images).latent_dist.mean
    save_file({"sample": sample, "timestep": timestep, "context": context, "weight": weight, "out": out.contiguous(),
               "images": images, "mean": mean.contiguous()}, os.path.join(out_dir, "bench.safetensors"))
    params = sum(p.numel() for p in unet.parameters())
    for impl in ("python", "python-compile") if with_compile else ("python",):
        compiled = impl == "python-compile"
        run_unet = torch.compile(unet) if compiled else unet
        run_vae = torch.compile(vae) if compiled else vae
        run_encode = torch.compile(vae.encode) if compiled else vae.encode  # (compiling vae compiles its forward only)

        def unet_step():
            unet.zero_grad(set_to_none=True)
            (run_unet(sample, timestep, encoder_hidden_states=context).sample * weight).sum().backward()

        def vae_encode():
            with torch.no_grad():
                return run_encode(images).latent_dist.mean

        def vae_step():
            vae.zero_grad(set_to_none=True)
            run_vae(images).sample.square().mean().backward()

        for what, fn in (("unet forward+backward", unet_step), ("vae encode", vae_encode),
                         ("vae forward+backward", vae_step)):
            _, first, best = timed(fn, repeat)
            print(json.dumps({"impl": impl, "model": "SD 2.1 " + what, "unet_params": params, "batch": batch,
                              "latent": size, "threads": threads, "first_s": round(first, 3), "best_s": round(best, 3)}),
                  flush=True)
    # diffusers' own activation checkpointing (torch.utils.checkpoint around each block), in eager.
    unet.enable_gradient_checkpointing()

    def unet_step_checkpointed():
        unet.zero_grad(set_to_none=True)
        (unet(sample, timestep, encoder_hidden_states=context).sample * weight).sum().backward()

    _, first, best = timed(unet_step_checkpointed, repeat)
    print(json.dumps({"impl": "python", "model": "SD 2.1 unet forward+backward, checkpointed", "unet_params": params,
                      "batch": batch, "latent": size, "threads": threads, "first_s": round(first, 3),
                      "best_s": round(best, 3)}), flush=True)


if __name__ == "__main__":
    main()
