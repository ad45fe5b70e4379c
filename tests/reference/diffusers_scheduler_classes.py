"""Which of the given class names the pinned diffusers has, and whether each is a scheduler of a beta
schedule (its config takes beta_start, beta_end, beta_schedule), for tests/unit/sd/test_scheduler.cpp:
ddm accepts and exports these names (sd::beta_scheduler_classes), so each must open in diffusers.

Writes DIR/classes.json, one JSON object {name: true | "why not"}.

Usage: python diffusers_scheduler_classes.py DIR NAME ...   (the reference environment's python)
"""
import inspect
import json
import os
import sys

import diffusers


def main():
    out = {}
    for name in sys.argv[2:]:
        cls = getattr(diffusers, name, None)
        if cls is None:
            out[name] = "diffusers has no class " + name
            continue
        params = inspect.signature(cls.__init__).parameters
        missing = [p for p in ("beta_start", "beta_end", "beta_schedule") if p not in params]
        out[name] = True if not missing else "its config has no " + ", ".join(missing)
    os.makedirs(sys.argv[1], exist_ok=True)
    with open(os.path.join(sys.argv[1], "classes.json"), "w") as f:
        json.dump(out, f)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
