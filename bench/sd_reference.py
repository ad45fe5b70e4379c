"""Stable Diffusion 2.1's UNet and VAE in diffusers, timed as ddm's are by bench/bench_sd.cpp: made by
diffusers from SD 2.1's configs (randomly initialised, seeded, as in tests/reference/diffusers_unet.py
and diffusers_vae.py), saved for ddm to read, and run on one seeded batch in PyTorch eager and under
torch.compile (inductor): the UNet's forward + backward of a seeded loss (a training step's compute,
on latents of SIZE x SIZE and 77 text states of 1024), and the VAE's encoder forward without gradients
(the frozen work of SD training) plus its whole forward + backward (images of 8 SIZE). The inputs and
diffusers' outputs are saved so that ddm's are compared on the same input. One JSON line each: the
first call (with torch.compile: the compilation) and the best of REPEAT further calls. Last, the UNet's
forward + backward in eager with diffusers' gradient checkpointing on (enable_gradient_checkpointing).

On a GPU (DEVICE cuda) the networks and inputs move there after the reference outputs are computed
on the CPU in float32, the forwards run under autocast in PRECISION (bf16 or fp32), and each timed
call ends with a synchronization (bench_sd.cpp's --device and --precision do the same).

Usage: python sd_reference.py DIR BATCH SIZE THREADS [REPEAT] [COMPILE=1] [DEVICE=cpu] [PRECISION=fp32]
       (the reference environment's python)
       python sd_reference.py --config-only DIR   (DIR/unet/config.json alone, for ddm_bench_sd --memory)
       python sd_reference.py --step CONFIG BATCH SIZE DEVICE PRECISION [REPEAT] [COMPILE=none|default|reduce-overhead]
       python sd_reference.py --controlnet-step CONFIG BATCH SIZE DEVICE PRECISION [REPEAT] [COMPILE=none|...]
       python sd_reference.py --config-only DIR sd15   (SD 1.5's UNet config, the ControlNet steps' UNet)

The --step mode is ddm_bench_sd --memory's training step in diffusers (bench/bench_sd.cpp): the UNet
made from CONFIG (random weights) on DEVICE, forward under autocast (bf16) or not (fp32), the MSE
against a random target in float32, backward, the global norm clipped to 1, torch.optim.AdamW (fused
on CUDA; lr 1e-5, weight decay 0) and an EMA (decay 0.9999) of every parameter. One JSON line: the
best of REPEAT steps after a first (with torch.compile: the compilation, timed), the peak memory of
the step and the step's FLOPs (torch.utils.flop_counter), for an MFU.

The --controlnet-step mode is ddm_bench_sd --memory CONFIG --controlnet on's step in diffusers, as its
examples/controlnet/train_controlnet.py steps: the UNet made from CONFIG locked (requires_grad off and,
under bf16, held in bfloat16 as the script holds it in its weight_dtype), ControlNetModel.from_unet(unet)
trained; the ControlNet's residuals from the noisy latents, the text states and an RGB control image
in [0, 1] of 8x the latents' size, the UNet's prediction with them added, the MSE, backward, clipping,
AdamW and the EMA on the ControlNet's parameters.
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
# Stable Diffusion 1.5's UNet (860M; 8 heads, 1x1 convolution projections, CLIP ViT-L's 768 text states):
# ControlNet v1.0's locked UNet.
SD15_UNET = dict(UNET, sample_size=64, attention_head_dim=8, cross_attention_dim=768, use_linear_projection=False,
                 upcast_attention=False)


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


def autocast(device, precision):
    """Autocast to bfloat16 on DEVICE's type when PRECISION is bf16; a no-op context for fp32."""
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=precision == "bf16")


