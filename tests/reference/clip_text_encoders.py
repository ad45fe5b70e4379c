"""CLIP text encoders made and run by transformers and open_clip themselves, for
tests/unit/text/test_clip_text_encoder.cpp.

Three directories, each randomly initialised by its library from the configs open_clip ships
(model_configs/ViT-L-14.json, ViT-H-14.json) and saved in that library's own format:
  transformers_l14/  transformers' CLIPTextModelWithProjection with ViT-L/14's text tower
                     (quick_gelu, as OpenAI's CLIP and SD 1.x's text encoder; eos_token_id 2, the
                     legacy value SD 1.x's config carries, so pooling takes the argmax id)
  transformers_h14/  transformers' CLIPTextModel with ViT-H/14's text tower as SD 2.x's diffusers
                     text_encoder keeps it (gelu, one layer fewer: 23; eos_token_id 49407)
  open_clip_h14/     open_clip's whole ViT-H/14 CLIP (vision tower included), written as open_clip's
                     save_for_hf writes it (open_clip_config.json + open_clip_model.safetensors) and
                     read back through create_model("local-dir:...") before use
With "small", the text towers keep their configs' kinds but are cut to 2 layers of width 64 and
the vision tower to 1 layer of width 64, so that the fast tests can afford them; "full" keeps the
real sizes (ViT-H/14's text tower is 354M parameters).

For each directory, reference.safetensors holds the ids fed ([N, 77], tokenized by open_clip's
tokenizer; SD 1.x's padding with the end token for transformers_l14) and the outputs:
  last         the last layer's states after the final layer norm           [N, 77, width]
  penultimate  the last layer but one after the final layer norm (SD 2.x's) [N, 77, width]
  pooled       the end token's final state, projected where the model has a projection
transformers' penultimate is final_layer_norm(hidden_states[-2]) as diffusers' clip_skip takes it;
open_clip's is forward_intermediates(..., normalize_intermediates=True) as SD 2.x's embedder takes it.

Usage: python clip_text_encoders.py OUT_DIR small|full N_TEXTS   (the reference environment's python)
"""
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_tokenizer import corpus  # noqa: E402

import open_clip  # noqa: E402
import torch  # noqa: E402
from open_clip.push_to_hf_hub import save_config_for_hf  # noqa: E402
from open_clip.tokenizer import SimpleTokenizer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection  # noqa: E402


def shipped_config(name):
    return open_clip.get_model_config(name)


def save_reference(out_dir, ids, last, penultimate, pooled):
    save_file({"ids": ids.contiguous(), "last": last.contiguous(), "penultimate": penultimate.contiguous(),
               "pooled": pooled.contiguous()}, os.path.join(out_dir, "reference.safetensors"))


def transformers_model(out_dir, text_cfg, embed_dim, small, act, layers_delta, eos, with_projection, ids):
    width = 64 if small else text_cfg["width"]
    heads = 4 if small else text_cfg["heads"]
    layers = 2 if small else text_cfg["layers"] + layers_delta
    config = CLIPTextConfig(vocab_size=text_cfg["vocab_size"], hidden_size=width, intermediate_size=4 * width,
                            num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=text_cfg["context_length"], hidden_act=act,
                            projection_dim=32 if small else embed_dim, bos_token_id=49406, eos_token_id=eos,
                            pad_token_id=1)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    model = cls(config).eval()
    model.save_pretrained(out_dir)
    model = cls.from_pretrained(out_dir).eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        # transformers 5 keeps the layers at the top of CLIPTextModel (the file still says "text_model.")
        final_ln = getattr(model, "text_model", model).final_layer_norm
        penultimate = final_ln(out.hidden_states[-2])
        pooled = out.text_embeds if with_projection else out.pooler_output
    save_reference(out_dir, ids, out.last_hidden_state, penultimate, pooled)


def open_clip_model(out_dir, name, small, ids):
    cfg = shipped_config(name)
    if small:
        cfg["text_cfg"].update(width=64, heads=4, layers=2)
        cfg["vision_cfg"].update(width=64, layers=1, head_width=32, image_size=28)
        cfg["embed_dim"] = 32
    # create_model with the config's parts as overrides: the model, its preprocessing and its init
    # exactly as open_clip makes them for a name.
    model = open_clip.create_model(name, **cfg).eval()
    os.makedirs(out_dir, exist_ok=True)
    save_file(model.state_dict(), os.path.join(out_dir, "open_clip_model.safetensors"))
    save_config_for_hf(model, Path(out_dir) / "open_clip_config.json", model_config=cfg)
    model = open_clip.create_model("local-dir:" + out_dir).eval()
    layers = cfg["text_cfg"]["layers"]
    with torch.no_grad():
        out = model.forward_intermediates(text=ids, text_indices=[layers - 2], normalize=False,
                                          normalize_intermediates=True)
        last = model.ln_final(model.transformer(model.token_embedding(ids) + model.positional_embedding,
                                                attn_mask=model.attn_mask))
    save_reference(out_dir, ids, last, out["text_intermediates"][0], out["text_features"])


def main():
    out_dir, size, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert size in ("small", "full"), size
    small = size == "small"
    torch.manual_seed(20261128)
    torch.set_num_threads(int(os.environ.get("REFERENCE_THREADS", "1")))
    tok = SimpleTokenizer()
    # Captions of every kind the tokenizer tests use, the very long ones (truncated) among them.
    texts = [t for _, t in corpus(random.Random(20261129), 1 + n // 15, tok)]
    random.Random(7).shuffle(texts)
    texts = ([""] + texts)[:n]
    ids = open_clip.tokenize(texts).to(torch.int64)  # [n, 77], padded with 0 after the end token
    sd1_ids = ids.clone()
    for row in sd1_ids:  # SD 1.x's tokenizer pads with the end token
        end = int((row == 49407).nonzero()[0])
        row[end + 1:] = 49407
    l14, h14 = shipped_config("ViT-L-14"), shipped_config("ViT-H-14")
    transformers_model(os.path.join(out_dir, "transformers_l14"), l14["text_cfg"], l14["embed_dim"], small,
                       "quick_gelu", 0, 2, True, sd1_ids)
    transformers_model(os.path.join(out_dir, "transformers_h14"), h14["text_cfg"], h14["embed_dim"], small,
                       "gelu", -1, 49407, False, ids)
    open_clip_model(os.path.join(out_dir, "open_clip_h14"), "ViT-H-14", small, ids)
    with open(os.path.join(out_dir, "texts.json"), "w") as f:
        json.dump(texts, f)


if __name__ == "__main__":
    main()
