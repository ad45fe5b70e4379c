"""Reads the TensorBoard event files of a directory with tensorboard's own EventAccumulator (what
TensorBoard's backend loads runs with), for tests/integration/test_train_watch.cpp: ddm writes the
files itself, so only tensorboard's reader can say that they hold what ddm meant to write.

Prints one JSON object:
  scalars  {tag: [[step, value], ...]}
  images   {tag: [[step, width, height, sha256 of the encoded PNG], ...]}

Usage: python tensorboard_events.py DIR   (the reference environment's python)
"""
import hashlib
import json
import sys

from tensorboard.backend.event_processing import event_accumulator as ea


def main():
    acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
    acc.Reload()
    tags = acc.Tags()
    out = {
        "scalars": {t: [[s.step, s.value] for s in acc.Scalars(t)] for t in tags["scalars"]},
        "images": {
            t: [[i.step, i.width, i.height, hashlib.sha256(i.encoded_image_string).hexdigest()] for i in acc.Images(t)]
            for t in tags["images"]
        },
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
