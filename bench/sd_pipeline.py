"""A full-size Stable Diffusion pipeline directory with random weights, written by diffusers' own
save_pretrained, for measurements at the real shapes (bench/sd_phases.sh). KIND sd21 (the default):
  unet/          UNet2DConditionModel from SD 2.1's config (865M parameters)
  vae/           AutoencoderKL from SD's config (83.7M)
  text_encoder/  transformers' CLIPTextModel with ViT-H/14's text tower as SD 2.x keeps it (23 layers of
                 1024, gelu; 340M), from the config open_clip ships
  tokenizer/     CLIPTokenizer with CLIP's vocabulary and merges (open_clip's), 77 tokens
  scheduler/     DDIMScheduler as SD 2.1 (768) configures it: scaled_linear, v_prediction
KIND sd15-controlnet: ControlNet v1.0 on Stable Diffusion 1.5, a StableDiffusionControlNetPipeline:
  unet/          UNet2DConditionModel from SD 1.5's config (860M: 8 heads, 1x1 conv projections, 768)
  controlnet/    ControlNetModel.from_unet(unet) (361M), as ControlNet v1.0's config
  text_encoder/  CLIP ViT-L/14's text tower (12 layers of 768, quick_gelu; 123M), from open_clip's config
  vae/, tokenizer/ as above (SD 1.5's tokenizer pads with the end token); PNDMScheduler, epsilon
Seeded; nothing is downloaded.

Usage: python sd_pipeline.py OUT_DIR [sd21|sd15-controlnet]   (the reference environment's python)
"""
import os
import sys

import open_clip
import torch
from diffusers import (AutoencoderKL, ControlNetModel, DDIMScheduler, PNDMScheduler, StableDiffusionControlNetPipeline,
                       StableDiffusionPipeline, UNet2DConditionModel)
from open_clip.tokenizer import SimpleTokenizer
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sd_reference import SD15_UNET, UNET, VAE  # noqa: E402


def tokenizer(out_dir, pad_token):
    tok = SimpleTokenizer()
    vocab = dict(tok.encoder)
    vocab["<|startoftext|>"] = vocab.pop("<start_of_text>")
    vocab["<|endoftext|>"] = vocab.pop("<end_of_text>")
    merges = [m for m, _ in sorted(tok.bpe_ranks.items(), key=lambda kv: kv[1])]
    source = os.path.join(out_dir + ".tokenizer")
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token=pad_token).save_pretrained(source)
    return CLIPTokenizer.from_pretrained(source)


def sd15_controlnet(out_dir):
    t = open_clip.get_model_config("ViT-L-14")["text_cfg"]
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=t["vocab_size"], hidden_size=t["width"], intermediate_size=4 * t["width"],
        num_hidden_layers=t["layers"], num_attention_heads=t["heads"], max_position_embeddings=t["context_length"],
        hidden_act="quick_gelu", projection_dim=768, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407))
    unet = UNet2DConditionModel(**SD15_UNET)
    pipe = StableDiffusionControlNetPipeline(
        vae=AutoencoderKL(**VAE), text_encoder=text_encoder, tokenizer=tokenizer(out_dir, "<|endoftext|>"), unet=unet,
        controlnet=ControlNetModel.from_unet(unet),
        scheduler=PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", skip_prk_steps=True,
                                steps_offset=1, set_alpha_to_one=False),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    print("wrote a full-size ControlNet v1.0 on Stable Diffusion 1.5 (random weights) into", out_dir)


def main():
    out_dir = sys.argv[1]
    kind = sys.argv[2] if len(sys.argv) > 2 else "sd21"
    assert kind in ("sd21", "sd15-controlnet"), kind
    torch.manual_seed(20261129)
    if kind == "sd15-controlnet":
        return sd15_controlnet(out_dir)
    t = open_clip.get_model_config("ViT-H-14")["text_cfg"]
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=t["vocab_size"], hidden_size=t["width"], intermediate_size=4 * t["width"],
        num_hidden_layers=t["layers"] - 1, num_attention_heads=t["heads"], max_position_embeddings=t["context_length"],
        hidden_act="gelu", projection_dim=1024, bos_token_id=49406, eos_token_id=49407, pad_token_id=1))
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**VAE), text_encoder=text_encoder, tokenizer=tokenizer(out_dir, "!"),
        unet=UNet2DConditionModel(**UNET),
        scheduler=DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                                set_alpha_to_one=False, steps_offset=1, prediction_type="v_prediction"),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    print("wrote a full-size Stable Diffusion 2.1 pipeline (random weights) into", out_dir)


if __name__ == "__main__":
    main()