def sync(device):
    """Waits for DEVICE's queued work (a GPU's), so that a timed call ends when its work does."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step(config, batch, size, device, precision, repeat, compile_mode, controlnet=False):
    """The --step and --controlnet-step modes (see the top of this file)."""
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    with open(config) as f:
        unet = UNet2DConditionModel.from_config(json.load(f)).to(device)
    trained, cn, hint = unet, None, None
    if controlnet:
        from diffusers import ControlNetModel
        cn = ControlNetModel.from_unet(unet).to(device)
        unet.requires_grad_(False)
        if precision == "bf16":
            unet.to(dtype=torch.bfloat16)  # train_controlnet.py's weight_dtype for the frozen UNet
        trained = cn
        hint = torch.rand(batch, 3, 8 * size, 8 * size, device=device)
    params = list(trained.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=device.startswith("cuda"))
    ema = [p.detach().clone() for p in params]
    run = unet if compile_mode == "none" else torch.compile(unet, mode=compile_mode)
    run_cn = cn if compile_mode == "none" or cn is None else torch.compile(cn, mode=compile_mode)
    x = torch.randn(batch, unet.config.in_channels, size, size, device=device)
    t = torch.rand(batch, device=device) * 1000
    target = torch.randn_like(x)
    context = torch.randn(batch, 77, unet.config.cross_attention_dim, device=device)

    def forward(unet_fn, cn_fn):
        if cn is None:
            return unet_fn(x, t, encoder_hidden_states=context).sample
        down, mid = cn_fn(x, t, encoder_hidden_states=context, controlnet_cond=hint, return_dict=False)
        return unet_fn(x, t, encoder_hidden_states=context, down_block_additional_residuals=down,
                       mid_block_additional_residual=mid).sample

    def step():
        opt.zero_grad(set_to_none=False)
        with autocast(device, precision):
            out = forward(run, run_cn)
        torch.nn.functional.mse_loss(out.float(), target).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - 0.9999)
        sync(device)

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _, first, best = timed(step, repeat)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    counter = FlopCounterMode(display=False)
    with counter:  # eager, so that every op is counted
        opt.zero_grad(set_to_none=False)
        with autocast(device, precision):
            out = forward(unet, cn)
        torch.nn.functional.mse_loss(out.float(), target).backward()
    impl = "diffusers" if compile_mode == "none" else "diffusers-compile"
    model = "sd-controlnet step" if controlnet else "sd-unet step"
    print(json.dumps({"impl": impl, "compile_mode": compile_mode, "model": model, "params": sum(p.numel() for p in params), "batch": batch, "latent": size,
                      "device": device, "precision": precision, "first_s": round(first, 3), "best_s": round(best, 4),
                      "peak_gib": peak, "flops": counter.get_total_flops()}), flush=True)


def main():
    if sys.argv[1] in ("--step", "--controlnet-step"):
        a = sys.argv[2:]
        train_step(a[0], int(a[1]), int(a[2]), a[3], a[4], int(a[5]) if len(a) > 5 else 3,
                   a[6] if len(a) > 6 else "none", controlnet=sys.argv[1] == "--controlnet-step")
        return
    if sys.argv[1] == "--config-only":
        config = SD15_UNET if len(sys.argv) > 3 and sys.argv[3] == "sd15" else UNET
        with torch.device("meta"):  # the config alone: no weights made
            UNet2DConditionModel(**config).save_config(os.path.join(sys.argv[2], "unet"))
        return
    out_dir, batch, size, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    repeat = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    with_compile = (sys.argv[6] if len(sys.argv) > 6 else "1") == "1"
    device = sys.argv[7] if len(sys.argv) > 7 else "cpu"
    precision = sys.argv[8] if len(sys.argv) > 8 else "fp32"
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
    unet.to(device), vae.to(device)
    sample, timestep, context, weight, images = (v.to(device) for v in (sample, timestep, context, weight, images))
    for impl in ("python", "python-compile") if with_compile else ("python",):
        compiled = impl == "python-compile"
        run_unet = torch.compile(unet) if compiled else unet
        run_vae = torch.compile(vae) if compiled else vae
        run_encode = torch.compile(vae.encode) if compiled else vae.encode  # (compiling vae compiles its forward only)

        def unet_step():
            unet.zero_grad(set_to_none=True)
            with autocast(device, precision):
                out = run_unet(sample, timestep, encoder_hidden_states=context).sample
            (out.float() * weight).sum().backward()
            sync(device)

        def vae_encode():
            with torch.no_grad(), autocast(device, precision):
                mean = run_encode(images).latent_dist.mean
            sync(device)
            return mean

        def vae_step():
            vae.zero_grad(set_to_none=True)
            with autocast(device, precision):
                decoded = run_vae(images).sample
            decoded.float().square().mean().backward()
            sync(device)

        for what, fn in (("unet forward+backward", unet_step), ("vae encode", vae_encode),
                         ("vae forward+backward", vae_step)):
            _, first, best = timed(fn, repeat)
            print(json.dumps({"impl": impl, "model": "SD 2.1 " + what, "unet_params": params, "batch": batch,
                              "latent": size, "threads": threads, "device": device, "precision": precision,
                              "first_s": round(first, 3), "best_s": round(best, 4)}), flush=True)
    # diffusers' own activation checkpointing (torch.utils.checkpoint around each block), in eager.
    unet.enable_gradient_checkpointing()

    def unet_step_checkpointed():
        unet.zero_grad(set_to_none=True)
        with autocast(device, precision):
            out = unet(sample, timestep, encoder_hidden_states=context).sample
        (out.float() * weight).sum().backward()
        sync(device)

    _, first, best = timed(unet_step_checkpointed, repeat)
    print(json.dumps({"impl": "python", "model": "SD 2.1 unet forward+backward, checkpointed", "unet_params": params,
                      "batch": batch, "latent": size, "threads": threads, "first_s": round(first, 3),
                      "best_s": round(best, 3)}), flush=True)


if __name__ == "__main__":
    main()
