#!/usr/bin/env python3
"""A captioned dataset that shows whether text control works (docs/text.md, "The shapes dataset").

Procedural RGB images of one shape each: its shape, colour, size and position and the background are
drawn at random, and the caption says all five ("a small red star at the top left on a gray
background"). Some compositions are held out of the training split (every "red star"; every "small
ring" in the top row), so a model's prompt accuracy can be measured on compositions it has seen and
on ones it has only seen in parts.

Written as WebDataset tar shards, as img2dataset writes them: KEY.png and KEY.json, whose "caption"
ddm reads (docs/data.md, Captions) and whose other fields are the attributes. With --labels, also
KEY.cls: the shape's index (what a shape classifier trains on). Without it the shards are unlabelled,
so a text model is conditioned on the caption alone.

    OUT/train-000000.tar, ...   --n samples, the held-out compositions never among them
    OUT/test-000000.tar, ...    --test-n samples of every composition (attributes say which are held out)
    OUT/prompts-seen.txt        --prompts captions of seen compositions, one per line
    OUT/prompts-heldout.txt     --prompts captions of held-out compositions
    OUT/prompts.jsonl           both, with their attributes and "heldout" (what a report reads)
    OUT/shapes.json             the vocabulary, the held-out rules, the arguments

The same arguments write the same bytes (one seeded generator; tar members have fixed times). Only
the Python standard library is used (PNG by zlib, tar by tarfile), so it runs on a bare Debian.

usage: scripts/make_shapes.py --out DIR [--n 20000] [--test-n 2000] [--size 32] [--seed 0]
                              [--shard-size 5000] [--prompts 64] [--labels]
"""
import argparse
import io
import json
import math
import os
import random
import shutil
import struct
import sys
import tarfile
import zlib

SHAPES = ["circle", "square", "triangle", "star", "ring", "cross"]
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
    "magenta": (210, 50, 210),
    "cyan": (40, 210, 210),
    "white": (240, 240, 240),
}
BACKGROUNDS = {"black": (15, 15, 15), "gray": (110, 110, 110)}
SIZES = {"small": 0.12, "large": 0.25}  # the shape's radius, a share of the image side
ROWS = ["top", "middle", "bottom"]
COLUMNS = ["left", "centre", "right"]
CENTRES = [0.26, 0.5, 0.74]  # row / column centres, a share of the side
JITTER = 0.03  # each centre moves by up to this share of the side


def position_name(row, col):
    if row == 1 and col == 1:
        return "centre"
    if row == 1:
        return COLUMNS[col]
    if col == 1:
        return ROWS[row]
    return ROWS[row] + " " + COLUMNS[col]


POSITIONS = [position_name(r, c) for r in range(3) for c in range(3)]


def caption(a):
    where = "in the centre" if a["position"] == "centre" else "at the " + a["position"]
    return f"a {a['size']} {a['colour']} {a['shape']} {where} on a {a['background']} background"


def held_out(a):
    """The compositions the training split never shows."""
    if a["colour"] == "red" and a["shape"] == "star":
        return True
    return a["shape"] == "ring" and a["size"] == "small" and a["position"].startswith("top")


HELD_OUT_RULES = ["every red star", "every small ring in the top row (top left, top, top right)"]

STAR = [(math.sin(2 * math.pi * k / 10) * (1.0 if k % 2 == 0 else 0.45),
         -math.cos(2 * math.pi * k / 10) * (1.0 if k % 2 == 0 else 0.45)) for k in range(10)]


def inside_polygon(x, y, poly):
    c = False
    j = len(poly) - 1
    for i in range(len(poly)):
        xi, yi = poly[i]
        xj, yj = poly[j]
        if (yi > y) != (yj > y) and x < (xj - xi) * (y - yi) / (yj - yi) + xi:
            c = not c
        j = i
    return c


def inside(shape, u, v):
    """Whether (u, v), in the shape's own units (radius 1, y down), is inside it."""
    if shape == "circle":
        return u * u + v * v <= 1.0
    if shape == "square":
        return abs(u) <= 0.82 and abs(v) <= 0.82
    if shape == "triangle":  # apex up
        return -0.95 <= v <= 0.75 and abs(u) <= (v + 0.95) / 1.7 * 1.05
    if shape == "star":
        return inside_polygon(u, v, STAR)
    if shape == "ring":
        d = u * u + v * v
        return 0.36 <= d <= 1.0
    if shape == "cross":
        return (abs(u) <= 0.3 and abs(v) <= 1.0) or (abs(v) <= 0.3 and abs(u) <= 1.0)
    raise ValueError(shape)


