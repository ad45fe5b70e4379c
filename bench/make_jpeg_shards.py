#!/usr/bin/env python3
"""Procedural colour JPEG shards in the WebDataset layout.

--style noise (the loader benchmark's, bench/loader.sh): a random colour field (8x8 random colours,
upsampled bicubically) with a few random ellipses and rectangles over it, so its compressed size and
decoding cost are those of a photograph's rather than of noise or of a flat image; label i % 1000.
--style shapes (a dataset to train on, bench/colour_e2e.sh): one large shape of 8 classes (circle,
square, triangle, diamond, ring, cross, hexagon, star; the label), in a random colour, size, place
and angle, on a two-colour gradient, drawn at 2x and downsampled (antialiased).
Saved as JPEG (quality 90). Sample i is key %08d with KEY.jpg and KEY.cls. Written with Python's
tarfile: the reader under test is ddm's, not this.

usage: make_jpeg_shards.py OUT_DIR --n N --width W --height H [--shards S] [--seed 0] [--style noise|shapes]
"""
import math
import multiprocessing
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
    return img, None


SHAPES = ["circle", "square", "triangle", "diamond", "ring", "cross", "hexagon", "star"]


def polygon(cx, cy, r, corners, angle, inner=None):
    """Vertices of a regular polygon (or, with inner, a star with that inner radius)."""
    pts = []
    steps = corners * (2 if inner else 1)
    for j in range(steps):
        a = angle + 2 * math.pi * j / steps
        rr = inner if inner and j % 2 else r
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def shapes_image(rng, w, h):
    s = 2  # drawn at 2x, then downsampled: antialiased edges
    W, H = w * s, h * s
    top, bottom = rng.integers(0, 256, size=3), rng.integers(0, 256, size=3)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    g = float(rng.uniform(0, 2 * math.pi))  # the gradient's direction
    proj = xx * math.cos(g) + yy * math.sin(g)
    t = ((proj - proj.min()) / (proj.max() - proj.min()))[:, :, None]
    bg = top[None, None, :] * (1 - t) + bottom[None, None, :] * t
    img = Image.fromarray(bg.astype(np.uint8))
    d = ImageDraw.Draw(img)
    label = int(rng.integers(0, len(SHAPES)))
    mean = (top + bottom) / 2
    colour = rng.integers(0, 256, size=3)
    if np.abs(colour - mean).sum() < 160:  # keep the shape visible against its background
        colour = 255 - colour if np.abs(255 - colour - mean).sum() > np.abs(colour - mean).sum() else colour
        colour = np.where(np.abs(colour - mean) < 60, np.where(mean > 127, 0, 255), colour)
    fill = tuple(int(c) for c in colour)
    r = float(rng.uniform(0.25, 0.4)) * min(W, H)
    cx, cy = float(rng.uniform(r, W - r)), float(rng.uniform(r, H - r))
    angle = float(rng.uniform(0, 2 * math.pi))
    kind = SHAPES[label]
    if kind == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif kind == "ring":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
        q = r * 0.55  # the hole shows the background again
        inner = Image.fromarray(bg.astype(np.uint8)).crop((int(cx - q), int(cy - q), int(cx + q), int(cy + q)))
        mask = Image.new("L", inner.size, 0)
        ImageDraw.Draw(mask).ellipse((0, 0, inner.size[0] - 1, inner.size[1] - 1), fill=255)
        img.paste(inner, (int(cx - q), int(cy - q)), mask)
    elif kind == "square":
        d.polygon(polygon(cx, cy, r, 4, angle), fill=fill)
    elif kind == "triangle":
        d.polygon(polygon(cx, cy, r, 3, angle), fill=fill)
    elif kind == "diamond":  # a rhombus: a square stretched along one diagonal
        a, b = r, r * 0.55
        pts = [(a, 0), (0, b), (-a, 0), (0, -b)]
        ca, sa = math.cos(angle), math.sin(angle)
        d.polygon([(cx + x * ca - y * sa, cy + x * sa + y * ca) for x, y in pts], fill=fill)
    elif kind == "cross":
        a, b = r, r * 0.33
        arms = [(-a, -b), (-b, -b), (-b, -a), (b, -a), (b, -b), (a, -b), (a, b), (b, b), (b, a), (-b, a), (-b, b), (-a, b)]
        ca, sa = math.cos(angle), math.sin(angle)
        d.polygon([(cx + x * ca - y * sa, cy + x * sa + y * ca) for x, y in arms], fill=fill)
    elif kind == "hexagon":
        d.polygon(polygon(cx, cy, r, 6, angle), fill=fill)
    else:  # star
        d.polygon(polygon(cx, cy, r, 5, angle, inner=r * 0.45), fill=fill)
    return img.resize((w, h), Image.LANCZOS), label


def encode(img):
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def write_shard(a, s, rng):
    per = (a.n + a.shards - 1) // a.shards
    path = os.path.join(a.out, "bench-%06d.tar" % s)
    with tarfile.open(path + ".partial", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(s * per, min(a.n, (s + 1) * per)):
            img, label = (image if a.style == "noise" else shapes_image)(rng, a.width, a.height)
            add(tar, "%08d.jpg" % i, encode(img))
            add(tar, "%08d.cls" % i, str(i % 1000 if label is None else label).encode())
    os.replace(path + ".partial", path)


def shapes_shard(job):
    a, s = job
    write_shard(a, s, np.random.default_rng([a.seed, s]))  # a generator per shard: shards in parallel


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--height", type=int, required=True)
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--style", choices=["noise", "shapes"], default="noise")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.style == "noise":  # one generator through every shard, in order (the loader benchmark's data)
        rng = np.random.default_rng(a.seed)
        for s in range(a.shards):
            write_shard(a, s, rng)
    else:
        with multiprocessing.Pool() as pool:
            pool.map(shapes_shard, [(a, s) for s in range(a.shards)])
    print("wrote %d samples in %d shards to %s" % (a.n, a.shards, a.out))


if __name__ == "__main__":
    main()
