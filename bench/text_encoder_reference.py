"""CLIP ViT-L/14's text tower (SD 1.x's text encoder) in transformers, timed as ddm's is by
bench/bench_text_encoder.cpp: made by transformers from the config open_clip ships (randomly
initialised, seeded), saved as a CLIPTextModel directory for ddm to read, and run on a batch of
token ids (also saved, with the last hidden state, so ddm's output is compared on the same input)
in PyTorch eager and under torch.compile (inductor), without gradients. One JSON line each: the
first call and the best of REPEAT further calls.

Usage: python text_encoder_reference.py DIR BATCH THREADS [REPEAT]   (the reference environment's python)
"""
import json
import sys
import time

import open_clip
import torch
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel


def main():
    out_dir, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    repeat = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    torch.set_num_threads(threads)
    torch.manual_seed(20261129)
    t = open_clip.get_model_config("ViT-L-14")["text_cfg"]
    config = CLIPTextConfig(vocab_size=t["vocab_size"], hidden_size=t["width"], intermediate_size=4 * t["width"],
                            num_hidden_layers=t["layers"], num_attention_heads=t["heads"],
                            max_position_embeddings=t["context_length"], hidden_act="quick_gelu",
                            bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)
    model = CLIPTextModel(config).eval()
    model.save_pretrained(out_dir)
    # Captions of 5..75 tokens between start and end, padded with the end token as SD's tokenizer pads.
    ids = torch.full((batch, t["context_length"]), 49407, dtype=torch.long)
    for i in range(batch):
        n = int(torch.randint(5, 76, (1,)))
        ids[i, 0] = 49406
        ids[i, 1:n + 1] = torch.randint(0, 49406, (n,))
    with torch.no_grad():
        last = model(input_ids=ids).last_hidden_state
    save_file({"ids": ids, "last": last.contiguous()}, f"{out_dir}/bench.safetensors")
    params = sum(p.numel() for p in model.parameters())
    for impl in ("python", "python-compile"):
        run = torch.compile(model) if impl == "python-compile" else model
        with torch.no_grad():
            t0 = time.perf_counter()
            run(input_ids=ids)
            first = time.perf_counter() - t0
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                run(input_ids=ids)
                best = min(best, time.perf_counter() - t0)
        print(json.dumps({"impl": impl, "model": "ViT-L/14 text", "params": params, "batch": batch,
                          "tokens": t["context_length"], "threads": threads, "first_s": round(first, 4),
                          "best_s": round(best, 4), "texts_per_s": round(batch / best, 1)}), flush=True)


if __name__ == "__main__":
    main()
