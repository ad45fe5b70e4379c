"""A CMYK JPEG as Photoshop writes them (Adobe marker, inverted inks), made and read by Pillow, for
tests/unit/data/test_shards.cpp: ddm decodes such files itself, and Pillow's RGB of the same file is
what it should give.

Writes into DIR:
  cmyk.jpg   a 24 x 40 CMYK gradient (quality 95), saved by Pillow
  rgb.bin    Pillow's Image.open(cmyk.jpg).convert("RGB"), uint8, row by row (H, W, 3)

Usage: python cmyk_jpeg.py DIR   (the reference environment's python)
"""
import os
import sys

import numpy as np
from PIL import Image


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    h, w = 24, 40
    y = np.arange(h, dtype=np.float64)[:, None] / h
    x = np.arange(w, dtype=np.float64)[None, :] / w
    x, y = np.broadcast_arrays(x, y)
    inks = np.stack([0.8 * x, 0.6 * y, 0.3 + 0.4 * x * y, 0.1 + 0.5 * (1 - x)], axis=-1)  # C, M, Y, K in [0, 1]
    cmyk = np.clip(np.round(255 * inks), 0, 255).astype(np.uint8)
    Image.fromarray(cmyk, mode="CMYK").save(os.path.join(out, "cmyk.jpg"), quality=95)
    with Image.open(os.path.join(out, "cmyk.jpg")) as im:
        assert im.mode == "CMYK", im.mode
        rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    rgb.tofile(os.path.join(out, "rgb.bin"))
    print("wrote", out)


if __name__ == "__main__":
    main()
