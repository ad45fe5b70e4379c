#!/usr/bin/env bash
# Training speed of two builds of ddm side by side, in every parallel mode: for checking that a change
# to the code's structure costs no speed (scripts/same_results.sh checks it changes no result). The
# modes of scripts/same_results.sh, longer (unet-tiny, 40 steps of batch 64, 1 thread per process):
# data parallel (2 processes), DiLoCo (2 replicas), a pipeline with bubble filling (2 stages, ZB-H1),
# a V-shaped pipeline (2 x 2 stages, ZB-V). Each round runs every mode with build A then build B (B
# first in odd rounds); a run's speed is its images per second over steps 11-40 (metrics.jsonl,
# logged every 10 steps). Prints, per mode, A's and B's median img/s over the rounds and the median
# of the per-round ratios B / A.
# usage: [MODES="data-parallel ..."] bench/same_speed.sh BUILD_A BUILD_B [ROUNDS]    (default 3 rounds, every mode)
set -euo pipefail
cd "$(dirname "$0")/.."
a=$(realpath "${1:?usage: $0 BUILD_A BUILD_B [ROUNDS]}")/ddm
b=$(realpath "${2:?usage: $0 BUILD_A BUILD_B [ROUNDS]}")/ddm
rounds=${3:-3}
for x in "$a" "$b"; do [ -x "$x" ] || { echo "same_speed: $x is not an executable" >&2; exit 2; }; done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--config configs/quickstart.toml --set train.steps=40 --set train.batch_size=64 --set train.log_every=10
        --set train.ckpt_every=40 --set train.threads=1 --set train.warmup=2 --set model.preset=unet-tiny)
declare -A modes=(
  [data-parallel]="--set parallel.dp=0"
  [diloco]="--set parallel.mode=diloco --set diloco.inner_steps=4"
  [pipeline-filled]="--set parallel.pp=2 --set parallel.schedule=zb-h1 --set parallel.fill=true --set train.grad_accum=4"
  [pipeline-v]="--set parallel.pp=2 --set parallel.schedule=zb-v --set train.grad_accum=4"
)
read -r -a order <<<"${MODES:-data-parallel diloco pipeline-filled pipeline-v}"  # MODES="diloco ...": only these
speed() {  # BINARY MODE -> img/s over steps 11-40
  local out="$work/run"
  # shellcheck disable=SC2086
  "$1" launch --nproc 2 --timeout 600 -- train "${common[@]}" ${modes[$2]} --out "$out" --force >"$work/log" 2>&1 ||
    { echo "same_speed: $2 with $1 failed:" >&2; tail -5 "$work/log" >&2; exit 1; }
  python3 -c "
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
later = [r['img_per_s'] for r in recs if r['step'] > 10]
print(len(later) / sum(1 / v for v in later))" "$out/metrics.jsonl"
}
echo "| mode | A img/s | B img/s | B / A (median of rounds) |"
echo "|---|---|---|---|"
for m in "${order[@]}"; do
  as=() bs=() rs=()
  for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then x=$(speed "$a" "$m"); y=$(speed "$b" "$m"); else y=$(speed "$b" "$m"); x=$(speed "$a" "$m"); fi
    as+=("$x") bs+=("$y") rs+=("$(python3 -c "print($y / $x)")")
  done
  python3 -c "
import statistics as s, sys
a, b, r = (list(map(float, x.split())) for x in sys.argv[2:5])
print(f'| {sys.argv[1]} | {s.median(a):.1f} | {s.median(b):.1f} | {s.median(r):.3f} (rounds: {\", \".join(f\"{x:.3f}\" for x in r)}) |')" \
    "$m" "${as[*]}" "${bs[*]}" "${rs[*]}"
done
