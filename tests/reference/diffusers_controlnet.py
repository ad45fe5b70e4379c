"""diffusers' ControlNetModel on a UNet2DConditionModel, made, saved and run by diffusers itself, for
tests/unit/sd/test_controlnet_model.cpp.

SIZE small (the default): for each of the two UNet kinds of diffusers_unet.py (sd15: 1x1 conv
projections, 8 heads; sd21: linear projections, heads per level, upcast attention), cut to widths
[32, 64], one layer per block, 8 groups, on latents [2, 4, 8, 8]. SIZE full: ControlNet v1.0 on SD
1.5's UNet at full size (860M + 361M parameters, 77 text states of 768), "sd15" only, on latents
[1, 4, 32, 32] (256 px control images). OUT_DIR/NAME holds:
  unet/        the UNet (seeded, every parameter moved by a little noise), save_pretrained
  from_unet/   ControlNetModel.from_unet(unet) as diffusers makes it, untouched: the encoder copied,
               the zero convolutions zero (its conditioning embedding's first layers are random)
  controlnet/  that ControlNet with every parameter moved by a little noise, so that no zero layer
               hides a swapped key (sd21's with controlnet_conditioning_channel_order = "bgr")
  reference.safetensors:
    sample    noisy latents [B, 4, S, S]; timestep [B] (diffusers' scale); context [B, T, C]
    cond      the control image [B, 3, 8 S, 8 S] (8 x the latents' size: the default embedding widths)
    down.I    controlnet(sample, timestep, context, cond, conditioning_scale).down_block_res_samples[I]
    mid       ... .mid_block_res_sample
    scale     conditioning_scale, float64 [1]
    out       unet(sample, timestep, context, down_block_additional_residuals=down,
                   mid_block_additional_residual=mid).sample
    weight    a seeded weight w for the loss (out * w).sum()
    grad.NAME that loss's gradient of a few of the ControlNet's parameters (diffusers' names)
    flops     the ControlNet's forward FLOPs for one sample, as torch.utils.flop_counter counts them
              (float64 [1]), attention on PyTorch's math backend

Usage: python diffusers_controlnet.py OUT_DIR [small|full]   (the reference environment's python)
"""
import os
import sys

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

BASE = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=[32, 64], layers_per_block=1,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
            norm_num_groups=8, norm_eps=1e-5, act_fn="silu")
CONFIGS = {
    "sd15": dict(BASE, attention_head_dim=2, cross_attention_dim=32),
    "sd21": dict(BASE, attention_head_dim=[2, 4], cross_attention_dim=48, use_linear_projection=True,
                 upcast_attention=True),
}
FULL = {
    "sd15": dict(sample_size=64, in_channels=4, out_channels=4, block_out_channels=[320, 640, 1280, 1280],
                 layers_per_block=2, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, attention_head_dim=8,
                 cross_attention_dim=768, norm_num_groups=32),
}
GRADS = ["controlnet_cond_embedding.conv_in.weight", "controlnet_cond_embedding.conv_out.weight", "conv_in.weight",
         "time_embedding.linear_1.weight", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
         "controlnet_down_blocks.0.weight", "controlnet_down_blocks.3.bias", "controlnet_mid_block.weight"]


def moved(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return module


def make(out_dir, name, seed, full):
    config = (FULL if full else CONFIGS)[name]
    torch.manual_seed(seed)
    unet = moved(UNet2DConditionModel(**config), seed + 1)
    path = os.path.join(out_dir, name)
    unet.save_pretrained(os.path.join(path, "unet"), safe_serialization=True)
    torch.manual_seed(seed + 2)
    ControlNetModel.from_unet(unet).save_pretrained(os.path.join(path, "from_unet"), safe_serialization=True)
    torch.manual_seed(seed + 2)
    controlnet = ControlNetModel.from_unet(unet)
    if name == "sd21":
        controlnet.register_to_config(controlnet_conditioning_channel_order="bgr")
    moved(controlnet, seed + 3)
    controlnet.save_pretrained(os.path.join(path, "controlnet"), safe_serialization=True)

    g = torch.Generator().manual_seed(seed + 4)
    b, s, tokens = (1, 32, 77) if full else (2, 8, 7)
    sample = torch.randn(b, 4, s, s, generator=g)
    timestep = torch.tensor([17.0, 803.0])[:b]
    context = torch.randn(b, tokens, config["cross_attention_dim"], generator=g)
    cond = torch.rand(b, 3, 8 * s, 8 * s, generator=g)
    weight = torch.randn(b, 4, s, s, generator=g)
    scale = 0.75 if name == "sd21" else 1.0
    down, mid = controlnet(sample, timestep, context, cond, conditioning_scale=scale, return_dict=False)
    out = unet(sample, timestep, context, down_block_additional_residuals=down,
               mid_block_additional_residual=mid).sample
    (out * weight).sum().backward()
    params = dict(controlnet.named_parameters())
    grads = {"grad." + n: params[n].grad.contiguous() for n in GRADS}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        controlnet(sample[:1], timestep[:1], context[:1], cond[:1], return_dict=False)
    tensors = {"sample": sample, "timestep": timestep, "context": context, "cond": cond, "mid": mid.detach().contiguous(),
               "scale": torch.tensor([scale], dtype=torch.float64), "out": out.detach().contiguous(), "weight": weight,
               "flops": torch.tensor([float(counter.get_total_flops())], dtype=torch.float64), **grads}
    for i, d in enumerate(down):
        tensors[f"down.{i}"] = d.detach().contiguous()
    save_file(tensors, os.path.join(path, "reference.safetensors"))


def main():
    out_dir = sys.argv[1]
    full = (sys.argv[2] if len(sys.argv) > 2 else "small") == "full"
    torch.set_num_threads(2 if full else 1)
    configs = FULL if full else CONFIGS
    for i, name in enumerate(configs):
        make(out_dir, name, 40 + 10 * i, full)
    print("wrote", ", ".join(configs), "into", out_dir)


if __name__ == "__main__":
    main()
