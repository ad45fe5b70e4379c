"""A small Stable Diffusion pipeline made and saved by diffusers itself, for the tests of training and
sampling diffusers' UNet in ddm (tests/unit/sd/test_unet_net.cpp, tests/integration/test_sd_train.cpp).

OUT_DIR/sd is what StableDiffusionPipeline.save_pretrained writes: model_index.json and
  unet/          UNet2DConditionModel of SD 2.1's kind (linear projections, heads per level, upcast
                 attention) cut to widths [32, 64], one layer per block, 8 groups, cross_attention_dim 32
  vae/           AutoencoderKL with widths [32, 64] (downsampling 2), 4 latent channels
  text_encoder/  transformers' CLIPTextModel of 2 layers of width 32 (gelu, as SD 2.x's)
  tokenizer/     transformers' CLIPTokenizer with CLIP's own vocabulary and merges (open_clip's)
  scheduler/     DDIMScheduler as SD 2.1 configures it: scaled_linear betas 0.00085..0.012 over 1000
                 timesteps, v_prediction
Every network is seeded and then moved by a little noise, so that no zero-initialised layer hides a
mistake.

OUT_DIR/pixel-unet/config.json is the same UNet for 3-channel images, its config alone (save_config): a
UNet to train from its initialisation.

OUT_DIR/step.safetensors is one training step as diffusers' train_text_to_image.py computes it with
that UNet and scheduler:
  latents   x0 [2, 4, 8, 8]; noise [2, 4, 8, 8]; timesteps int64 [2]; context [2, 77, 32]
  noisy     scheduler.add_noise(latents, noise, timesteps)
  target    scheduler.get_velocity(latents, noise, timesteps)  (v_prediction)
  pred      unet(noisy, timesteps, context)
  loss      mse(pred, target), a scalar
  grad.NAME that loss's gradient of a few parameters (NAME as diffusers names them)
  flops     the forward FLOPs of one sample, as torch.utils.flop_counter counts them (float64 [1]), with
            attention on PyTorch's math backend (the counter sees no matmul inside the CPU's fused one)

Usage: python diffusers_pipeline.py OUT_DIR   (the reference environment's python)
"""
import os
import sys

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from open_clip.tokenizer import SimpleTokenizer
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

GRADS = ["conv_in.weight", "time_embedding.linear_1.weight", "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
         "mid_block.resnets.0.time_emb_proj.weight", "conv_out.bias"]


def moved(module, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return module


def tokenizer(root):
    tok = SimpleTokenizer()
    vocab = dict(tok.encoder)
    vocab["<|startoftext|>"] = vocab.pop("<start_of_text>")
    vocab["<|endoftext|>"] = vocab.pop("<end_of_text>")
    merges = [m for m, _ in sorted(tok.bpe_ranks.items(), key=lambda kv: kv[1])]
    path = os.path.join(root, "tokenizer-source")
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77).save_pretrained(path)
    return CLIPTokenizer.from_pretrained(path)


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    unet = moved(UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=[32, 64], layers_per_block=1,
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        attention_head_dim=[2, 4], cross_attention_dim=32, norm_num_groups=8, use_linear_projection=True,
        upcast_attention=True), 1)
    pixel = UNet2DConditionModel(**dict(unet.config, in_channels=3, out_channels=3))
    pixel.save_config(os.path.join(out_dir, "pixel-unet"))
    torch.manual_seed(2)
    vae = moved(AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=[32, 64],
                              down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                              latent_channels=4, layers_per_block=1, norm_num_groups=8, sample_size=16), 3)
    torch.manual_seed(4)
    text_encoder = moved(CLIPTextModel(CLIPTextConfig(
        vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, hidden_act="gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=1)), 5)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1, prediction_type="v_prediction")
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer(out_dir), unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(os.path.join(out_dir, "sd"), safe_serialization=True)

    g = torch.Generator().manual_seed(6)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    noise = torch.randn(2, 4, 8, 8, generator=g)
    timesteps = torch.tensor([17, 803])
    context = torch.randn(2, 77, 32, generator=g)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = scheduler.get_velocity(latents, noise, timesteps)
    pred = unet(noisy, timesteps, encoder_hidden_states=context).sample
    loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    loss.backward()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        unet(noisy[:1], timesteps[:1], encoder_hidden_states=context[:1])
    params = dict(unet.named_parameters())
    save_file({"latents": latents, "noise": noise, "timesteps": timesteps, "context": context, "noisy": noisy,
               "target": target, "pred": pred.detach().contiguous(), "loss": loss.detach().reshape(1),
               "flops": torch.tensor([float(counter.get_total_flops())], dtype=torch.float64),
               **{"grad." + n: params[n].grad.contiguous() for n in GRADS}},
              os.path.join(out_dir, "step.safetensors"))
    print("wrote a Stable Diffusion pipeline and one training step into", out_dir)


if __name__ == "__main__":
    main()
