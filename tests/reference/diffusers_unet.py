"""diffusers' UNet2DConditionModel made, saved and run by diffusers itself, for
tests/unit/sd/test_unet_2d_condition.cpp.

Each directory holds a model diffusers built from its config with random weights (seeded, then every
parameter moved by a little noise, so that the zero-initialised output convolution and the norms do
not hide a swapped key), written by save_pretrained (config.json +
diffusion_pytorch_model.safetensors), and reference.safetensors with what diffusers computes:
  sample    noisy latents                                  [2, 4, S, S]
  timestep  one per sample (diffusers' 0..999 scale)       [2]
  context   encoder_hidden_states                          [2, 7, cross_attention_dim]
  out       unet(sample, timestep, context).sample         [2, 4, S, S]
  weight    a seeded weight w for the loss (out * w).sum()  [2, 4, S, S]
  grad.NAME that loss's gradient of a few parameters (NAME as diffusers names them)

The configs are the two UNets the pipeline seed measures, as their repositories' unet/config.json
give them:
  sd15  Stable Diffusion 1.5: block_out_channels [320, 640, 1280, 1280], 2 layers per block, three
        CrossAttnDownBlock2D and a DownBlock2D, 8 heads, cross_attention_dim 768, 1x1 conv projections
  sd21  Stable Diffusion 2.1: the same widths, heads of 64 channels (attention_head_dim [5, 10, 20,
        20]), cross_attention_dim 1024, linear projections, upcast_attention
With "small", each keeps its kind but is cut to widths [32, 64], 1 layer per block, 8 groups,
cross_attention_dim 32 / 48 at S = 8; "full" keeps the real sizes (sd21: 865M parameters) at S = 32.

Usage: python diffusers_unet.py OUT_DIR small|full   (the reference environment's python)
"""
import os
import sys

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file

SD15 = dict(sample_size=64, in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280, 1280],
            layers_per_block=2, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, attention_head_dim=8,
            cross_attention_dim=768, norm_num_groups=32, norm_eps=1e-5, act_fn="silu", flip_sin_to_cos=True,
            freq_shift=0, downsample_padding=1, mid_block_scale_factor=1, center_input_sample=False)
CONFIGS = {
    "sd15": SD15,
    "sd21": dict(SD15, sample_size=96, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024,
                 use_linear_projection=True, upcast_attention=True),
}
GRADS = ["conv_in.weight", "time_embedding.linear_1.weight", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
         "mid_block.resnets.0.time_emb_proj.weight", "up_blocks.1.resnets.0.conv_shortcut.weight", "conv_out.bias"]


def make(out_dir, name, small, seed):
    config = dict(CONFIGS[name])
    if small:
        config.update(block_out_channels=[32, 64], layers_per_block=1, norm_num_groups=8,
                      down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                      up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
                      attention_head_dim=2 if name == "sd15" else [2, 4],
                      cross_attention_dim=32 if name == "sd15" else 48)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**config)
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = os.path.join(out_dir, name)
    unet.save_pretrained(path, safe_serialization=True)
    side = 8 if small else 32
    g = torch.Generator().manual_seed(seed + 1)
    sample = torch.randn(2, 4, side, side, generator=g)
    timestep = torch.tensor([17.0, 803.0])
    context = torch.randn(2, 7, config["cross_attention_dim"], generator=g)
    weight = torch.randn(2, 4, side, side, generator=g)
    out = unet(sample, timestep, encoder_hidden_states=context).sample
    (out * weight).sum().backward()
    params = dict(unet.named_parameters())
    grads = {"grad." + n: params[n].grad.contiguous() for n in GRADS if n in params}
    save_file({"sample": sample, "timestep": timestep, "context": context, "out": out.detach().contiguous(),
               "weight": weight, **grads}, os.path.join(path, "reference.safetensors"))


def main():
    out_dir, size = sys.argv[1], sys.argv[2]
    assert size in ("small", "full"), size
    torch.set_num_threads(1)
    for i, name in enumerate(CONFIGS):
        make(out_dir, name, size == "small", 20 + i)
    print("wrote", ", ".join(CONFIGS), "into", out_dir)


if __name__ == "__main__":
    main()
