#!/usr/bin/env bash
# Fingerprints of short training runs in every parallel mode, for checking that a change to the code's
# structure changes no result: data parallel (2 processes), DiLoCo (2 replicas), a pipeline with
# bubble filling (2 stages, ZB-H1) and a V-shaped pipeline (2 processes x 2 stages, ZB-V), each under
# `ddm launch` with 1 thread per process. Prints one line per run: its name, the sha256 of its
# losses (every step's, from metrics.jsonl) and of its final checkpoint's tensors (model, EMA,
# optimizer). Same binary twice: the same lines. Before and after a refactoring: the same lines.
# usage: scripts/same_results.sh [BUILD_DIR] [WORK_DIR]    (defaults: build, a temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
ddm=$(realpath "${1:-build}")/ddm
work=${2:-$(mktemp -d)}
[ -x "$ddm" ] || { echo "same_results: $ddm is not an executable (build first)" >&2; exit 2; }
mkdir -p "$work"
common=(--config configs/quickstart.toml --set train.steps=12 --set train.batch_size=32 --set train.log_every=1
        --set train.ckpt_every=12 --set train.threads=1 --set train.warmup=2 --set model.preset=unet-tiny)
run() {
  local name=$1 nproc=$2
  shift 2
  "$ddm" launch --nproc "$nproc" --timeout 600 -- train "${common[@]}" "$@" --out "$work/$name" --force \
    >"$work/$name.log" 2>&1 || { echo "same_results: $name failed; see $work/$name.log" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
  local ckpt losses tensors
  ckpt=$(ls -d "$work/$name"/ckpt/step-* | sort | tail -1)
  losses=$(python3 -c "import json,sys; print(' '.join(repr(json.loads(l)['loss']) for l in open(sys.argv[1])))" \
             "$work/$name/metrics.jsonl" | sha256sum | cut -c1-16)
  tensors=$(cat "$ckpt"/*.safetensors | sha256sum | cut -c1-16)
  echo "$name  losses $losses  weights $tensors  ($(basename "$ckpt"))"
}
run data-parallel 2 --set parallel.dp=0
run diloco 2 --set parallel.mode=diloco --set diloco.inner_steps=4
run pipeline-filled 2 --set parallel.pp=2 --set parallel.schedule=zb-h1 --set parallel.fill=true --set train.grad_accum=4
run pipeline-v 2 --set parallel.pp=2 --set parallel.schedule=zb-v --set train.grad_accum=4