def render(a, size, rng):
    bg = BACKGROUNDS[a["background"]]
    fg = COLOURS[a["colour"]]
    px = bytearray(bytes(bg) * (size * size))
    r = SIZES[a["size"]] * size
    row, col = divmod(POSITIONS.index(a["position"]), 3)
    cx = (CENTRES[col] + rng.uniform(-JITTER, JITTER)) * size
    cy = (CENTRES[row] + rng.uniform(-JITTER, JITTER)) * size
    for y in range(max(0, int(cy - r) - 1), min(size, int(cy + r) + 2)):
        for x in range(max(0, int(cx - r) - 1), min(size, int(cx + r) + 2)):
            if inside(a["shape"], (x + 0.5 - cx) / r, (y + 0.5 - cy) / r):
                o = 3 * (y * size + x)
                px[o:o + 3] = bytes(fg)
    return bytes(px)


def png(rgb, size):
    """An 8-bit RGB PNG of rows `rgb` (no filter)."""
    raw = b"".join(b"\x00" + rgb[3 * size * y:3 * size * (y + 1)] for y in range(size))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def draw(rng, allow):
    """Attributes drawn uniformly until `allow` accepts them."""
    while True:
        a = {
            "shape": rng.choice(SHAPES),
            "colour": rng.choice(list(COLOURS)),
            "size": rng.choice(list(SIZES)),
            "position": rng.choice(POSITIONS),
            "background": rng.choice(list(BACKGROUNDS)),
        }
        if allow(a):
            return a


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_split(out, prefix, n, shard_size, size, rng, allow, labels):
    shards = (n + shard_size - 1) // shard_size
    for s in range(shards):
        path = os.path.join(out, f"{prefix}-{s:06d}.tar")
        with tarfile.open(path + ".partial", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * shard_size, min(n, (s + 1) * shard_size)):
                a = draw(rng, allow)
                key = f"{i:08d}"
                meta = dict(caption=caption(a), **a, heldout=held_out(a))
                add(tar, key + ".png", png(render(a, size, rng), size))
                add(tar, key + ".json", (json.dumps(meta, sort_keys=True) + "\n").encode())
                if labels:
                    add(tar, key + ".cls", f"{SHAPES.index(a['shape'])}\n".encode())
        os.replace(path + ".partial", path)
        print(f"  {os.path.basename(path)}: samples {s * shard_size}..{min(n, (s + 1) * shard_size) - 1}", file=sys.stderr)
    return f"{prefix}-{{{0:06d}..{shards - 1:06d}}}.tar"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the directory to write (must not exist)")
    p.add_argument("--n", type=int, default=20000, help="training samples (default 20000)")
    p.add_argument("--test-n", type=int, default=2000, help="test samples, all compositions (default 2000)")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--shard-size", type=int, default=5000, help="samples per shard (default 5000)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per prompt file (default 64)")
    p.add_argument("--labels", action="store_true", help="also write KEY.cls, the shape's index")
    args = p.parse_args()
    for name in ("n", "test_n", "size", "shard_size", "prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.size < 16:
        p.error("--size must be at least 16 (a small shape is then 2 pixels across)")
    if os.path.exists(args.out):
        p.error(f"--out {args.out} already exists; remove it or choose another directory")
    partial = args.out.rstrip("/") + ".partial"
    if os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    rng = random.Random(args.seed)
    print(f"writing {args.n} training and {args.test_n} test images of {args.size}x{args.size} into {args.out}",
          file=sys.stderr)
    train = write_split(partial, "train", args.n, args.shard_size, args.size, rng, lambda a: not held_out(a), args.labels)
    test = write_split(partial, "test", args.test_n, args.shard_size, args.size, rng, lambda a: True, args.labels)
    prompts = []
    for kind, want in (("seen", False), ("heldout", True)):
        lines = []
        for _ in range(args.prompts):
            a = draw(rng, lambda a, want=want: held_out(a) == want)
            lines.append(caption(a))
            prompts.append(dict(caption=caption(a), **a, heldout=want))
        with open(os.path.join(partial, f"prompts-{kind}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    with open(os.path.join(partial, "prompts.jsonl"), "w") as f:
        for a in prompts:
            f.write(json.dumps(a, sort_keys=True) + "\n")
    record = {
        "format": "ddm shapes", "version": 1, "size": args.size, "seed": args.seed, "train": train,
        "train_samples": args.n, "test": test, "test_samples": args.test_n, "labels": args.labels,
        "shapes": SHAPES, "colours": COLOURS, "backgrounds": BACKGROUNDS, "sizes": SIZES, "positions": POSITIONS,
        "centres": CENTRES,
        "held_out": HELD_OUT_RULES,
    }
    with open(os.path.join(partial, "shapes.json"), "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(partial, args.out)
    print(f"wrote {args.out}: train with data.source = \"shards\", data.root = \"{args.out}/{train}\"", file=sys.stderr)


if __name__ == "__main__":
    main()
