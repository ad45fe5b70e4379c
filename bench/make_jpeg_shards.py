#!/usr/bin/env python3
"""Procedural colour JPEG shards in the WebDataset layout, for the loader benchmark (bench/loader.sh).

Each image is a smooth random colour field (8x8 random colours, upsampled bicubically) with a few
random ellipses and rectangles over it, saved as JPEG (quality 90), so its compressed size and
decoding cost are those of a photograph's rather than of noise or of a flat image. Sample i is key
%08d with KEY.jpg and KEY.cls (i % 1000). Written with Python's tarfile: the reader under test is
ddm's, not this.

usage: make_jpeg_shards.py OUT_DIR --n N --width W --height H [--shards S] [--seed 0]
"""
import argparse
import io
import os
import tarfile

import numpy as np
from PIL import Image, ImageDraw


def image(rng, w, h):
    small = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(w // 10, w // 2)), y0 + int(rng.integers(h // 10, h // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        (d.ellipse if rng.random() < 0.5 else d.rectangle)((x0, y0, x1, y1), fill=colour)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--height", type=int, required=True)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    per = (a.n + a.shards - 1) // a.shards
    for s in range(a.shards):
        path = os.path.join(a.out, "bench-%06d.tar" % s)
        with tarfile.open(path + ".partial", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * per, min(a.n, (s + 1) * per)):
                add(tar, "%08d.jpg" % i, image(rng, a.width, a.height))
                add(tar, "%08d.cls" % i, str(i % 1000).encode())
        os.replace(path + ".partial", path)
    print("wrote %d samples in %d shards to %s" % (a.n, a.shards, a.out))


if __name__ == "__main__":
    main()
