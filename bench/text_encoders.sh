#!/usr/bin/env bash
# A frozen text encoder's forward, ddm against PyTorch eager and torch.compile, side by side on the
# same threads: CLIP ViT-L/14's text tower (SD 1.x's; 123M parameters), randomly initialised by
# transformers from the config open_clip ships, on BATCH captions of 77 tokens. Needs build/
# (scripts/setup.sh) with the benchmarks. Prints one JSON line per implementation (docs/results.md).
#
# usage: bench/text_encoders.sh [BATCH=64] [THREADS=2]
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-64} threads=${2:-2}
python=$(bash scripts/reference-env.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
OMP_NUM_THREADS=$threads "$python" bench/text_encoder_reference.py "$work" "$batch" "$threads"
OMP_NUM_THREADS=$threads build/ddm_bench_text_encoder "$work" --threads "$threads"
