"""diffusers' AutoencoderKL made, saved and run by diffusers itself, for
tests/unit/sd/test_autoencoder_kl.cpp.

Each directory holds a model diffusers built from its config with random weights (seeded, then
every parameter moved by a little noise so that no GroupNorm stays at 1 and 0 and a swapped key
shows), written by save_pretrained (config.json + diffusion_pytorch_model.safetensors), and
reference.safetensors with what diffusers computes on seeded inputs:
  x        the images fed to encode                        [2, in_channels, S, S]
  mean     encode(x).latent_dist.mean                      [2, z, S/f, S/f]
  logvar   encode(x).latent_dist.logvar (clamped)          [2, z, S/f, S/f]
  z        the latents fed to decode                       [2, z, S/f, S/f]
  decoded  decode(z).sample                                [2, out_channels, S, S]

The configs are the architectures users keep, as their repositories' vae/config.json give them:
  sd    Stable Diffusion 1.x / 2.x and sd-vae-ft-mse: block_out_channels [128, 256, 512, 512],
        2 layers per block, 32 groups, 4 latent channels, scaling_factor 0.18215
  sdxl  SDXL's: the same network, scaling_factor 0.13025
  flux  a 16-channel one as FLUX.1's: no quant convolutions, scaling_factor 0.3611, shift_factor 0.1159
  gray  (small only) SD's kind for one-channel 28x28 images, f = 2: the one the latent training tests
        put under a model trained on Fashion-MNIST
The gray one is also written sharded (gray-sharded/: save_pretrained's max_shard_size cut to 100KB:
diffusion_pytorch_model-0000K-of-0000N.safetensors and their .index.json) and as a PyTorch pickle
(gray-bin/: safe_serialization=False), as older repositories keep theirs.
With "small", each keeps its kind (latent channels, quant convolutions, the factors, f = 8 for sd)
but is cut to widths [32, 32, 64, 64] (flux: [32, 64]), 1 layer per block and 8 groups; "full"
keeps the real sizes (sd: 83.7M parameters) at S = 64.

Usage: python diffusers_vae.py OUT_DIR small|full   (the reference environment's python)
"""
import os
import sys

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file

SD = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
          block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
          up_block_types=["UpDecoderBlock2D"] * 4, act_fn="silu", sample_size=512, scaling_factor=0.18215)
CONFIGS = {
    "sd": SD,
    "sdxl": dict(SD, sample_size=1024, scaling_factor=0.13025, force_upcast=True),
    "flux": dict(SD, latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                 use_post_quant_conv=False, sample_size=1024),
    "gray": dict(SD, in_channels=1, out_channels=1, sample_size=28),
}


def make(out_dir, name, small, seed):
    config = dict(CONFIGS[name])
    if small:
        levels = 2 if name in ("flux", "gray") else 4
        config.update(block_out_channels=[32, 32, 64, 64][:levels] if levels == 4 else [32, 64], layers_per_block=1,
                      norm_num_groups=8, down_block_types=["DownEncoderBlock2D"] * levels,
                      up_block_types=["UpDecoderBlock2D"] * levels)
    torch.manual_seed(seed)
    vae = AutoencoderKL(**config).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = os.path.join(out_dir, name)
    vae.save_pretrained(path, safe_serialization=True)
    if name == "gray":
        vae.save_pretrained(path + "-sharded", safe_serialization=True, max_shard_size="100KB")
        vae.save_pretrained(path + "-bin", safe_serialization=False)
    f = 2 ** (len(config["block_out_channels"]) - 1)
    side = 28 if name == "gray" else 32 if small else 64
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.rand(2, config["in_channels"], side, side, generator=g) * 2 - 1
    z = torch.randn(2, config["latent_channels"], side // f, side // f, generator=g)
    with torch.no_grad():
        dist = vae.encode(x).latent_dist
        decoded = vae.decode(z).sample
    save_file({"x": x, "mean": dist.mean.contiguous(), "logvar": dist.logvar.contiguous(), "z": z,
               "decoded": decoded.contiguous()}, os.path.join(path, "reference.safetensors"))


def main():
    out_dir, size = sys.argv[1], sys.argv[2]
    assert size in ("small", "full"), size
    torch.set_num_threads(1)
    names = [n for n in CONFIGS if size == "small" or n != "gray"]
    for i, name in enumerate(names):
        make(out_dir, name, size == "small", 10 + i)
    print("wrote", ", ".join(names), "into", out_dir)


if __name__ == "__main__":
    main()
