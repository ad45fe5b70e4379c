#!/usr/bin/env bash
# Stable Diffusion 2.1's UNet (865M parameters) and VAE, ddm against diffusers in PyTorch eager and
# torch.compile, side by side on the same threads and inputs: the UNet's forward + backward (a
# training step's compute) on BATCH latents of SIZE x SIZE with 77 text states, the VAE encoder's
# forward (SD training's frozen work) and the VAE's forward + backward on images of 8 SIZE. Both
# are randomly initialised by diffusers from SD 2.1's configs. Needs build/ (scripts/setup.sh) with
# the benchmarks and about 4 GB of disk. Prints one JSON line per implementation and piece
# (docs/results.md). COMPILE=0 skips torch.compile (its compilation takes minutes on a CPU).
#
# usage: bench/sd.sh [BATCH=1] [SIZE=32] [THREADS=2] [REPEAT=3]
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-1} size=${2:-32} threads=${3:-2} repeat=${4:-3}
python=$(bash scripts/reference-env.sh)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
OMP_NUM_THREADS=$threads "$python" bench/sd_reference.py "$work" "$batch" "$size" "$threads" "$repeat" "${COMPILE:-1}"
OMP_NUM_THREADS=$threads build/ddm_bench_sd "$work" --threads "$threads" --repeat "$repeat"
