#!/usr/bin/env python3
"""The loader benchmark's Python side (bench/loader.sh): the pipeline ddm's ShardLoader runs, written
the way a PyTorch user writes it with webdataset and Pillow, on the same shards and worker count.

Per sample: JPEG decode to RGB (Pillow), a centre square crop, a resize to --resolution (Pillow's
bilinear, antialiased when shrinking), a random horizontal flip, HWC -> CHW; per batch: stack, to
float in [-1, 1], labels as int64. Shards shuffled and split among the workers, a shuffle buffer of
1000 samples (as ddm's data.shuffle_buffer default). Images per second over --steps batches after
--warmup, one JSON line.
"""
import argparse
import io
import json
import random
import time

import numpy as np
import torch
import webdataset as wds
from PIL import Image


def prepare(sample, res):
    img = Image.open(io.BytesIO(sample["jpg"])).convert("RGB")
    w, h = img.size
    s = min(w, h)
    left, top = (w - s) // 2, (h - s) // 2
    img = img.crop((left, top, left + s, top + s)).resize((res, res), Image.BILINEAR)
    a = np.asarray(img)
    if random.random() < 0.5:
        a = a[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1))), int(sample["cls"])


def collate(samples):
    x = torch.stack([s[0] for s in samples]).float().div_(127.5).sub_(1.0)  # [B, 3, S, S]
    y = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    return x, y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shards", help="brace pattern of the shards")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    ds = (wds.WebDataset(a.shards, shardshuffle=100, nodesplitter=None, workersplitter=wds.split_by_worker,
                         empty_check=False)
          .repeat()
          .shuffle(1000)
          .map(lambda s: prepare(s, a.resolution))
          .batched(a.batch, collation_fn=collate, partial=False))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=a.workers, prefetch_factor=2)
    it = iter(loader)
    for _ in range(a.warmup):
        next(it)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        x, y = next(it)
        assert x.shape == (a.batch, 3, a.resolution, a.resolution)
    dt = time.perf_counter() - t0
    print(json.dumps({"impl": "python", "mode": "loader", "resolution": a.resolution, "workers": a.workers,
                      "batch": a.batch, "steps": a.steps, "img_per_s": a.steps * a.batch / dt,
                      "webdataset": wds.__version__ if hasattr(wds, "__version__") else "?",
                      "pillow": Image.__version__}))


if __name__ == "__main__":
    main()
